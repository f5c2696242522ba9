"""The :class:`~ampkit.train.trainer.Trainer`'s settings, grouped: checkpoints, evaluation, logging,
automatic batch size. Each group is a small frozen dataclass that validates its own fields.

``Trainer(model, opt, amp, batches)`` needs none of them. The flat keywords of earlier releases
(``log_every=``, ``checkpoint_dir=``, ``eval_every=``, ...) still work: :func:`group_settings`
maps them onto the groups through one table, :data:`FLAT`, so both spellings take one path.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..loop.batches import check_batches
from ..step.precision import REFERENCE

__all__ = [
    "FLAT",
    "BatchConfig",
    "CheckpointConfig",
    "EvalConfig",
    "LogConfig",
    "TrainerSettings",
    "check_engine",
    "group_settings",
]

_SETUP = "call model, optimizer = amp.setup(model, optimizer) first and pass what it returns"


def check_engine(model: Any, optimizer: Any, amp: Any) -> None:
    """The Trainer's contract: ``model`` and ``optimizer`` went through ``amp.setup`` (refused
    when the Trainer is built, not at the first backward after its header was printed)."""
    if amp.model is None:
        raise ValueError(f"Trainer: the MixedPrecision engine was never set up; {_SETUP}")
    if amp.model is not model and getattr(model, "_orig_mod", None) is amp.model:
        raise ValueError(
            "Trainer: the model passed is a torch.compile wrapper of the set-up model (its "
            "state_dict keys gain '_orig_mod.', so checkpoints would not load into the model); "
            "compile in place instead: MixedPrecision(..., compile=True), or model.compile() "
            "before amp.setup, and pass the model amp.setup returned"
        )
    if amp.model is not model:
        raise ValueError(
            f"Trainer: the engine was set up with another model ({type(amp.model).__name__}) "
            f"than the one passed ({type(model).__name__}); {_SETUP}"
        )
    if not any(o is optimizer for o in amp.optimizers):
        raise ValueError(
            "Trainer: the optimizer passed to the Trainer was not given to amp.setup "
            f"({len(amp.optimizers)} optimizer(s) were); {_SETUP}"
        )


def _count(name: str, value: Any, none: bool = False) -> None:
    """``value`` is an integer >= 1 (or None where ``none``); else ``TypeError``/``ValueError``
    with the setting, the value and why (a bool is not a count: ``True`` meant 1)."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name}={value!r} must be an integer >= 1{' or None' if none else ''} (got "
            f"{type(value).__name__})"
        )
    if value < 1:
        raise ValueError(f"{name}={value!r} must be >= 1")


@dataclass(frozen=True)
class CheckpointConfig:
    """Crash-safe checkpoints (:mod:`ampkit.loop.checkpoint`): written to ``dir`` every ``every``
    optimizer steps (None: only on a graceful stop or :meth:`Trainer.save_checkpoint`), the newest
    ``keep_last`` kept (None: all)."""

    dir: Optional[str] = None
    every: Optional[int] = None
    keep_last: Optional[int] = 3

    def __post_init__(self) -> None:
        _count("checkpoint_every", self.every, none=True)
        _count("keep_last", self.keep_last, none=True)
        if self.every and not self.dir:
            raise ValueError("checkpoint_every needs a checkpoint_dir")


@dataclass(frozen=True)
class EvalConfig:
    """Periodic evaluation: the mean loss of ``steps`` held-out batches every ``every`` optimizer
    steps, in the training precision (``"train"``) or strict ``"fp32"``. ``batches`` is what the
    Trainer's own batches may be: a function of the index (``batches(0 .. steps-1)``), or a
    DataLoader, a list, a function returning a fresh iterator (its first ``steps`` batches, read
    anew at each evaluation; see :func:`ampkit.loop.batches.held_out`)."""

    batches: Any = None
    every: Optional[int] = None
    steps: int = 4
    precision: str = "train"

    def __post_init__(self) -> None:
        if self.batches is not None:
            check_batches(self.batches, "eval_batches", reiterable=True)
        if self.precision not in ("train", REFERENCE):
            raise ValueError(
                f"eval_precision={self.precision!r}; choose 'train' (the training precision) or 'fp32'"
            )
        _count("eval_every", self.every, none=True)
        _count("eval_steps", self.steps)
        if self.every is not None and self.batches is None:
            raise ValueError(f"eval_every={self.every} needs eval_batches (none were given)")


@dataclass(frozen=True)
class LogConfig:
    """What the run shows and writes: metrics read to the host every ``every`` optimizer steps (the
    loop's only syncs); ``log.jsonl``, ``summary.json`` and TensorBoard events (``tensorboard``, when
    installed) under ``dir``; a live progress bar (``progress``) on ``console`` (a rich Console).

    ``sinks``: more monitor sinks (anything with ``write(records)`` and ``close()``, e.g.
    :class:`~ampkit.observe.monitor.MLflowSink`, :class:`~ampkit.observe.monitor.WandbSink`), given
    the same record batches as ``log.jsonl``, in-process. The Trainer owns them: the monitor closes
    them when ``fit`` ends (normally or by an error), so they serve one ``fit``. Rank 0 alone
    writes: on other ranks they are closed unused at the start of ``fit``."""

    dir: Optional[str] = None
    every: int = 10
    tensorboard: bool = True
    progress: bool = True
    console: Any = None
    sinks: Sequence[Any] = ()

    def __post_init__(self) -> None:
        _count("log_every", self.every)
        if isinstance(self.sinks, (str, bytes)) or not isinstance(self.sinks, Iterable):
            raise TypeError(
                f"sinks={self.sinks!r} must be a list of sinks (objects with write(records) "
                "and close())"
            )
        object.__setattr__(
            self, "sinks", tuple(self.sinks)
        )  # frozen: a tuple, not the caller's list
        for s in self.sinks:
            if not (callable(getattr(s, "write", None)) and callable(getattr(s, "close", None))):
                raise TypeError(f"sink {s!r} must have write(records) and close() methods")


@dataclass(frozen=True)
class BatchConfig:
    """``size="auto"``: cut each batch into the fewest micro-batches whose predicted memory fits
    ``memory_budget`` (bytes or ``"8GiB"``; default on CUDA the free memory). Checked by the Trainer,
    which knows the number of processes (:func:`ampkit.plan.autobatch.check_auto_args`)."""

    size: Optional[str] = None
    memory_budget: Union[str, int, None] = None


@dataclass(frozen=True)
class TrainerSettings:
    """The four groups, as the Trainer holds them."""

    checkpoint: CheckpointConfig
    evaluation: EvalConfig
    log: LogConfig
    batching: BatchConfig


#: Each flat keyword of ``Trainer(...)`` -> (its group, the field).
FLAT: dict[str, tuple[str, str]] = {
    "checkpoint_dir": ("checkpoint", "dir"),
    "checkpoint_every": ("checkpoint", "every"),
    "keep_last": ("checkpoint", "keep_last"),
    "eval_batches": ("evaluation", "batches"),
    "eval_every": ("evaluation", "every"),
    "eval_steps": ("evaluation", "steps"),
    "eval_precision": ("evaluation", "precision"),
    "log_dir": ("log", "dir"),
    "log_every": ("log", "every"),
    "tensorboard": ("log", "tensorboard"),
    "progress": ("log", "progress"),
    "console": ("log", "console"),
    "batch_size": ("batching", "size"),
    "memory_budget": ("batching", "memory_budget"),
}

_GROUPS = {
    "checkpoint": CheckpointConfig,
    "evaluation": EvalConfig,
    "log": LogConfig,
    "batching": BatchConfig,
}


def group_settings(groups: dict[str, Any], flat: dict[str, Any]) -> TrainerSettings:
    """The Trainer's settings from its group keywords (``checkpoint=CheckpointConfig(...)``, ...; None
    for the defaults) and flat keywords (:data:`FLAT`), which replace single fields of their group
    (as ``MixedPrecision(config=..., **overrides)`` does). Raises ``TypeError`` for an unknown
    keyword or a group of the wrong type, ``ValueError`` for invalid values (each group's own check)."""
    unknown = sorted(set(flat) - set(FLAT))
    if unknown:
        raise TypeError(
            f"Trainer() got an unexpected keyword argument {unknown[0]!r}; the settings are "
            f"{', '.join(sorted(FLAT))} or the groups {', '.join(_GROUPS)}"
        )
    fields: dict[str, dict[str, Any]] = {name: {} for name in _GROUPS}
    for key, value in flat.items():
        group, field = FLAT[key]
        fields[group][field] = value
    built: dict[str, Any] = {}
    for name, cls in _GROUPS.items():
        given = groups.get(name)
        if given is not None and not isinstance(given, cls):
            raise TypeError(
                f"Trainer({name}=...) takes a {cls.__name__}, got {type(given).__name__}"
            )
        base = given if given is not None else cls()
        built[name] = dataclasses.replace(base, **fields[name]) if fields[name] else base
    return TrainerSettings(**built)
