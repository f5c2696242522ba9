"""The eager torch passes of bf16-pure's memory ladder: the ``split`` and ``kahan`` compact forms
to and from fp32. They are the bitwise reference of the native one-pass kernels
(:mod:`ampkit.step.policies.native`, which checks itself against them) and the fallback the
dispatching passes of :mod:`.rounding` take everywhere the kernels cannot run (no C compiler,
another device, fake tensors of ``ampkit plan``, ``AMPKIT_NO_NATIVE=1``).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["BLOCK", "join_split", "kahan_join", "kahan_split", "split_fp32"]

#: elements per block of the bit-level passes on CPU (a block's passes stay in the L2 cache)
BLOCK = 1 << 17


# Same-dtype, contiguous passes only: on CPU a mixed-dtype binary op (int32 += int16, fp32 += bf16)
# takes a slow promotion path (~8x a conversion copy), a strided int16 pass ~4x, and an in-place
# shift is an out-of-place shift plus a copy. A bf16 -> fp32 conversion is exactly ``bits << 16``,
# and fp32 -> bf16 is exact on values whose low 16 bits are zero: conversions do the shifts.
def _blocks(x: torch.Tensor) -> range:
    """Block starts over flat ``x``: on CPU the passes over one block of :data:`BLOCK` elements stay
    in cache (one trip to memory per tensor instead of one per pass); elsewhere -- and for fake
    tensors (``ampkit plan``: the passes are in place, so a block changes no byte, only the count
    of dispatched operations) -- one block."""
    n = x.numel()
    return range(0, n, BLOCK if x.device.type == "cpu" and type(x) is torch.Tensor else max(n, 1))


def split_fp32(x: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor) -> None:
    """Write fp32 ``x`` as its bf16 round-to-nearest (ties away) into ``hi`` and the int16 remainder.

    ``x`` is scratch (overwritten). The remainder is the low 16 bits read as a signed int16; the
    weight is the high 16 bits plus one where the low bits are >= 0x8000.
    """
    xf, hf, rf = x.view(-1), hi.view(-1), rem.view(-1)
    for o in _blocks(xf):
        xb = xf[o : o + BLOCK]
        bits = xb.view(torch.int32)
        rf[o : o + BLOCK].copy_(bits)  # int32 -> int16 keeps the low 16 bits (two's complement)
        bits.add_(0x8000).bitwise_and_(
            -0x10000
        )  # the high 16 bits of the rounded value, low bits zero
        hf[o : o + BLOCK].copy_(xb)  # exact: a bf16 value now


def join_split(
    hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor, tmp: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The exact fp32 value of a ``split`` pair, into contiguous ``out`` (returned): ``(hi << 16) + rem``
    in int32 with the remainder sign-extended. ``tmp``: int32 scratch of ``out``'s size."""
    of, hf, rf = out.view(-1), hi.view(-1), rem.view(-1)
    tf = (
        torch.empty(of.numel(), dtype=torch.int32, device=out.device)
        if tmp is None
        else tmp.view(-1)
    )
    for o in _blocks(of):
        ob = of[o : o + BLOCK]
        ob.copy_(hf[o : o + BLOCK])  # = hi's bits << 16
        ob.view(torch.int32).add_(tf[o : o + BLOCK].copy_(rf[o : o + BLOCK]))
    return out


def kahan_split(x: torch.Tensor, hi: torch.Tensor, comp: torch.Tensor, tmp: torch.Tensor) -> None:
    """fp32 ``x`` (scratch) into its bf16 rounding ``hi`` and the bf16 of the rounding error ``comp``
    (the error is exact in fp32); ``tmp``: fp32 scratch of ``x``'s size. Blocked like the split."""
    xf, hf, cf, tf = x.view(-1), hi.view(-1), comp.view(-1), tmp.view(-1)
    for o in _blocks(xf):
        xb, hb = xf[o : o + BLOCK], hf[o : o + BLOCK]
        hb.copy_(xb)
        cf[o : o + BLOCK].copy_(xb.sub_(tf[o : o + BLOCK].copy_(hb)))  # bf16 -> fp32 is exact


def kahan_join(
    hi: torch.Tensor, comp: torch.Tensor, out: torch.Tensor, tmp: torch.Tensor
) -> torch.Tensor:
    """``hi + comp`` in fp32 into contiguous ``out`` (returned); ``tmp``: fp32 scratch of its size."""
    of, hf, cf, tf = out.view(-1), hi.view(-1), comp.view(-1), tmp.view(-1)
    for o in _blocks(of):
        of[o : o + BLOCK].copy_(hf[o : o + BLOCK]).add_(tf[o : o + BLOCK].copy_(cf[o : o + BLOCK]))
    return out
