"""The check the native kernels (:mod:`.native`) pass when their library loads: every kernel bitwise
the eager function of :mod:`.pure.eager` on edge cases (NaNs, infinities, ties, subnormals) and
random bits, several tensors a call, on one and two threads; the finite check against
``torch.isfinite``. A library that fails is not used (the eager passes run instead). ``kernels``:
the :mod:`.native` module itself (passed in, not imported: no import circle)."""

from __future__ import annotations

import ctypes
from types import ModuleType

import torch

from .pure import eager

__all__ = ["probe", "probe_nonfinite"]


def probe(lib: ctypes.CDLL, nan: int, kernels: ModuleType) -> None:
    """Raise unless every kernel is bitwise the eager function on edge cases and random bits."""

    g = torch.Generator().manual_seed(0)
    special = torch.tensor(
        [
            0,
            -0x80000000,
            1,
            -0x7FFFFFFF,
            0x7F800000,
            -0x800000,
            0x7FC00000,
            -0x400000,
            0x7F800001,
            0x7F808000,
            0x7FFF8000,
            0x7FFFFFFF,
            -0x7F8000,
            -1,
            0x7F7F8000,
            0x7F7F7FFF,
            0x3F808000,
            -0x407F8000,
            0x3F818000,
            0x00008000,
            0x0000FFFF,
        ],
        dtype=torch.int32,
    )
    bits = torch.cat(
        [
            special,
            torch.randint(-(2**31), 2**31, (2 * 65536 + 4133,), generator=g, dtype=torch.int32),
        ]
    )
    x = bits.view(torch.float32)
    n = x.numel()
    halves = torch.randint(
        -(2**15), 2**15, (2, n), generator=g, dtype=torch.int16
    )  # (weight, remainder) bits
    halves[:, : special.numel()] = (
        special.view(torch.int16).view(-1, 2).t().flip(0)
    )  # the specials' halves
    scratch = {
        torch.int16: torch.empty(n, dtype=torch.int32),
        torch.bfloat16: torch.empty(n, dtype=torch.float32),
    }
    sizes = [0, 1, 17, 1000, 65539]
    sizes.append(n - sum(sizes))  # several tensors in one call, one of them cut between two threads
    for rung, eager_split, eager_join in (
        ("split", eager.split_fp32, eager.join_split),
        ("kahan", eager.kahan_split, eager.kahan_join),
    ):
        dt = kernels.EXTRA[rung]
        want = [torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=dt)]
        eager_split(
            x.clone(), *want, *([scratch[dt].view(torch.float32)] if rung == "kahan" else [])
        )
        hi, extra = halves[0].view(torch.bfloat16), halves[1].view(dt)
        joined = torch.empty(n, dtype=torch.float32)
        eager_join(hi, extra, joined, scratch[dt])
        for nt in (1, 2):
            got = [
                [torch.empty(k, dtype=torch.bfloat16) for k in sizes],
                [torch.empty(k, dtype=dt) for k in sizes],
            ]
            ok = kernels.compact(rung, x.clone(), *got, lib=lib, threads=nt)
            if not ok or any(
                not torch.equal(torch.cat(u).view(torch.int16), v.view(torch.int16))
                for u, v in zip(got, want)
            ):
                raise RuntimeError(
                    f"probe: the native {rung} compaction differs from the eager passes"
                )
            out = torch.empty(n, dtype=torch.float32)
            ok = kernels.expand(
                rung, list(hi.split(sizes)), list(extra.split(sizes)), out, lib=lib, threads=nt
            )
            if not ok or not torch.equal(out.view(torch.int32), joined.view(torch.int32)):
                raise RuntimeError(
                    f"probe: the native {rung} expansion differs from the eager passes"
                )
    for key in (0, 0x7FFFFFFFFFFFFFFF, 0x0123456789ABCDEF):
        want = torch.empty(n, dtype=torch.bfloat16)
        eager.stochastic_round(x.clone(), want, key)
        for nt in (1, 2):
            got = [torch.empty(k, dtype=torch.bfloat16) for k in sizes]
            ok = kernels.stochastic(list(x.clone().split(sizes)), got, key, lib=lib, threads=nt)
            if not ok or not torch.equal(torch.cat(got).view(torch.int16), want.view(torch.int16)):
                raise RuntimeError(
                    "probe: the native stochastic rounding differs from the eager one"
                )
    probe_nonfinite(lib, g, kernels)


def probe_nonfinite(lib: ctypes.CDLL, g: torch.Generator, kernels: ModuleType) -> None:
    """Raise unless the finite check agrees with ``torch.isfinite`` on every dtype's edge values (the
    largest finite, infinities, NaNs, subnormals) at the start, middle and tail of several sizes."""
    for dtype in kernels.WIDTH:
        info = torch.finfo(dtype)
        edges = [info.max, -info.max, info.tiny / 4, float("inf"), float("-inf"), float("nan")]
        for size in (1, 511, 512, 1537, 5000, 70_001):  # the last one cut between two threads
            base = torch.randn(size, generator=g).to(dtype)
            cases = [base]
            for v in edges:
                for at in {0, size // 2, size - 1}:
                    t = base.clone()
                    t[at] = v
                    cases.append(t)
            for t in cases:
                want = not bool(torch.isfinite(t).all())
                for nt in (1, 2) if size > 65536 else (1,):
                    if (
                        kernels.any_nonfinite([torch.ones(3, dtype=dtype), t], lib=lib, threads=nt)
                        != want
                    ):
                        raise RuntimeError(
                            f"probe: the native finite check is wrong for {dtype} on {nt} thread(s)"
                        )
