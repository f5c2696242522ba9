"""The bit-level passes of bf16-pure's memory ladder (:mod:`.ladder`): the ``split`` and ``kahan``
compact forms to and from fp32, and stochastic rounding into bf16.

Each pass runs the native one-pass kernel (:mod:`ampkit.step.policies.native`) where it can, and
the eager torch passes of :mod:`.eager` -- the kernels' bitwise reference -- everywhere else, or
with ``native=False``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import native as _native_kernels
from . import eager
from .eager import BLOCK

__all__ = ["BLOCK", "join_split", "kahan_join", "kahan_split", "split_fp32", "stochastic_round"]


def split_fp32(x: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor, native: bool = True) -> None:
    """Write fp32 ``x`` as its bf16 round-to-nearest (ties away) into ``hi`` and the int16 remainder
    (:func:`.eager.split_fp32`). ``x`` is scratch (overwritten). ``native``: one pass in C where
    :mod:`ampkit.step.policies.native` can (bitwise the same; ``x`` then unchanged)."""
    if not (native and _native_kernels.split(x, hi, rem)):
        eager.split_fp32(x, hi, rem)


def join_split(
    hi: torch.Tensor,
    rem: torch.Tensor,
    out: torch.Tensor,
    tmp: Optional[torch.Tensor] = None,
    native: bool = True,
) -> torch.Tensor:
    """The exact fp32 value of a ``split`` pair into contiguous ``out`` (returned); ``tmp``: int32
    scratch of ``out``'s size (:func:`.eager.join_split`). ``native``: as above."""
    if native and _native_kernels.join(hi, rem, out):
        return out
    return eager.join_split(hi, rem, out, tmp)


def kahan_split(
    x: torch.Tensor, hi: torch.Tensor, comp: torch.Tensor, tmp: torch.Tensor, native: bool = True
) -> None:
    """fp32 ``x`` (scratch) into its bf16 rounding ``hi`` and the bf16 compensation ``comp``; ``tmp``:
    fp32 scratch of ``x``'s size (:func:`.eager.kahan_split`). ``native``: as above."""
    if not (native and _native_kernels.kahan_split(x, hi, comp)):
        eager.kahan_split(x, hi, comp, tmp)


def kahan_join(
    hi: torch.Tensor, comp: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor, native: bool = True
) -> torch.Tensor:
    """``hi + comp`` in fp32 into contiguous ``out`` (returned); ``tmp``: fp32 scratch of its size."""
    if native and _native_kernels.kahan_join(hi, comp, out):
        return out
    return eager.kahan_join(hi, comp, out, tmp)


def stochastic_round(x: torch.Tensor, out: torch.Tensor, gen: torch.Generator) -> None:
    """Round fp32 ``x`` stochastically into bf16 ``out`` (``x``'s storage is used as scratch)."""
    bits = x.view(torch.int32)
    bits.add_(torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=gen))
    bits.bitwise_and_(-0x10000)
    out.copy_(x.view(out.shape))  # exact: x is a bf16 value now
