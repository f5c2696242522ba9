"""Confirm ``auto``'s hardware pick by measuring it on the model about to train (CPU).

``auto`` is a hardware rule (bf16 where the CPU has AMX-BF16 or AVX512-BF16). On a CPU the rule
is not enough: for small models casts and element-wise work dominate and bf16 can be slower than
fp32 (0.69x-0.92x for the built-in tiny/small models on an AMX Xeon). So before a run whose
precision is ``auto`` takes its first step, :func:`confirm_auto` has :func:`measured_choice` time
a few training steps of the real model in fp32 and in the hardware pick, interleaved, keeps the
pick only if it is faster by more than the repeats' own spread (else fp32: no numerics risk for
a gain it cannot show; the reason says "within noise"), switching the engine to fp32 if that
wins, and caches the verdict per (CPU, torch,
threads, model, batch) in ``$AMPKIT_CACHE_DIR`` (default ``~/.cache/ampkit``), so later runs start
at once. The :class:`~ampkit.train.trainer.Trainer` calls it before its first step, and ``ampkit
train`` before it prints the run's header: ``MixedPrecision("auto")`` with a Trainer, a user's
own loop calling :func:`confirm_auto`, and ``ampkit train --precision auto`` pick the same
precision on one machine. GPUs keep the hardware rule: bf16/fp16 tensor cores pay off there."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from ..distributed import world_size
from ..loop.batches import BatchSource
from ..loop.checkpoint import capture_rng, restore_rng
from ..loop.steps import LossFn, Steps, batch_loss
from ..step.engine import MixedPrecision
from ..step.hardware import cpu_features
from ..step.logs import logger
from ..step.precision import REFERENCE
from .speed import Timing, paired_ratio, speed_words, within_noise

__all__ = [
    "Choice",
    "auto_decision",
    "cache_path",
    "confirm_auto",
    "measured_choice",
    "model_signature",
]


@dataclass(frozen=True)
class Choice:
    """The precision to train in, and why (``reason`` is one sentence for the run header)."""

    precision: str
    reason: str
    speedups: dict[str, float]  # candidate -> speed relative to fp32 (> 1 is faster)
    cached: bool
    timed: str = ""  # what was timed: "whole training step, 1 thread, 3 repeats of 2 steps, ±4%"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cache_path() -> str:
    root = os.environ.get("AMPKIT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "ampkit"
    )
    return os.path.join(root, "auto-precision.json")


def model_signature(model: torch.nn.Module, batch: Any) -> str:
    """What the speed of a training step depends on, as text: the model's class, its parameters'
    names, shapes and dtypes, and the shapes and dtypes of the batch's tensors. The cache key is
    built from it, so every caller -- CLI, Trainer, library -- finds the same verdict for the
    same model and batch, whatever label it prints."""
    params = [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    items = (
        batch.values()
        if isinstance(batch, dict)
        else batch
        if isinstance(batch, (tuple, list))
        else [batch]
    )
    tensors = [(list(t.shape), str(t.dtype)) for t in items if isinstance(t, torch.Tensor)]
    return json.dumps([type(model).__qualname__, params, tensors])


def _key(signature: str, candidate: str) -> str:
    cpu = cpu_features()
    text = json.dumps(
        [
            cpu.model,
            sorted(cpu.flags),
            torch.__version__,
            torch.get_num_threads(),
            signature,
            candidate,
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _entry_digest(entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_cache() -> dict[str, Any]:
    """The cached verdicts whose digest matches: a changed byte (a speed-up of 0.75 read as 1.75
    still parses) is never read, its verdict is measured again; so is one kept without a digest."""
    path = cache_path()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) else f"not JSON: {e}"
        _report(path, f"is damaged ({why})")
        return {}
    if not isinstance(data, dict):
        _report(path, "is damaged (not a table of verdicts)")
        return {}
    good = {
        k: v for k, v in data.items() if isinstance(v, dict) and v.get("sha256") == _entry_digest(v)
    }
    if len(good) < len(data):
        n = len(data) - len(good)
        _report(path, f"holds {n} verdict(s) that do not match their digest")
    return good


_reported: set[tuple[str, int, int]] = set()


def _report(path: str, what: str) -> None:
    """Say once per state of the file (its size and time) that it is damaged."""
    try:
        st = os.stat(path)
        state = (path, st.st_size, st.st_mtime_ns)
    except OSError:
        state = (path, -1, -1)
    if state not in _reported:
        _reported.add(state)
        logger.warning(_DAMAGED, path, what)


_DAMAGED = (
    "ampkit: the auto-precision cache %s %s: not read; what it held is measured again "
    "(and the file rewritten whole)"
)


def _write_cache(data: dict[str, Any]) -> None:
    path = cache_path()
    data = {k: {**v, "sha256": _entry_digest(v)} for k, v in data.items()}
    with contextlib.suppress(OSError):  # a cache that cannot be written only costs a re-measurement
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _time_steps(
    model: torch.nn.Module,
    batches: Callable[[int], Any],
    precision: str,
    device: torch.device,
    steps: int,
    blocks: int,
    loss_fn: LossFn,
) -> list[float]:
    """Per-block mean step time (s) of ``steps`` AdamW steps, after one warm-up step."""
    model = copy.deepcopy(model)
    amp = MixedPrecision(precision, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
    model, opt = amp.setup(model, opt)
    run = Steps(model, opt, amp, loss_fn)
    run.micro_step(batches(0))
    out = []
    for b in range(blocks):
        t0 = time.perf_counter()
        for i in range(steps):
            run.micro_step(batches(1 + b * steps + i))
        out.append((time.perf_counter() - t0) / steps)
    return out


def _measure(
    model: torch.nn.Module,
    batches: Callable[[int], Any],
    candidate: str,
    device: torch.device,
    steps: int,
    blocks: int,
    loss_fn: LossFn,
) -> tuple[float, float]:
    """fp32's median step time over ``candidate``'s, in interleaved blocks, and the spread of the
    blocks' paired ratios (:func:`.speed.paired_ratio`). The RNG states (torch, numpy, Python) are
    put back afterwards: measuring leaves the run's random stream where it was."""
    rng = capture_rng()
    try:
        times: dict[str, list[float]] = {"fp32": [], candidate: []}
        for b in range(blocks):
            order = ("fp32", candidate) if b % 2 == 0 else (candidate, "fp32")
            for name in order:
                times[name] += _time_steps(model, batches, name, device, steps, 1, loss_fn)
    finally:
        restore_rng(rng)
    return paired_ratio(times["fp32"], times[candidate])


def measured_choice(
    model: torch.nn.Module,
    batches: Callable[[int], Any],
    candidate: str,
    device: torch.device,
    *,
    label: Optional[str] = None,
    batch_size: Optional[int] = None,
    steps: int = 2,
    blocks: int = 3,
    use_cache: bool = True,
    loss_fn: LossFn = batch_loss,
) -> Choice:
    """Train ``candidate`` (the hardware pick) against fp32 on copies of ``model`` and choose.

    Interleaved blocks of ``steps`` steps each (``blocks`` per precision), median per precision;
    ``candidate`` wins only if it is faster than fp32 by more than the blocks' spread
    (:func:`.speed.within_noise`); the reason says what was timed.
    The verdict is cached under the model's and
    batch's :func:`model_signature` (module doc); ``label`` (default: the model's class) only names
    the model in the reason, ``batch_size`` is kept with the cached verdict for a reader. The model
    and the RNG states are not changed. Costs ~``2 * (blocks * steps + 1)`` training steps on a
    cache miss.
    """
    if candidate == REFERENCE:
        return Choice(
            "fp32", "fp32 is the hardware rule's pick; nothing to measure", {"fp32": 1.0}, False
        )
    label = label or type(model).__name__
    key = _key(model_signature(model, batches(0)), candidate)
    cache = _read_cache() if use_cache else {}
    hit = cache.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("speedup"), (int, float)):
        speedup, cached = float(hit["speedup"]), True
        kept = hit.get("spread", 0.0)  # (verdicts cached before spreads were kept: taken as exact)
        spread = math.inf if kept is None else float(kept)
        timed = str(hit.get("timed", ""))
    else:
        speedup, spread = _measure(model, batches, candidate, device, steps, blocks, loss_fn)
        cached = False
        timed = Timing(
            "whole training step",
            torch.get_num_threads(),
            blocks,
            spread,
            f"{steps} step{'s' if steps != 1 else ''}",
        ).describe()
        if use_cache:
            kept = spread if math.isfinite(spread) else None
            cache[key] = {
                "speedup": speedup,
                "spread": kept,
                "timed": timed,
                "label": label,
                "batch_size": batch_size,
                "candidate": candidate,
                "cpu": cpu_features().model,
                "torch": torch.__version__,
                "measured": time.time(),
            }
            _write_cache(cache)
    how = "cached measurement" if cached else "measured just now"
    how += f": {timed}" if timed else ""
    speeds = {"fp32": 1.0, candidate: speedup}
    if speedup > 1.0 and not within_noise(speedup, spread):
        return Choice(
            candidate,
            f"{candidate} trains {label} {speedup:.2f}x as fast as fp32 here ({how})",
            speeds,
            cached,
            timed,
        )
    if speedup > 1.0:
        return Choice(
            "fp32",
            f"the hardware rule picks {candidate}, but {candidate} trains {label} at "
            f"{speed_words(speedup, spread)} here ({how}): not clearly faster, so fp32",
            speeds,
            cached,
            timed,
        )
    return Choice(
        "fp32",
        f"the hardware rule picks {candidate}, but {candidate} trains {label} at {speedup:.2f}x "
        f"fp32's speed here ({how}), so fp32",
        speeds,
        cached,
        timed,
    )


def auto_decision(amp: MixedPrecision) -> Optional[dict[str, Any]]:
    """What :func:`confirm_auto` decided for this run (the ``auto_precision`` event's data:
    ``precision``, ``reason``, ``speedups``, ``cached``), or None if it has not measured. The event
    is kept in the engine's state, so a resumed run knows it too."""
    return next((dict(e.data) for e in amp.events if e.kind == "auto_precision"), None)


def confirm_auto(
    amp: MixedPrecision,
    model: torch.nn.Module,
    batches: Any,
    *,
    loss_fn: LossFn = batch_loss,
    label: Optional[str] = None,
    use_cache: bool = True,
    announce: Optional[Callable[[str], None]] = None,
) -> Choice:
    """Settle ``auto`` by measurement: the one check that ``MixedPrecision("auto")`` users, the
    :class:`~ampkit.train.trainer.Trainer` and ``ampkit train --precision auto`` share.

    When ``amp`` was asked for ``"auto"`` on a CPU, the hardware rule picked a reduced precision,
    the run has not stepped yet and runs in one process, :func:`measured_choice` times that pick
    against fp32 on copies of ``model`` (with ``loss_fn`` on ``batches``, what the Trainer takes:
    ``batches(i)``, or an iterable's first batches, cycled, its random states untouched; cached) and, if fp32
    is faster, ``amp`` switches to fp32 in place (:meth:`MixedPrecision.switch`, its fallback chain
    rebuilt for fp32, as a new engine's would be). Either way the verdict is recorded as an
    ``auto_precision`` event with its reason. Callable before or after ``amp.setup``; a second
    call, or a call on a resumed run (its checkpoint's precision stands), changes nothing.
    ``announce(sentence)`` (e.g. ``console.print``) is told before a measurement that is not cached.

    Returns the :class:`Choice`; where nothing is measured, the current precision with the
    reason it holds (the recorded verdict, or the hardware rule's reason). Syncs (it trains).
    """
    done = auto_decision(amp)
    if done is not None:
        return Choice(
            str(done["precision"]),
            str(done["reason"]),
            dict(done.get("speedups", {})),
            bool(done.get("cached", False)),
            str(done.get("timed", "")),
        )
    current = Choice(amp.precision.name, amp.precision.reason, {}, False)
    if (
        amp.config.precision != "auto"
        or amp.device.type != "cpu"
        or amp.precision.name == REFERENCE
        or amp.optimizer_steps > 0
        or world_size() > 1
    ):  # several processes: the hardware rule, alike on all
        return current
    size = getattr(batches, "batch_size", None)
    batches = BatchSource(batches).as_function()  # a DataLoader, a list: its first batches, cycled
    if announce is not None and not (
        use_cache and _key(model_signature(model, batches(0)), amp.precision.name) in _read_cache()
    ):
        announce(
            f"auto: the hardware rule picks {amp.precision.name}; timing it against fp32 on this model ..."
        )
    choice = measured_choice(
        model,
        batches,
        amp.precision.name,
        amp.device,
        label=label,
        loss_fn=loss_fn,
        batch_size=size,
        use_cache=use_cache,
    )
    if choice.precision != amp.precision.name:
        amp.switch(choice.precision, reason=choice.reason)
        amp.set_fallback(
            amp.config.fallback
        )  # the chain from the new precision, as a new engine builds it
    amp.record_event(
        "auto_precision",
        precision=choice.precision,
        reason=choice.reason,
        speedups=dict(choice.speedups),
        cached=choice.cached,
        timed=choice.timed,
    )
    return choice
