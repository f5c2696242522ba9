"""Passes over gradients: the finite check and unscaling, grouped the way torch's kernels need.

``found_inf`` is PyTorch's convention throughout: a 0-d fp32 tensor on the gradients' device,
1.0 when some gradient holds inf/NaN, else 0.0. Nothing here synchronizes with a device (the CPU
check reads its sums on the host, where that is free).

The finite check is ``torch._amp_foreach_non_finite_check_and_unscale_`` with a unit scale:
one fused multi-tensor kernel per (device, dtype) on CUDA -- the check ``torch.amp.GradScaler``
makes. It multiplies by 1.0, so it writes as well as reads. On the CPU, where reading a value
costs no sync, a unit-scale check is instead decided on the host, the large gradients by
read-only sums (:func:`cpu_all_finite`), and the optimizer is then called exactly as a plain loop calls it (no
``found_inf`` handed to a fused optimizer, no step-count correction after it): ampkit/raw in the
default mode went from 1.035-1.043 to 1.008-1.009 (fp32 MLP small, fused AdamW, 1 thread, EPYC;
docs/benchmarks.md section 18). (An earlier in-step measurement under load had found sums
dearer than the fused call while the result still went to the optimizer as a device tensor.)
Where a pass over the gradients already happens (clipping) the check rides on it instead
(:mod:`ampkit.step.boundary`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch

from .policies import native

__all__ = [
    "SUM_FROM",
    "check_and_unscale",
    "cpu_all_finite",
    "cpu_norm_finite",
    "first_grad_device",
    "foreach_check_and_unscale",
    "grads_of",
]


def _by_dtype(grads: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    first = grads[0].dtype
    for g in grads:  # (a loop, not all(<genexpr>): this runs every step)
        if g.dtype != first:
            break
    else:
        return [list(grads)]
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(g.dtype, []).append(g)
    return list(groups.values())


def grads_of(
    optimizer: torch.optim.Optimizer, *, allow_fp16: bool
) -> dict[torch.device, list[torch.Tensor]]:
    """The optimizer's gradients grouped by device (sparse ones by their values).

    ``allow_fp16=False`` refuses fp16 gradients, as ``torch.amp.GradScaler.unscale_`` does:
    unscaling them in place would lose precision (fp16 parameters need fp32 master weights).
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if not allow_fp16 and g.dtype == torch.float16:
                raise ValueError(
                    "attempting to unscale fp16 gradients: fp16 parameters need fp32 "
                    "master weights (use precision 'fp16-pure'), or keep parameters in fp32"
                )
            if g.is_sparse:
                if g.dtype is torch.float16:
                    p.grad = g = g.coalesce()
                g = g._values()
            by_device.setdefault(g.device, []).append(g)
    return by_device


def check_and_unscale(
    optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, allow_fp16: bool
) -> dict[torch.device, torch.Tensor]:
    """Per device, a fresh ``found_inf`` for ``optimizer``'s gradients, which are multiplied by
    ``inv_scale`` in place (a scale of exactly 1.0 only checks them)."""
    found: dict[torch.device, torch.Tensor] = {}
    # No torch.no_grad() needed: .grad tensors do not require grad (that context costs ~3 us).
    for dev, grads in grads_of(optimizer, allow_fp16=allow_fp16).items():
        f = found[dev] = torch.zeros((), dtype=torch.float32, device=dev)
        # For a check only, inv_scale is the scaler's own cached 1.0 (no module-level tensor
        # cache: it would leak across devices and fake-tensor modes).
        inv = inv_scale if inv_scale.device == dev else inv_scale.to(dev, non_blocking=True)
        for same in _by_dtype(grads):
            if same[0].dtype == torch.bfloat16 and dev.type != "cpu":
                foreach_check_and_unscale(same, f, inv)  # torch's CUDA kernel has no bf16 variant
            else:
                torch._amp_foreach_non_finite_check_and_unscale_(same, f, inv)
    return found


def foreach_check_and_unscale(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``torch._amp_foreach_non_finite_check_and_unscale_`` from foreach operations, for the dtypes its
    kernel lacks (bf16 on CUDA: "not implemented for 'BFloat16'", seen on an H200 with masters='none'
    or a user's bf16 parameters): ``found_inf`` becomes 1.0 where any value is NaN or infinite (each
    tensor's largest magnitude, which a NaN or an infinity makes non-finite), and every gradient is
    multiplied by ``inv_scale`` in its own dtype, as the kernel does (the product in fp32, rounded
    once). No host sync."""
    peaks = torch.stack(torch._foreach_norm(grads, float("inf"))).float()
    bad = torch.logical_not(torch.isfinite(peaks)).any().to(found_inf.dtype)
    torch.maximum(found_inf, bad, out=found_inf)
    torch._foreach_mul_(grads, inv_scale)


#: gradients at least this large are checked by a read-only sum; smaller ones by one fused call
SUM_FROM = 1 << 15


def _has_fp16(grads: list[torch.Tensor]) -> bool:
    return any(g.dtype == torch.float16 for g in grads)


def cpu_all_finite(optimizer: torch.optim.Optimizer, *, allow_fp16: bool) -> Optional[bool]:
    """Whether every gradient of ``optimizer`` is finite, decided on the host, for gradients that
    all live on the CPU as plain tensors; None where that does not hold (the caller then uses
    :func:`check_and_unscale`).

    On the CPU reading a value is free (no device to wait for), so the large gradients are checked
    read-only: one ``sum`` each, exact because a sum is finite whenever its terms are all finite
    *unless* it overflows, and that rare case is settled by the fused check. Small gradients (below
    :data:`SUM_FROM` elements) go through one fused check instead, where a ``sum`` per tensor would
    cost more in dispatch than it saves. Measured (2-core EPYC, 1 thread, per check): MLP small (8
    tensors, 2.37M elements) 1021 us fused-only -> 202 us; GPT small (53 tensors, 0.88M) 199 -> 153;
    GPT tiny (29 tensors) 79 -> 77. The caller then calls a fused optimizer exactly as a plain loop
    does, without a ``found_inf`` to correct afterwards.

    Where the native kernels are in use (:func:`ampkit.step.policies.native.any_nonfinite`), every
    gradient is instead read once by one C call that tests the exponent bits (exact: no overflow
    case; on the calling thread: split over two threads it measured no faster) and no host read:
    whole step 1.107 -> 1.066 of the raw loop (w512 MLP, 1 thread;
    docs/benchmarks.md section 24, "The CPU finite check").
    """
    grads = []
    for group in optimizer.param_groups:  # (loops, not comprehensions: this runs every step)
        for p in group["params"]:
            g = p.grad
            if g is not None:
                grads.append(g)
    if not grads:
        return True
    if allow_fp16 or not _has_fp16(grads):
        # Plain strided CPU gradients: one C call, nothing else (None: not all qualify).
        bad = native.any_nonfinite(grads)
        if bad is not None:
            return not bad
    by_device = grads_of(optimizer, allow_fp16=allow_fp16)
    if len(by_device) != 1:
        return None
    ((dev, grads),) = by_device.items()
    if dev.type != "cpu":
        return None
    if any(
        type(g) is not torch.Tensor for g in grads
    ):  # a DTensor shard or another subclass: not a local read
        return None
    bad = native.any_nonfinite(grads)  # (sparse gradients: their values, in one C call)
    if bad is not None:
        return not bad
    small, large = [], []
    for g in grads:
        (large if g.numel() >= SUM_FROM else small).append(g)
    if small:
        found = torch.zeros((), dtype=torch.float32)
        one = torch.ones((), dtype=torch.float32)
        for same in _by_dtype(small):
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
        if found.item():
            return False
    for g in large:
        # (fp32 accumulation for half gradients: their own sum would overflow at 65504 / lose range)
        s = g.sum() if g.dtype == torch.float32 else g.sum(dtype=torch.float32)
        if not math.isfinite(s.item()):
            found = torch.zeros((), dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [g], found, torch.ones((), dtype=torch.float32)
            )
            if found.item():
                return False
    return True


def cpu_norm_finite(norm: torch.Tensor) -> Optional[bool]:
    """Whether a clipped total norm is finite, read on the host where that is free (a plain CPU
    tensor); None elsewhere (the caller keeps the check on the device). The norm is non-finite
    whenever a gradient is, so with clipping this is the whole check: the step's one extra cost over
    a plain clipping loop is this read (docs/benchmarks.md, "Step overhead (issue 34 section 6),
    follow-up")."""
    if type(norm) is not torch.Tensor or not norm.is_cpu:
        return None
    return math.isfinite(norm.item())


def first_grad_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """The device of the optimizer's first gradient (else of its first parameter, else the CPU)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return p.grad.device
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")
