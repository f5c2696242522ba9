"""Confirm ``auto``'s hardware pick by measuring it on the model about to train (CPU).

``auto`` is a hardware rule (bf16 where the CPU has AMX-BF16 or AVX512-BF16). On a CPU the rule
is not enough: for small models casts and element-wise work dominate and bf16 can be slower than
fp32 (0.69x-0.92x for the built-in tiny/small models on an AMX Xeon). So before a run whose
precision is ``auto``, :func:`measured_choice` times a few training steps of the real model in
fp32 and in the hardware pick, interleaved, keeps the faster, and caches the verdict per (CPU,
torch, threads, model, batch) in ``$AMPKIT_CACHE_DIR`` (default ``~/.cache/ampkit``), so later
runs start at once. GPUs keep the hardware rule: bf16/fp16 tensor cores pay off there.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

from ..step.engine import MixedPrecision
from ..step.hardware import cpu_features

__all__ = ["Choice", "cache_path", "measured_choice"]


@dataclass(frozen=True)
class Choice:
    """The precision to train in, and why (``reason`` is one sentence for the run header)."""

    precision: str
    reason: str
    speedups: dict[str, float]  # candidate -> speed relative to fp32 (> 1 is faster)
    cached: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cache_path() -> str:
    root = os.environ.get("AMPKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ampkit")
    return os.path.join(root, "auto-precision.json")


def _key(label: str, batch_size: Optional[int], candidate: str) -> str:
    cpu = cpu_features()
    text = json.dumps([cpu.model, sorted(cpu.flags), torch.__version__, torch.get_num_threads(), label, batch_size,
                       candidate])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _read_cache() -> dict[str, Any]:
    try:
        with open(cache_path(), encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # no cache or an unreadable one: measure again


def _write_cache(data: dict[str, Any]) -> None:
    path = cache_path()
    with contextlib.suppress(OSError):  # a cache that cannot be written only costs a re-measurement
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)


def _time_steps(model: torch.nn.Module, batches: Callable[[int], Any], precision: str, device: torch.device,
                steps: int, blocks: int) -> list[float]:
    """Per-block mean step time (s) of ``steps`` AdamW steps, after one warm-up step."""
    model = copy.deepcopy(model)
    amp = MixedPrecision(precision, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
    model, opt = amp.setup(model, opt)

    def step(i: int) -> None:
        batch = batches(i)
        with amp.autocast():
            loss = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
        amp.backward(loss)
        amp.step(opt)

    step(0)
    out = []
    for b in range(blocks):
        t0 = time.perf_counter()
        for i in range(steps):
            step(1 + b * steps + i)
        out.append((time.perf_counter() - t0) / steps)
    return out


def measured_choice(model: torch.nn.Module, batches: Callable[[int], Any], candidate: str, device: torch.device, *,
                    label: str, batch_size: Optional[int] = None, steps: int = 2, blocks: int = 3,
                    use_cache: bool = True) -> Choice:
    """Train ``candidate`` (the hardware pick) against fp32 on copies of ``model`` and choose.

    Interleaved blocks of ``steps`` steps each (``blocks`` per precision), median per precision;
    ``candidate`` wins only if it is faster than fp32. The verdict is cached (module doc); the
    model is not changed. Costs ~``2 * (blocks * steps + 1)`` training steps on a cache miss.
    """
    if candidate == "fp32":
        return Choice("fp32", "fp32 is the hardware rule's pick; nothing to measure", {"fp32": 1.0}, False)
    key = _key(label, batch_size, candidate)
    cache = _read_cache() if use_cache else {}
    hit = cache.get(key)
    if isinstance(hit, dict) and isinstance(hit.get("speedup"), (int, float)):
        speedup, cached = float(hit["speedup"]), True
    else:
        times: dict[str, list[float]] = {"fp32": [], candidate: []}
        for b in range(blocks):
            order = ("fp32", candidate) if b % 2 == 0 else (candidate, "fp32")
            for name in order:
                times[name] += _time_steps(model, batches, name, device, steps, 1)
        speedup = statistics.median(times["fp32"]) / statistics.median(times[candidate])
        cached = False
        if use_cache:
            cache[key] = {"speedup": speedup, "label": label, "batch_size": batch_size, "candidate": candidate,
                          "cpu": cpu_features().model, "torch": torch.__version__, "measured": time.time()}
            _write_cache(cache)
    how = "cached measurement" if cached else "measured just now"
    if speedup > 1.0:
        return Choice(candidate, f"{candidate} trains {label} {speedup:.2f}x as fast as fp32 here ({how})",
                      {"fp32": 1.0, candidate: speedup}, cached)
    return Choice("fp32", f"the hardware rule picks {candidate}, but {candidate} trains {label} at {speedup:.2f}x "
                          f"fp32's speed here ({how}), so fp32", {"fp32": 1.0, candidate: speedup}, cached)
