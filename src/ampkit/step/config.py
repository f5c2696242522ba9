"""MixedPrecisionConfig: every knob of the engine and the loss scaler, typed, validated, documented.

One source of truth for defaults and help text: ``ampkit train`` builds its engine flags, and
``docs/reference/config.md`` is generated, from :func:`fields_help`.
The loss-scaling defaults are ``torch.amp.GradScaler``'s, so a default config scales exactly
like it.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Optional, Union

import torch

from . import tomlio
from .aliases import UnknownKeyError, canonical_keys
from .in_backward_rules import config_rule
from .precision import CANONICAL, parse_precision
from .rung import MASTERS, STATE_DTYPES, Rung, join_spec, split_spec

__all__ = [
    "DETERMINISTIC_CHOICES",
    "FP8_RECIPES",
    "MASTERS_CHOICES",
    "SCALE_RANGE",
    "STATE_DTYPES",
    "ConfigError",
    "FieldInfo",
    "MixedPrecisionConfig",
    "UnknownConfigKeyError",
    "canonical_config_keys",
    "canonical_precision",
    "check_deterministic",
    "check_run_file",
    "fields_help",
    "hint_kind",
    "normalize_patterns",
    "read_toml",
    "seal_run_file",
]

Pattern = Union[str, type]

FP8_RECIPES = (
    "tensorwise",
    "rowwise",
    "rowwise_with_gw_hp",
)  # torchao's Float8LinearRecipeName values
DETERMINISTIC_CHOICES = (False, True, "warn")
MASTERS_CHOICES = MASTERS  # bf16-pure's memory ladder: the one list is ampkit.step.rung's
# The initial loss scale's range: from the scale's floor, the smallest normal fp32
# (ampkit.step.scale_rules.SCALE_FLOOR; this module is a leaf), to 2**127, the largest power of two
# whose one growth step (x2) is still finite in fp32 (the scale is an fp32 tensor: 2**128 is inf).
SCALE_RANGE = (torch.finfo(torch.float32).tiny, 2.0**127)


class ConfigError(ValueError):
    """An invalid config value: the message names the field, the value and the allowed range."""


class UnknownConfigKeyError(ConfigError, UnknownKeyError):
    """A key that is neither a field nor an alias (:mod:`ampkit.step.aliases`): the message has a
    "did you mean" and the valid keys. Also a ``TypeError``, like an unexpected keyword argument."""


def _f(default: Any, help: str, choices: tuple = ()) -> Any:
    """A field with its help text (and, where the values are a closed set, the choices)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, init=False)  # the __init__ below: aliases first, then the fields
class MixedPrecisionConfig:
    """All settings of :class:`ampkit.MixedPrecision`. Validated on construction.

    Loss-scaling fields only matter for precisions that need a scaler (``fp16``, ``fp16-pure``);
    ``skip_nonfinite`` applies to every precision.
    """

    precision: str = _f(
        "auto",
        f"precision name or alias (O0/O1/O2 too): {', '.join(CANONICAL)}; bf16-pure "
        "with a memory-ladder rung: bf16-pure:<masters>[+bf16], e.g. bf16-pure:split",
    )
    init_scale: float = _f(2.0**16, "initial loss scale (as torch.amp.GradScaler)")
    growth_factor: float = _f(
        2.0, "multiply the scale by this after growth_interval finite steps (> 1)"
    )
    backoff_factor: float = _f(
        0.5, "multiply the scale by this when backing off after overflow (0 < x < 1)"
    )
    growth_interval: int = _f(2000, "consecutive finite steps before the scale grows (>= 1)")
    hysteresis: int = _f(
        1, "overflows tolerated before backing off (DeepSpeed 'hysteresis'; 1 = torch behaviour)"
    )
    consecutive_hysteresis: bool = _f(
        False, "refill the hysteresis budget on every finite step (DeepSpeed semantics)"
    )
    min_scale: Optional[float] = _f(
        None, "lower bound of the loss scale (None: unbounded, like torch)"
    )
    max_scale: Optional[float] = _f(
        None, "upper bound of the loss scale (None: unbounded, like torch)"
    )
    dynamic_scaling: bool = _f(
        True, "False keeps the scale constant at init_scale (non-finite steps are still skipped)"
    )
    skip_nonfinite: bool = _f(
        True, "skip optimizer steps whose gradients hold inf/NaN, in every precision"
    )
    autocast_cache: bool = _f(
        True, "let autocast cache casted weights within a forward (torch.autocast cache_enabled)"
    )
    accumulation_steps: int = _f(1, "micro-steps per optimizer step (the loss is divided by this)")
    clip_grad_norm: Optional[float] = _f(
        None, "clip the (unscaled) total gradient norm to this (None: no clipping)"
    )
    keep_fp32: tuple = _f(
        (), "modules to keep in fp32: qualified-name globs ('lm_head', '*.norm*') or types"
    )
    fallback: Union[bool, str] = _f(
        False,
        "fall back on numerical trouble: True (fp16 -> bf16 -> fp32) or a chain 'fp16,bf16,fp32' "
        "(rungs too: 'bf16-pure:stochastic,bf16-pure:split,fp32')",
    )
    fallback_patience: int = _f(
        8,
        "consecutive skipped (non-finite) steps that trigger a fallback, in every "
        "precision: overflowing fp16 steps, and non-finite bf16/tf32/fp32 steps (fewer are "
        "only skipped)",
    )
    fallback_check_every: int = _f(
        10,
        "optimizer steps between numerics checks: the fallback triggers, or with "
        "fallback off the exhausted-loss-scale guard (reads are asynchronous)",
    )
    fallback_recover_after: Optional[int] = _f(
        None,
        "after a fallback, retry the faster precision once this many "
        "optimizer steps ran clean (counted at the checks); the interval "
        "doubles each time trouble returns (None: stay fallen back)",
    )
    manifest_check_every: int = _f(
        1000,
        "optimizer steps between checks of the precision manifest for silent "
        "downgrades (dtypes only: no sync); 0 checks only at setup and resume",
    )
    compile: bool = _f(
        False, "torch.compile the model at the end of setup (in place: state_dict keys unchanged)"
    )
    fp8_recipe: str = _f("tensorwise", "torchao float8 recipe for precision fp8", FP8_RECIPES)
    fp8_emulate: bool = _f(
        False,
        "let fp8 run without fp8 tensor cores (CPU, older GPUs): torchao emulation, for tests",
    )
    deterministic: Union[bool, str] = _f(
        False,
        "deterministic kernels, applied by setup(): True "
        "(torch.use_deterministic_algorithms(True), cuDNN deterministic, no cuDNN "
        "benchmark, CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set), 'warn' (the same, "
        "but ops without a deterministic kernel only warn), False (leave torch as is)",
        DETERMINISTIC_CHOICES,
    )
    memory_efficient: bool = _f(
        False,
        "turn on the memory levers that keep the numerics: activation checkpointing of "
        "the model's repeated blocks (every nn.ModuleList's elements) at setup, and "
        "autocast_cache off; setup() records which (a memory_efficient event)",
    )

    masters: str = _f(
        "fp32",
        "bf16-pure's master weights (memory ladder): fp32 (14 B/param with AdamW), split "
        "(bf16 + int16 remainder, exact, 12), kahan (bf16 compensation, 12), stochastic (stochastic "
        "rounding, 10), none (weights stall; needs allow_stall)",
        MASTERS_CHOICES,
    )
    state_dtype: str = _f(
        "fp32",
        "bf16-pure's optimizer-state storage between steps: fp32, or bf16 (stochastically "
        "rounded; with masters=stochastic 6 B/param)",
        STATE_DTYPES,
    )
    allow_stall: bool = _f(
        False, "accept masters=none: bf16 weights without masters, whose small updates round away"
    )
    ladder_scratch_mib: int = _f(
        16,
        "MiB of scratch bf16-pure's ladder rungs keep between steps; a larger weight is "
        "stepped in pieces through it (element-wise torch optimizers; others see each weight "
        "whole, in a buffer that lives only inside the step)",
    )
    optimizer_in_backward: bool = _f(
        False, "step each parameter as its gradient becomes final, then free it (no full set held)"
    )

    def __init__(self, *args: Any, **settings: Any) -> None:
        """Every field by name (or in order); the names other tools use are accepted too
        (:func:`canonical_config_keys`: ``min_loss_scale=``, ``enabled=``, ``scaling_strategy=``).
        An unknown name raises :class:`UnknownConfigKeyError` (a ``TypeError`` too, as an
        unexpected keyword is), naming the closest valid key."""
        names = [f.name for f in fields(self)]
        if len(args) > len(names):
            raise TypeError(
                f"MixedPrecisionConfig takes at most {len(names)} positional arguments "
                f"({len(args)} given)"
            )
        values = canonical_config_keys(settings) if settings else {}
        for name, value in zip(names, args):
            if name in values:
                raise TypeError(f"MixedPrecisionConfig got multiple values for argument {name!r}")
            values[name] = value
        _rung_from_precision(values)
        for f in fields(self):
            default = f.default_factory() if f.default is MISSING else f.default  # type: ignore[misc]
            object.__setattr__(self, f.name, values.get(f.name, default))
        self.__post_init__()

    def __post_init__(self) -> None:
        """Type checks, canonical spellings and range checks (called last by ``__init__``)."""
        self._check_types()
        if self.memory_efficient:  # a lever that keeps numerics: casts redone instead of kept
            object.__setattr__(self, "autocast_cache", False)
        # Canonicalise the precision spelling once, at the edge.
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        _require(
            SCALE_RANGE[0] <= self.init_scale <= SCALE_RANGE[1],
            "init_scale",
            self.init_scale,
            "a finite number > 0, at least 2**-126 (the loss scale's floor: the smallest normal fp32) and at "
            "most 2**127 (the scale is an fp32 tensor)",
        )
        _require(
            self.growth_factor > 1.0 and math.isfinite(self.growth_factor),
            "growth_factor",
            self.growth_factor,
            "a finite number > 1.0 (use dynamic_scaling=False for a constant scale)",
        )
        _require(
            0.0 < self.backoff_factor < 1.0,
            "backoff_factor",
            self.backoff_factor,
            "a number with 0 < backoff_factor < 1",
        )
        _require(
            self.growth_interval >= 1, "growth_interval", self.growth_interval, "an integer >= 1"
        )
        _require(
            self.hysteresis >= 1,
            "hysteresis",
            self.hysteresis,
            "an integer >= 1 (1 = back off on every overflow)",
        )
        _require(
            self.accumulation_steps >= 1,
            "accumulation_steps",
            self.accumulation_steps,
            "an integer >= 1",
        )
        _require(
            self.fallback_patience >= 1,
            "fallback_patience",
            self.fallback_patience,
            "an integer >= 1",
        )
        _require(
            self.fp8_recipe in FP8_RECIPES,
            "fp8_recipe",
            self.fp8_recipe,
            f"one of: {', '.join(FP8_RECIPES)}",
        )
        _require(
            self.manifest_check_every >= 0,
            "manifest_check_every",
            self.manifest_check_every,
            "an integer >= 0 (0: only at setup and resume)",
        )
        try:
            Rung.of(self)  # the one check of masters and state_dtype
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _require(
            self.ladder_scratch_mib >= 1,
            "ladder_scratch_mib",
            self.ladder_scratch_mib,
            "an integer >= 1",
        )
        if self.rung.stalls and not self.allow_stall:
            raise ConfigError(
                "masters='none' is refused: without masters bf16 weights stall (an update below half "
                "the bf16 spacing rounds away: AdamW lr 1e-3 never moves a weight of 1.0, norm weights "
                "freeze). Use masters='split' (exact, 12 B/param with AdamW) or 'stochastic' (10), or "
                "pass allow_stall=True to accept the stall"
            )
        _require(*config_rule(self))  # optimizer_in_backward: accumulation, clipping, fp16 refused
        _require(
            self.fallback_check_every >= 1,
            "fallback_check_every",
            self.fallback_check_every,
            "an integer >= 1",
        )
        _require(
            self.fallback_recover_after is None or self.fallback_recover_after >= 1,
            "fallback_recover_after",
            self.fallback_recover_after,
            "None or an integer >= 1",
        )
        for name in ("min_scale", "max_scale", "clip_grad_norm"):
            v = getattr(self, name)
            _require(
                v is None or (v > 0 and math.isfinite(v)), name, v, "None or a finite number > 0"
            )
        lo = self.min_scale if self.min_scale is not None else 0.0
        hi = self.max_scale if self.max_scale is not None else math.inf
        _require(lo <= hi, "max_scale", self.max_scale, f"None or >= min_scale ({self.min_scale})")
        _require(
            lo <= self.init_scale <= hi,
            "init_scale",
            self.init_scale,
            f"a value within [min_scale, max_scale] = [{self.min_scale}, {self.max_scale}]",
        )

    def _check_types(self) -> None:
        keep = self.keep_fp32
        if isinstance(keep, (str, type)):
            keep = (keep,)
        if not isinstance(keep, (list, tuple)):
            raise ConfigError(
                f"keep_fp32={keep!r} must be a list of module-name globs or module types"
            )
        try:
            object.__setattr__(self, "keep_fp32", normalize_patterns(keep))
        except TypeError as e:
            raise ConfigError(str(e)) from None
        check_deterministic(self.deterministic)
        if not isinstance(self.fallback, (bool, str)):
            raise ConfigError(
                f"fallback={self.fallback!r} must be True/False or a chain like 'fp16,bf16,fp32'"
            )
        if isinstance(self.fallback, str):
            # "bf16-pure:split": a rung (step/fallback.py); a bad name or rung raises PrecisionError
            chain = tuple(
                canonical_precision(x) if ":" not in x else join_spec(*split_spec(x.strip()))
                for x in self.fallback.split(",")
                if x.strip()
            )
            if not chain or any(c in ("auto", "O2") for c in chain):
                raise ConfigError(
                    f"fallback={self.fallback!r} must name concrete precisions, e.g. 'fp16,bf16,fp32'"
                )
            object.__setattr__(self, "fallback", ",".join(chain))
        for info in fields_help():
            if info.name in ("keep_fp32", "fallback", "deterministic"):
                continue
            v, expected = getattr(self, info.name), info.kind
            if v is None and info.optional:
                continue
            if expected is float and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, info.name, float(v))
                continue
            if expected is str and info.name == "precision" and isinstance(v, torch.dtype):
                continue
            if info.name == "precision" and isinstance(v, int) and not isinstance(v, bool):
                object.__setattr__(self, "precision", str(v))  # 16 / 32, as Lightning and the CLI
                continue
            if not isinstance(v, expected) or (expected is int and isinstance(v, bool)):
                raise ConfigError(
                    f"{info.name}={v!r} has type {type(v).__name__}; expected "
                    f"{expected.__name__}{' or None' if info.optional else ''}"
                )

    @property
    def rung(self) -> Rung:
        """The memory-ladder rung of ``masters`` and ``state_dtype`` (:mod:`ampkit.step.rung`)."""
        return Rung.of(self)

    @property
    def spec(self) -> str:
        """The precision with its rung, spelled once: ``"bf16-pure:split"``, or the name alone."""
        return join_spec(self.precision, None if self.rung.plain else self.rung)

    def replace(self, **changes: Any) -> MixedPrecisionConfig:
        """A validated copy with ``changes`` applied (aliases accepted; unknown names raise :class:`ConfigError`).
        A precision given with its rung (``precision="bf16-pure:split"``) replaces the rung too."""
        changes = canonical_config_keys(changes)
        base = self.to_dict()
        if split_spec(changes.get("precision"))[1] is not None:
            for key in ("masters", "state_dtype", "allow_stall"):
                base.pop(key)
        return MixedPrecisionConfig.from_dict({**base, **changes})

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON/TOML-serialisable dict; ``from_dict(to_dict())`` round-trips."""
        d = asdict(self)
        d["keep_fp32"] = list(self.keep_fp32)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MixedPrecisionConfig:
        """Build from a dict. Aliases from other tools are accepted (:data:`ampkit.step.aliases.KEY_ALIASES`:
        ``min_loss_scale``, ``loss_scale_window``, ``dtype``, ``scaling_strategy``, ...); unknown keys
        raise :class:`UnknownConfigKeyError` with a "did you mean" and the valid keys."""
        if not isinstance(data, dict):
            raise ConfigError(f"expected a dict of config values, got {type(data).__name__}")
        return cls(**data)  # aliases and unknown keys: the constructor's canonical_config_keys

    @classmethod
    def from_toml(cls, path: str) -> MixedPrecisionConfig:
        """Read a TOML file: top-level keys, or an ``[amp]`` table."""
        data = read_toml(path)
        return cls.from_dict(data.get("amp", data) if isinstance(data.get("amp"), dict) else data)


def _signature() -> inspect.Signature:
    """What ``help()`` and editors show for ``MixedPrecisionConfig(...)``: every field with its
    default and type, then ``**aliases`` (the ``__init__`` itself takes ``*args, **settings``)."""
    P = inspect.Parameter
    params = [
        P(f.name, P.POSITIONAL_OR_KEYWORD, default=f.default, annotation=f.type)
        for f in fields(MixedPrecisionConfig)
    ]
    return inspect.Signature([*params, P("aliases", P.VAR_KEYWORD, annotation="Any")])


MixedPrecisionConfig.__signature__ = _signature()  # type: ignore[attr-defined]  # documentation only


def canonical_config_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with aliases renamed to :class:`MixedPrecisionConfig` fields (the one table:
    :mod:`ampkit.step.aliases`); every config reader goes through it. Raises
    :class:`UnknownConfigKeyError` / :class:`ConfigError`."""
    try:
        return canonical_keys(data, [f.name for f in fields(MixedPrecisionConfig)])
    except UnknownKeyError as e:
        raise UnknownConfigKeyError(str(e)) from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class FieldInfo:
    """One :class:`MixedPrecisionConfig` field as the CLI and the reference docs see it, read from
    its resolved type hint (``typing.get_type_hints``), not from the annotation's text."""

    name: str
    annotation: (
        str  # for people (the reference docs): as written in the class, e.g. "Optional[float]"
    )
    kind: type  # the value's base type: bool, int, float, str, or object (keep_fp32)
    optional: bool  # None is a valid value
    help: str
    default: Any
    choices: tuple = ()  # a closed set of values, where there is one
    toggle: bool = False  # Union[bool, X]: on, off, or a value (fallback, deterministic)
    hint: Any = None  # the resolved type hint, e.g. typing.Optional[float]


def fields_help() -> list[FieldInfo]:
    """Every field of :class:`MixedPrecisionConfig`, in order: the CLI's engine flags and
    ``docs/reference/config.md`` are generated from this."""
    return list(_field_infos())


@functools.cache
def _field_infos() -> tuple[FieldInfo, ...]:
    hints = typing.get_type_hints(MixedPrecisionConfig)
    out = []
    for f in fields(MixedPrecisionConfig):
        hint = hints[f.name]
        kind, optional, toggle = hint_kind(hint)
        default = f.default if f.default is not MISSING else None
        out.append(
            FieldInfo(
                f.name,
                _written(f.type),
                kind,
                optional,
                f.metadata.get("help", ""),
                default,
                tuple(f.metadata.get("choices", ())),
                toggle,
                hint,
            )
        )
    return tuple(out)


def hint_kind(hint: Any) -> tuple[type, bool, bool]:
    """``(kind, optional, toggle)`` of a resolved type hint: ``Optional[float]`` -> ``(float, True,
    False)``, ``Union[bool, str]`` -> ``(bool, False, True)``, ``tuple`` -> ``(object, False, False)``."""
    args = typing.get_args(hint) if typing.get_origin(hint) is Union else (hint,)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)]
    toggle = len(kinds) > 1 and kinds[0] is bool
    kind = kinds[0] if len(kinds) >= 1 and kinds[0] in (bool, int, float, str) else object
    return kind, optional, toggle


def _written(annotation: Any) -> str:
    """The annotation as the class spells it (a string under ``from __future__ import annotations``)."""
    return (
        annotation
        if isinstance(annotation, str)
        else getattr(annotation, "__name__", str(annotation))
    )


def check_deterministic(value: Any) -> None:
    """Raise :class:`ConfigError` unless ``value`` is one of :data:`DETERMINISTIC_CHOICES`."""
    # `is`: 1, 0 and "true" are not the bools (1 == True), and a typo must not pass as "on".
    if not any(value is c for c in (False, True)) and not (
        isinstance(value, str) and value == "warn"
    ):
        raise ConfigError(
            f"invalid deterministic={value!r}: must be one of "
            f"{', '.join(map(repr, DETERMINISTIC_CHOICES))}"
        )


def _rung_from_precision(values: dict[str, Any]) -> None:
    """``precision="bf16-pure:split"``: the precision's name and its rung's fields into ``values``;
    a ``masters``/``state_dtype`` given beside it must say the same (the rung is one value)."""
    name, rung = split_spec(values.get("precision"))
    if rung is None:
        return
    for key, value in rung.fields().items():
        if key in values and values[key] != value and key != "allow_stall":
            raise ConfigError(
                f"precision={values['precision']!r} says {key}={value!r}, but {key}={values[key]!r} "
                f"was given too; give the rung once: precision='{join_spec(name, rung)}', or "
                f"precision={name!r} with masters= (one of: {', '.join(MASTERS)}) and state_dtype= "
                f"(one of: {', '.join(STATE_DTYPES)})"
            )
        values.setdefault(key, value)
    values["precision"] = name


def canonical_precision(value: Any) -> str:
    """The canonical name of a precision spelling (``"16-mixed"`` -> ``"fp16"``, ``"O1"`` -> ``"auto"``;
    ``"O2"`` stays ``"O2"``: the pure form of the device's auto dtype, resolved later)."""
    name = parse_precision(value)  # raises PrecisionError (a ValueError) with the valid names
    return "O2" if name == "o2" else name


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"invalid {name}={value!r}: must be {allowed}")


# A run file (the service's run.toml) proves it is whole: its first line is RUN_FILE_HEAD and its
# last line the sha256 of every byte before that line. TOML cut at a line boundary is still TOML
# (a run of 4 steps instead of 40); a sealed file cut or changed anywhere (also to nothing, or inside
# the head: every default) is refused. A file without the head (a user's own config) is read as is.
RUN_FILE_HEAD = "# ampkit run file: written by ampkit serve; its last line is the sha256 of the lines above it\n"
_SEAL = "# end sha256="


def seal_run_file(text: str) -> str:
    """``text`` (TOML) as a sealed run file: the head line, ``text``, then the digest line."""
    import hashlib

    body = RUN_FILE_HEAD + text + ("" if text.endswith("\n") else "\n")
    return body + _SEAL + hashlib.sha256(body.encode("utf-8")).hexdigest() + "\n"


def check_run_file(data: bytes, path: str) -> None:
    """A run file cut or changed (its digest line missing or wrong; empty; ending inside the head):
    ``ConfigError`` naming the file; anything else (a user's own config, a whole run file) passes."""
    import hashlib

    head = RUN_FILE_HEAD.encode()
    if not data.strip():
        raise ConfigError(
            f"config file {path!r} is empty: nothing can be read from it (a run file cut to "
            "nothing reads as every default); write the settings into it, or, for a run of "
            "the service, submit the run again"
        )
    body, _, last = data.rstrip(b"\n").rpartition(b"\n")
    seal = last.decode("ascii", "replace")
    if head.startswith(data.rstrip(b"\r\n")):
        why = "nothing follows its first line or part of it (the file was cut short)"
    elif not data.startswith(head):
        return
    elif not seal.startswith(_SEAL):
        why = "its last line is not the digest line (the file was cut short)"
    elif seal[len(_SEAL) :] != hashlib.sha256(body + b"\n").hexdigest():
        why = "its digest does not match its content (the file was cut short or changed)"
    else:
        return
    raise ConfigError(
        f"run file {path!r} is damaged: {why}; it is not used. The service keeps each run's "
        "request: submit the run again"
    )


def read_toml(path: str) -> dict[str, Any]:
    """The TOML file at ``path`` (a damaged service run file is refused: :func:`check_run_file`)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} does not exist") from None
    check_run_file(data, path)
    try:
        return tomlio.loads(data)
    except tomlio.TomlError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None


def normalize_patterns(patterns: Iterable[Pattern]) -> tuple[str, ...]:
    """Turn module types into dotted-path strings (config-friendly); validate the rest."""
    out = []
    for p in patterns:
        if isinstance(p, type):
            if not issubclass(p, torch.nn.Module):
                raise TypeError(f"keep_fp32 type {p!r} is not a torch.nn.Module subclass")
            out.append(f"{p.__module__}.{p.__qualname__}")
        elif isinstance(p, str) and p.strip():
            out.append(p.strip())
        else:
            raise TypeError(
                f"keep_fp32 entries must be module-name globs or module types, got {p!r}"
            )
    return tuple(out)
