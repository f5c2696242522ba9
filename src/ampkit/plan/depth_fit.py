"""The depth model of a stack's memory: each phase's peak affine in the depth and in the batch,
fitted from shallow copies' measures (:func:`ampkit.plan.depth.measure_depths`, which builds and
measures them) and checked against them. The measurement is :mod:`ampkit.plan.depth`; the fit is
here; their use for a plan is :mod:`ampkit.plan.depth_plan`.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence
from typing import Callable

from .session import PARTS, Curve, Measure

__all__ = ["DepthError", "DepthFit", "phases"]


class DepthError(ValueError):
    """The shallow measures do not make a consistent depth model (the caller measures the full model)."""


def phases(m: Measure) -> list[Measure]:
    """The measure cut into what is extrapolated separately: the forward, the backward, the
    optimizer step (timeline slices), and the parts' sum (the estimate's floor for the peak)."""
    cuts = [0, *m.phases, len(m.timeline)]
    out = [
        Measure(m.precision, max(m.timeline[a:b], default=0), {}, {}, m.timeline[a:b])
        for a, b in zip(cuts, cuts[1:])
    ]
    out.append(Measure(m.precision, sum(m.parts.values()) - m.parts["temporaries"], {}, {}, ()))
    return out


class DepthFit:
    """The peak (and parts) at any depth and batch from measures at two depths x two or more
    batches: ``measures[(depth, batch)]``. At a measured batch each phase's peak is extrapolated
    in the depth as measured; elsewhere every phase is affine in the batch at each depth (a
    :class:`Curve` over its timeline, through the two largest batches) and affine in the depth.
    The peak is the largest phase."""

    def __init__(self, measures: dict[tuple[int, int], Measure]) -> None:
        depths = sorted({d for d, _ in measures})
        self.batches = sorted({b for _, b in measures})
        if len(depths) != 2 or len(self.batches) < 2 or len(measures) != 2 * len(self.batches):
            raise DepthError(
                f"a depth fit needs measures at 2 depths x 2 or more batches, got {sorted(measures)}"
            )
        (self.d1, self.d2), (self.b1, self.b2) = depths, self.batches[-2:]
        self.measures = measures
        self.offsets: tuple[int, ...] = ()  # per phase, added to every peak (:meth:`shifted`)
        self.curves: dict[int, list[Curve]] = {}
        for d in depths:
            lo, hi = phases(measures[(d, self.b1)]), phases(measures[(d, self.b2)])
            self.curves[d] = [Curve(self.b1, x, self.b2, y) for x, y in zip(lo, hi)]
        if not all(c.ok for cs in self.curves.values() for c in cs):
            raise DepthError(
                f"the steps at batch {self.b1} and {self.b2} ran different operations: the memory is "
                "not affine in the batch there"
            )
        for (
            d,
            b,
        ), m in measures.items():  # the fit reproduces what it was fitted on, or it is refused
            got = max(math.ceil(v - 1e-6) for v in self._phase_peaks(d, b))
            if got != m.peak_bytes:
                raise DepthError(
                    f"the phases' maximum ({got}) is not the peak measured ({m.peak_bytes}) at depth "
                    f"{d}, batch {b}"
                )

    def _at(self, depth: int, f: Callable[[int], float]) -> float:
        v1, v2 = f(self.d1), f(self.d2)
        return v1 + (v2 - v1) * (depth - self.d1) / (self.d2 - self.d1)

    def shifted(self, offsets: Sequence[int]) -> DepthFit:
        """This fit with each phase's peak moved by ``offsets`` (bytes; one per phase of :func:`phases`)."""
        out = copy.copy(self)
        out.offsets = tuple(offsets)
        return out

    def _phase_peaks(self, depth: int, batch: int) -> list[float]:
        if batch in self.batches:  # measured: each phase's own peak, extrapolated in the depth
            peaks = {
                d: [p.peak_bytes for p in phases(self.measures[(d, batch)])]
                for d in (self.d1, self.d2)
            }
            out = [self._at(depth, lambda d, i=i: peaks[d][i]) for i in range(len(peaks[self.d1]))]
        else:
            out = [
                self._at(depth, lambda d, c=c: self.curves[d][c].peak(batch))
                for c in range(len(self.curves[self.d1]))
            ]
        return [v + o for v, o in zip(out, self.offsets)] if self.offsets else out

    def peak(self, depth: int, batch: int) -> int:
        """The predicted peak bytes of the ``depth``-block model at ``batch`` (rounded up)."""
        return max(math.ceil(v - 1e-6) for v in self._phase_peaks(depth, batch))

    def parts(self, depth: int, batch: int) -> dict[str, int]:
        """Every part of :data:`PARTS` at ``depth`` x ``batch`` (bilinear; temporaries: what the peak adds)."""

        def part(name: str, d: int) -> float:
            if batch in self.batches:
                return self.measures[(d, batch)].parts[name]
            x, y = self.measures[(d, self.b1)].parts[name], self.measures[(d, self.b2)].parts[name]
            return x + (y - x) * (batch - self.b1) / (self.b2 - self.b1)

        out = {k: max(0, round(self._at(depth, functools.partial(part, k)))) for k in PARTS[:5]}
        out["temporaries"] = max(0, self.peak(depth, batch) - sum(out.values()))
        return out

    def largest(self, depth: int, budget: int, limit: int) -> int:
        """The largest batch in ``[b1, limit]`` whose predicted peak fits ``budget`` (``b1 - 1``: not
        even ``b1``; the caller decides smaller batches by their own measures). The peak grows with
        the batch (bisection)."""
        lo = self.b1
        if self.peak(depth, lo) > budget:
            return lo - 1
        hi = 2 * lo
        while hi <= limit and self.peak(depth, hi) <= budget:
            lo, hi = hi, 2 * hi
        if hi > limit:
            if self.peak(depth, limit) <= budget:
                return limit
            hi = limit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak(depth, mid) <= budget else (lo, mid)
        return lo
