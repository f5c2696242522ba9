"""The fallback chain (fp16 -> bf16 -> fp32) and its triggers, checked without stalling the device.

Triggers, evaluated every ``check_every`` optimizer steps:

* ``consecutive_skips``: ``patience`` consecutive skipped (non-finite) steps;
* ``min_scale``: the loss scale has fallen to ``min_scale`` (when one is set);
* ``nonfinite_unscaled``: a non-finite loss/gradient in a precision without loss scaling
  (bf16, tf32, fp32), where backing off a scale cannot help.

Per step the policy does three tiny in-place ops on device counters (consecutive skips and their
maximum since the last check). At each check it copies those counters to the host without
blocking and decides at the *next* check, when the copy has long landed: on CUDA no check ever
waits for the device; a trigger is acted on at most ``2 * check_every`` steps after it happened
(the steps in between are skipped anyway, so nothing non-finite is trained on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .hardware import DeviceInfo
from .precision import PrecisionError, parse_precision, resolve_precision

__all__ = ["DEFAULT_CHAIN", "FallbackPolicy", "NumericsError", "Trigger", "resolve_chain"]

DEFAULT_CHAIN = ("fp16", "bf16", "fp32")
PURE_CHAIN = ("fp16-pure", "bf16-pure", "fp32")
_ENGINE = ("fp32", "tf32", "bf16", "fp16", "bf16-pure", "fp16-pure", "fp8")


class NumericsError(RuntimeError):
    """Training stays non-finite in the last precision of the fallback chain."""


@dataclass(frozen=True)
class Trigger:
    reason: str  # consecutive_skips | min_scale | nonfinite_unscaled
    detail: str
    consecutive_skips: int
    scale: Optional[float]


def resolve_chain(spec: Union[bool, str], start: str, info: DeviceInfo) -> tuple[str, ...]:
    """The precisions to try after ``start``. ``True``: the default chain, keeping only what the
    device runs. A string: validated now (unknown or unsupported names raise ``PrecisionError``)."""
    if spec is True:
        # Pure precisions fall back within the pure forms first (the masters carry over), then fp32.
        default = PURE_CHAIN if start.endswith("-pure") else DEFAULT_CHAIN
        names = [n for n in default if _runs(n, info)]
        if start == "fp8":  # fp8 -> bf16 (same autocast, plain Linears) -> fp32
            names = ["fp8"] + [n for n in names if n in ("bf16", "fp32")]
        elif start not in names:
            names = [start] + [n for n in names if n == "fp32"]
    else:
        names = [parse_precision(n) for n in str(spec).split(",") if n.strip()]
        for n in names:
            if n not in _ENGINE:
                raise PrecisionError(f"fallback chain entry {n!r} is not supported; use names from: {', '.join(_ENGINE)}")
            resolve_precision(n, info)  # raises PrecisionError naming the device and the reason
        if start not in names:
            raise PrecisionError(f"fallback chain {','.join(names)!r} does not contain the training precision "
                                 f"{start!r}; start the chain with it, e.g. '{start},fp32'")
    return tuple(names)


def _runs(name: str, info: DeviceInfo) -> bool:
    try:
        resolve_precision(name, info)
        return True
    except PrecisionError:
        return False


class FallbackPolicy:
    """Device-side counters plus the asynchronous check (see the module doc)."""

    def __init__(self, chain: tuple[str, ...], patience: int, check_every: int, min_scale: Optional[float]) -> None:
        self.chain, self.patience, self.check_every, self.min_scale = chain, patience, check_every, min_scale
        self._consec: Optional[torch.Tensor] = None
        self._max: Optional[torch.Tensor] = None
        self._inflight: Optional[tuple[torch.Tensor, Any]] = None

    def next_precision(self, current: str) -> Optional[str]:
        if current in self.chain:
            i = self.chain.index(current)
            return self.chain[i + 1] if i + 1 < len(self.chain) else None
        return self.chain[-1] if self.chain and self.chain[-1] != current else None

    def reset(self) -> None:
        if self._consec is not None:
            self._consec.zero_()
            self._max.zero_()  # type: ignore[union-attr]
        self._inflight = None

    def observe(self, found_inf: Optional[torch.Tensor]) -> None:
        """Per optimizer step: update the device counters (three in-place ops, no sync)."""
        if found_inf is None:
            return
        if self._consec is None:
            self._consec = torch.zeros((), dtype=torch.float32, device=found_inf.device)
            self._max = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        # consecutive = (consecutive + 1) if found else 0, with found in {0., 1.}
        self._consec.add_(1.0).mul_(found_inf)
        torch.maximum(self._max, self._consec, out=self._max)  # type: ignore[arg-type]

    def check(self, scale: Optional[torch.Tensor], scaled: bool) -> Optional[Trigger]:
        """Every ``check_every`` steps: decide on the previous interval's counters, launch this one's copy."""
        if self._consec is None:
            return None
        trigger = self._decide(scaled) if self._inflight is not None else None
        vals = torch.stack([self._max, self._consec, scale if scale is not None else torch.zeros_like(self._max)])  # type: ignore[list-item]
        done = None
        if vals.device.type == "cuda":
            vals = vals.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self._max.copy_(self._consec)  # type: ignore[union-attr]  # the next window starts from the current run
        self._inflight = (vals, done)
        return trigger

    def _decide(self, scaled: bool) -> Optional[Trigger]:
        assert self._inflight is not None
        vals, done = self._inflight
        if done is not None and not done.query():
            done.synchronize()
        max_consec, _, scale = vals.tolist()
        run = int(max_consec)
        if scaled and run >= self.patience:
            return Trigger("consecutive_skips", f"{run} consecutive skipped steps (patience {self.patience})", run, scale)
        if scaled and self.min_scale is not None and scale <= self.min_scale:
            return Trigger("min_scale", f"the loss scale reached min_scale={self.min_scale:g}", run, scale)
        if not scaled and run >= 1:
            return Trigger("nonfinite_unscaled", f"{run} step(s) with non-finite loss/gradients in a precision "
                           "without loss scaling", run, None)
        return None
