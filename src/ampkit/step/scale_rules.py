"""The DeepSpeed-style loss-scale update with hysteresis, on device tensors (no sync).

Semantics (``DynamicLossScaler`` in DeepSpeed's ``runtime/fp16/loss_scaler.py``): each overflow
spends one unit of a budget of ``hysteresis``; while more than one unit is left the overflow only
spends it, once the budget is down to its last unit every overflow backs the scale off. The
budget refills when the scale grows, or on every finite step with ``consecutive=True``. Every
overflow resets the growth counter; ``growth_interval`` consecutive finite steps multiply the
scale by ``growth_factor`` when the result is finite (as ``torch._amp_update_scale_``).

Both update rules can back the scale off below :data:`SCALE_FLOOR`; the caller
(:class:`ampkit.step.scaler.LossScaler`) clamps the result up to it.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

__all__ = ["SCALE_FLOOR", "hysteresis_update", "new_scale_problem", "scaling_problem"]

#: The smallest loss scale: the smallest normal fp32, 2**-126. Repeated backoff would otherwise
#: reach 0.0 (166 halvings from 65536; fp32 subnormals end at 2**-149), and a zero scale makes
#: the next finite step compute ``grad * (1 / 0)`` = NaN. Its reciprocal, 2**126, is still a
#: finite fp32, so unscaling at the floor stays exact.
SCALE_FLOOR: float = torch.finfo(torch.float32).tiny


def scaling_problem(
    init_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    min_scale: Optional[float],
    max_scale: Optional[float],
) -> Optional[tuple[str, Any, str]]:
    """The first invalid loss-scaling setting as ``(name, value, what it must be)``, or None.

    The one set of rules for these knobs: :class:`~ampkit.step.scaler.LossScaler` raises on it,
    and a config holding the same fields can too.
    """

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    checks: list[tuple[bool, str, Any, str]] = [
        (
            number(init_scale) and init_scale >= SCALE_FLOOR,
            "init_scale",
            init_scale,
            "a finite number > 0, at least 2**-126 (the loss scale's floor: the smallest normal fp32)",
        ),
        (
            number(growth_factor) and growth_factor > 1.0,
            "growth_factor",
            growth_factor,
            "a finite number > 1.0 (use dynamic_scaling=False for a constant scale)",
        ),
        (
            number(backoff_factor) and 0.0 < backoff_factor < 1.0,
            "backoff_factor",
            backoff_factor,
            "a number with 0 < backoff_factor < 1",
        ),
        (
            integer(growth_interval) and growth_interval >= 1,
            "growth_interval",
            growth_interval,
            "an integer >= 1",
        ),
        (
            integer(hysteresis) and hysteresis >= 1,
            "hysteresis",
            hysteresis,
            "an integer >= 1 (1 = back off on every overflow)",
        ),
        (
            min_scale is None or (number(min_scale) and min_scale > 0),
            "min_scale",
            min_scale,
            "None or a finite number > 0",
        ),
        (
            max_scale is None or (number(max_scale) and max_scale > 0),
            "max_scale",
            max_scale,
            "None or a finite number > 0",
        ),
    ]
    for ok, name, value, allowed in checks:
        if not ok:
            return name, value, allowed
    lo = min_scale if min_scale is not None else 0.0
    hi = max_scale if max_scale is not None else math.inf
    if not lo <= hi:
        return "max_scale", max_scale, f"None or >= min_scale ({min_scale})"
    if not lo <= init_scale <= hi:
        return (
            "init_scale",
            init_scale,
            f"a value within [min_scale, max_scale] = [{min_scale}, {max_scale}]",
        )
    return None


def hysteresis_update(
    scale: torch.Tensor,
    tracker: torch.Tensor,
    left: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    consecutive: bool,
) -> None:
    """Update ``scale`` (0-d fp32), ``tracker`` (finite steps since the last change, 0-d int32) and
    ``left`` (hysteresis budget, 0-d int32) in place from this iteration's ``found_inf``."""
    overflow = found_inf > 0
    backoff = overflow & (left <= 1)
    successful = tracker + 1
    grow = (~overflow) & (successful >= growth_interval)
    grown = scale * growth_factor
    new = torch.where(backoff, scale * backoff_factor, scale)
    new = torch.where(grow & torch.isfinite(grown), grown, new)
    refill = grow | (~overflow) if consecutive else grow
    new_left = torch.where(overflow & (left > 1), left - 1, left)
    new_left = torch.where(refill, torch.full_like(left, hysteresis), new_left)
    tracker.copy_(torch.where(overflow | grow, torch.zeros_like(tracker), successful))
    left.copy_(new_left)
    scale.copy_(new)


def new_scale_problem(new_scale: torch.Tensor) -> Optional[str]:
    """Why ``update(new_scale=...)`` refuses this tensor (GradScaler's rule), or None: it must hold
    one element and not require grad (else the scale, and every scaled loss, would join its
    autograd graph). Reads metadata only (no sync)."""
    if new_scale.numel() == 1 and not new_scale.requires_grad:
        return None
    return (
        f"invalid new_scale: a tensor of shape {tuple(new_scale.shape)} with "
        f"requires_grad={new_scale.requires_grad}; must be a float or a 1-element tensor "
        "that does not require grad"
    )
