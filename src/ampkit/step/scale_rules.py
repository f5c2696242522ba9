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

import torch

__all__ = ["SCALE_FLOOR", "hysteresis_update"]

#: The smallest loss scale: the smallest normal fp32, 2**-126. Repeated backoff would otherwise
#: reach 0.0 (166 halvings from 65536; fp32 subnormals end at 2**-149), and a zero scale makes
#: the next finite step compute ``grad * (1 / 0)`` = NaN. Its reciprocal, 2**126, is still a
#: finite fp32, so unscaling at the floor stays exact.
SCALE_FLOOR: float = torch.finfo(torch.float32).tiny


def hysteresis_update(scale: torch.Tensor, tracker: torch.Tensor, left: torch.Tensor, found_inf: torch.Tensor, *,
                      growth_factor: float, backoff_factor: float, growth_interval: int, hysteresis: int,
                      consecutive: bool) -> None:
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
