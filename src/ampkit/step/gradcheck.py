"""Passes over gradients: the finite check (read-only where that is cheaper) and unscaling.

``found_inf`` is PyTorch's convention throughout: a 0-d fp32 tensor on the gradients' device,
1.0 when some gradient holds inf/NaN, else 0.0. Nothing here synchronizes with the host.

Which finite check (measured, docs/benchmarks.md "finite check"):

* **CUDA and other accelerators**: ``torch._amp_foreach_non_finite_check_and_unscale_`` with a
  unit scale -- one fused multi-tensor kernel, the exact check ``torch.amp.GradScaler`` makes.
* **CPU**: there is no fused multi-tensor kernel; ``_amp_foreach_non_finite_check_and_unscale_``
  loops over the tensors and *writes* every gradient (x 1.0). A plain ``sum`` per large tensor
  only reads and is ~2x faster (417 -> 187 us for 2.4M fp32 gradients on a 2-core EPYC); small
  tensors still go through the foreach call, which costs one dispatch for all of them. A sum is
  non-finite exactly when an element is (inf - inf is NaN, NaN propagates), except for finite
  gradients whose sum exceeds fp32's range (~3e38): half-precision sums are taken in fp32.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_and_unscale", "grads_of", "nonfinite_flag"]

# CPU tensors at least this large are checked with a read-only sum, one dispatch each.
_CPU_SUM_MIN_NUMEL = 1 << 15


def nonfinite_flag(grads: Sequence[torch.Tensor], found: torch.Tensor) -> torch.Tensor:
    """Set ``found`` (0-d fp32, on the gradients' device) to 1.0 if any of ``grads`` holds inf/NaN.

    Read-only on CPU; one fused kernel elsewhere (module doc). All ``grads`` share ``found``'s
    device. Returns ``found``. No sync.
    """
    if not grads:
        return found
    if found.device.type != "cpu":
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_dtype[g.dtype].append(g)
        one = torch.ones((), dtype=torch.float32, device=found.device)
        for same in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
        return found
    small: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    sums = []
    for g in grads:
        if g.numel() >= _CPU_SUM_MIN_NUMEL:
            sums.append(g.sum(dtype=torch.float32) if g.dtype == torch.float16 else g.sum())
        else:
            small[g.dtype].append(g)
    if small:
        one = torch.ones((), dtype=torch.float32)
        for same in small.values():
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
    if sums:
        total = torch.stack([s.float() for s in sums]).sum()
        found.logical_or_(~total.isfinite())  # stays 0.0/1.0 in fp32
    return found


def grads_of(optimizer: torch.optim.Optimizer, *, allow_fp16: bool) -> dict[torch.device, list[torch.Tensor]]:
    """The optimizer's gradients grouped by device (sparse ones by their values).

    ``allow_fp16=False`` refuses fp16 gradients, as ``torch.amp.GradScaler.unscale_`` does:
    unscaling them in place would lose precision (fp16 parameters need fp32 master weights).
    """
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if not allow_fp16 and g.dtype == torch.float16:
                raise ValueError("attempting to unscale fp16 gradients: fp16 parameters need fp32 "
                                 "master weights (use precision 'fp16-pure'), or keep parameters in fp32")
            if g.is_sparse:
                if g.dtype is torch.float16:
                    p.grad = g = g.coalesce()
                g = g._values()
            by_device[g.device].append(g)
    return by_device


def check_and_unscale(optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                      allow_fp16: bool, unit: bool) -> dict[torch.device, torch.Tensor]:
    """Per device, a fresh ``found_inf`` for ``optimizer``'s gradients; multiplies them by
    ``inv_scale`` in place unless ``unit`` (then the check is all that happens, read-only on CPU).
    """
    found: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for dev, grads in grads_of(optimizer, allow_fp16=allow_fp16).items():
            found[dev] = torch.zeros((), dtype=torch.float32, device=dev)
            if unit:
                nonfinite_flag(grads, found[dev])
                continue
            inv = inv_scale.to(dev, non_blocking=True)
            by_dtype: dict[torch.dtype, list[Any]] = defaultdict(list)
            for g in grads:
                by_dtype[g.dtype].append(g)
            for same in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(same, found[dev], inv)
    return found
