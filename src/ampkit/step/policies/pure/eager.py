"""The eager torch passes of bf16-pure's memory ladder: the ``split`` and ``kahan`` compact forms
to and from fp32, and stochastic rounding into bf16 with its counter-based random bits. They are
the bitwise reference of the native one-pass kernels (:mod:`ampkit.step.policies.native`, which
checks itself against them) and the fallback the dispatching passes of :mod:`.rounding` take
everywhere the kernels cannot run (no C compiler, another device, fake tensors of ``ampkit plan``,
``AMPKIT_NO_NATIVE=1``).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "BLOCK",
    "join_split",
    "kahan_join",
    "kahan_split",
    "random16",
    "split_fp32",
    "stochastic_round",
]

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


# splitmix64's constants as signed int64 (torch's int64 multiplication wraps like uint64's)
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """``z >> s`` as uint64 (torch's int64 shift is arithmetic: the sign bits masked off)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def random16(key: torch.Tensor | int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """The 16 random bits (int64 in [0, 65536)) of elements ``start .. start + n - 1`` of a stochastic
    rounding call keyed by ``key`` (a 0-d int64 tensor on ``device``, or an int in [0, 2**63)):
    element g takes 16-bit part ``g % 4`` (the lowest first) of splitmix64 of counter ``g // 4``,
    i.e. of ``mix(key + (g // 4 + 1) * GAMMA)`` -- the stream the native kernel draws (``_bits.c``).
    Element-wise (each element hashes its own word), so ``torch.compile`` fuses it into one kernel."""
    return _random16(torch.arange(start, start + n, dtype=torch.int64, device=device), key)


def _random16(g: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
    z = ((g >> 2) + 1) * _GAMMA + key
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (z >> ((g & 3) * 16)) & 0xFFFF  # (the sign bits an arithmetic shift brings: masked off)


def stochastic_values(x: torch.Tensor, key: torch.Tensor | int, start: int = 0) -> torch.Tensor:
    """Flat fp32 ``x`` rounded stochastically to bf16, a new tensor: :func:`random16` (from element
    ``start`` of the call) added to the fp32 bits, the top 16 kept -- up with probability equal to
    the dropped fraction; a NaN stays NaN (torch's bf16 NaN). Pure and element-wise: the function
    the CUDA path compiles (:mod:`.rounding`)."""
    g = torch.arange(x.numel(), dtype=torch.int64, device=x.device) + start
    bits = (x.view(torch.int32) + _random16(g, key).to(torch.int32)) & -0x10000
    return torch.where(torch.isnan(x), x, bits.view(torch.float32)).to(torch.bfloat16)


def _words16(key: torch.Tensor | int, start: int, n: int, device: torch.device) -> torch.Tensor:
    """:func:`random16` as int16 bit patterns, one hash per 4 elements (the eager path: a quarter
    of the int64 work): the words' int16 parts are the elements' bits, little-endian."""
    w0 = start >> 2
    z = torch.arange(w0 + 1, ((start + n + 3) >> 2) + 1, dtype=torch.int64, device=device)
    z.mul_(_GAMMA).add_(key)
    z.bitwise_xor_(_shr(z, 30)).mul_(_MIX1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MIX2)
    z.bitwise_xor_(_shr(z, 31))
    a = start - 4 * w0
    return z.view(torch.int16)[a : a + n]


def stochastic_round(
    x: torch.Tensor, out: torch.Tensor, key: torch.Tensor | int, start: int = 0
) -> None:
    """:func:`stochastic_values` of fp32 ``x`` into bf16 ``out`` (same numel, contiguous; ``x`` is
    scratch, overwritten), in blocks on the CPU, with in-place passes and one hash per 4 elements
    (bitwise the same)."""
    xf, of = x.view(-1), out.view(-1)
    for o in _blocks(xf):
        xb = xf[o : o + BLOCK]
        nan = torch.isnan(xb)
        bits = xb.view(torch.int32)
        r = _words16(key, start + o, xb.numel(), x.device).to(torch.int32).bitwise_and_(0xFFFF)
        bits.add_(r).bitwise_and_(-0x10000)
        of[o : o + BLOCK].copy_(xb.masked_fill_(nan, float("nan")))  # exact: bf16 values, NaNs
