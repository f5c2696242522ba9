"""The bit-level passes of bf16-pure's memory ladder (:mod:`.ladder`): the ``split`` and ``kahan``
compact forms to and from fp32, and stochastic rounding into bf16.

Each pass runs the native one-pass kernel (:mod:`ampkit.step.policies.native`) where it can, and
the eager torch passes of :mod:`.eager` -- the kernels' bitwise reference -- everywhere else, or
with ``native=False``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from ...logs import logger
from .. import native as _native_kernels
from . import eager
from .eager import BLOCK

__all__ = [
    "BLOCK",
    "STREAM",
    "compiled",
    "draw_key",
    "join_split",
    "kahan_join",
    "kahan_split",
    "split_fp32",
    "stochastic_many",
    "stochastic_round",
    "warn_other_calls",
    "shared_seed",
    "warn_other_stream",
]

#: stochastic rounding's random stream, recorded in checkpoints: splitmix64 of each element's
#: position, keyed per call from the checkpointed generator (:func:`draw_key`)
STREAM = "splitmix64-v1"


def shared_seed(model: Any, spans_ranks: bool = False) -> int:
    """The rounding generator's seed: ``torch.initial_seed()``, and rank 0's wherever the model spans
    processes (DDP, FSDP2, or ``spans_ranks``). Ranks are often seeded differently (a seed plus the
    rank, for their data); drawn from their own seeds, DDP's replicas would round the same update
    differently and drift apart, and under FSDP2 the one generator a checkpoint keeps would not be
    the other ranks' on resume. One collective, at set-up only."""
    seed = torch.initial_seed()
    d = torch.distributed
    if not (d.is_available() and d.is_initialized() and d.get_world_size() > 1):
        return seed
    if (
        spans_ranks
        or isinstance(model, torch.nn.parallel.DistributedDataParallel)
        or any(type(m).__name__.startswith("FSDP") for m in (model, *model.modules()))
    ):
        box = [seed]
        d.broadcast_object_list(box, src=0)
        seed = int(box[0])
    return seed


def warn_other_stream(found: Optional[str]) -> None:
    """A resumed checkpoint's rounding drew from another stream: say so (same distribution, other
    bits), so that a resume across versions is never silently a different run."""
    warnings.warn(
        f"this checkpoint's stochastic rounding drew from another random stream ("
        f"{found or 'torch.randint, before splitmix64-v1'}; now {STREAM}): the resumed run rounds "
        "with the same distribution, not the bits the writing version would have drawn",
        UserWarning,
        stacklevel=3,
    )


def warn_other_calls(found: int, now: int) -> None:
    """A resumed checkpoint's ladder stepped ``found`` elements per call, this one ``now`` (another
    ``ladder_scratch_mib``): its rounding keys (one per call) fall elsewhere, so say so."""
    warnings.warn(
        f"this checkpoint's ladder stepped up to {found} elements per optimizer call, this run "
        f"{now} (another ladder_scratch_mib): its stochastic rounding draws one key per call, so "
        "the resumed run rounds with the same distribution, not the bits the writing run would "
        "have drawn; resume with the same ladder_scratch_mib for a bitwise resume",
        UserWarning,
        stacklevel=3,
    )


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


_compiled: dict[str, Any] = {}


def _round_into(x: torch.Tensor, out: torch.Tensor, key: torch.Tensor, start: int) -> None:
    out.copy_(eager.stochastic_values(x, key, start))


def compiled() -> Optional[Callable[..., None]]:
    """The stochastic rounding of :func:`.eager.stochastic_values` into ``out`` compiled by
    ``torch.compile`` (one fused kernel: on CUDA the eager passes are ~20 launches a tensor), used
    on CUDA tensors; None with ``AMPKIT_NO_COMPILE=1`` or where ``torch.compile`` is unavailable.
    Compiled lazily, once per process (dynamic shapes); a failure to compile falls back to the
    eager passes for the rest of the process (one ``DEBUG`` line)."""
    if os.environ.get("AMPKIT_NO_COMPILE", "") not in ("", "0"):
        return None
    if "fn" not in _compiled:
        try:
            fn = torch.compile(_round_into, dynamic=True, fullgraph=True)
        except Exception as e:  # pragma: no cover - no inductor in this build
            logger.debug("ampkit: no compiled stochastic rounding (%s); eager passes", e)
            fn = None
        _compiled["fn"] = None if fn is None else _guarded(fn)
    return _compiled["fn"]


def _guarded(fn: Callable[..., None]) -> Callable[..., None]:
    def call(x: torch.Tensor, out: torch.Tensor, key: torch.Tensor, start: int) -> None:
        try:
            fn(x, out, key, start)
        except Exception as e:  # a backend that cannot compile here: eager from now on
            logger.debug("ampkit: compiled stochastic rounding failed (%s); eager passes", e)
            _compiled["fn"] = None
            eager.stochastic_round(x, out, key, start)

    return call


def draw_key(gen: torch.Generator) -> torch.Tensor:
    """A stochastic rounding call's key: 63 random bits from ``gen`` (a 0-d int64 tensor on its
    device -- no host sync on an accelerator). The call's random bits are a function of the key
    alone (:func:`.eager.random16`), so a checkpointed generator state replays them bitwise."""
    return torch.empty((), dtype=torch.int64, device=gen.device).random_(generator=gen)


def stochastic_many(
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    gen: torch.Generator,
    native: bool = True,
    salt: int = 0,
) -> None:
    """Round each fp32 tensor of ``xs`` (scratch: may be overwritten) stochastically into the bf16
    tensor of ``outs`` of its size (any layout: strided ones go through contiguous copies), with one
    key drawn from ``gen`` and the element counter running across the tensors in their flat order
    (row-major): one native call where it can (:func:`ampkit.step.policies.native.stochastic`),
    else :func:`.eager.stochastic_round` per tensor -- bitwise the same. ``salt`` (in [0, 2**62)) is
    XORed into the key: processes that share ``gen``'s state (FSDP2's ranks, :mod:`.sharded`) draw
    the same key and round their own shards with other bits."""
    if len(xs) != len(outs) or any(x.numel() != o.numel() for x, o in zip(xs, outs)):
        raise ValueError(
            f"stochastic rounding needs one bf16 output per fp32 input of its size; got sizes "
            f"{[x.numel() for x in xs]} into {[o.numel() for o in outs]}"
        )
    if not xs:
        return
    flat = [x.reshape(-1) for x in xs]  # contiguous (a copy of a strided one)
    into = [
        o.view(-1) if o.is_contiguous() else torch.empty(o.numel(), dtype=o.dtype, device=o.device)
        for o in outs
    ]
    key = draw_key(gen)  # (a fake tensor under ``ampkit plan``'s fake mode: the eager passes)
    if salt:
        key = key.bitwise_xor(salt)  # (a tensor op: no host sync)
    plain = type(key) is torch.Tensor and key.device.type == "cpu"
    if not (native and plain and _native_kernels.stochastic(flat, into, int(key))):
        real_cuda = type(flat[0]) is torch.Tensor and flat[0].is_cuda  # (not ``plan``'s fakes)
        fused = compiled() if native and real_cuda else None
        start = 0
        for x, out in zip(flat, into):
            if fused is not None:
                fused(x, out, key, start)
            else:
                eager.stochastic_round(x, out, key, start)
            start += x.numel()
    for o, t in zip(outs, into):
        if not o.is_contiguous():
            o.copy_(t.view(o.shape))


def stochastic_round(
    x: torch.Tensor, out: torch.Tensor, gen: torch.Generator, native: bool = True
) -> None:
    """Round fp32 ``x`` stochastically into bf16 ``out`` (``x``'s storage may be used as scratch):
    :func:`stochastic_many` of one tensor (unbiased: rounds up with probability equal to the
    dropped fraction; a NaN stays NaN)."""
    stochastic_many([x], [out], gen, native)
