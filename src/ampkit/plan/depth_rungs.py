"""Rows of a depth plan (:mod:`ampkit.plan.depth`) that are not measured on their own: the rungs of a
memory ladder and a precision's loss-scaling twin (fp16 after bf16), planned from the first
precision's fits, and the optimizer in backward, planned from every fit's measured steps
(:func:`ampkit.plan.levers.in_backward`).

A rung (``bf16-pure:split`` after ``bf16-pure``) has its precision's forward and backward; only what
is kept for the weights and the optimizer step differ, by bytes that grow with the depth and not
with the batch or checkpointing. So it is measured on the 1- and 2-block copies at the first batch
(two small steps instead of eight or more) and takes its precision's fits shifted by its own
difference in each phase's peak, extrapolated to the full depth (tested equal to its own plan).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

from . import cache as plan_cache
from .depth import DEPTHS, DepthError, DepthFit, PlanRow, Stack, by_depth, phases
from .levers import in_backward
from .session import PARTS, Measure, Session

__all__ = ["largest_in_backward", "rung_row", "turned", "twin_fits"]


def turned(
    fits: dict[bool, DepthFit], offsets: Optional[Sequence[int]] = None
) -> dict[bool, DepthFit]:
    """``fits`` with the optimizer in backward: each measure turned by
    :func:`ampkit.plan.levers.in_backward`, then shifted as ``fits`` are (or by ``offsets``: a
    rung's own, from its turned measures)."""
    return {
        c: DepthFit({k: in_backward(m) for k, m in f.measures.items()}).shifted(
            f.offsets if offsets is None else offsets
        )
        for c, f in fits.items()
    }


def largest_in_backward(
    fits: dict[bool, DepthFit],
    depth: int,
    budget: int,
    limit: int,
    offsets: Optional[Sequence[int]] = None,
) -> dict[bool, Optional[int]]:
    """The largest batch with the optimizer in backward per checkpointing setting (below the measured
    batches by the fit's own line, none measured for it); None where a measure has no gradients' timeline."""
    try:
        fitted = turned(fits, offsets)
    except (ValueError, DepthError):
        return {c: None for c in fits}
    out: dict[bool, Optional[int]] = {}
    for c, f in fitted.items():
        best = f.largest(depth, budget, limit)
        if best < f.batches[0]:
            best = next(
                (b for b in range(f.batches[0] - 1, 0, -1) if f.peak(depth, b) <= budget), 0
            )
        out[c] = best
    return out


def _rung_fits(
    stack: Stack,
    precision: str,
    batch_of: Callable[[int], Any],
    fits: dict[bool, DepthFit],
    optimizer: Any,
) -> Optional[tuple[Measure, Measure, dict[bool, DepthFit], Optional[list[int]]]]:
    """Another rung of the fitted precision's memory ladder (``bf16-pure:split`` after ``bf16-pure``):
    the same model, forward and backward; only what is kept for the weights and the optimizer step
    differ, by bytes that grow with the depth and not with the batch or checkpointing. So it is
    measured on the 1- and 2-block copies at the first batch only (two small steps instead of eight
    or more), and its fits are ``fits`` shifted by its difference in each phase's peak, extrapolated
    to the full depth. Returns its two measures, the fits and the offsets of the same with the
    optimizer in backward (None: not known); None (plan it on its own) unless its activations there
    are byte for byte the fitted precision's and it ran the same phases."""
    f = fits[False]
    b = f.b1
    name = plan_cache.key(
        stack.spec,
        precision,
        optimizer,
        batch_of(b),
        depths=(f.d1, f.d2),
        batches=(b,),
        checkpointing=(False,),
        rung=True,
    )
    kept = plan_cache.load(name) or {}
    if all(str(d) in kept for d in (f.d1, f.d2)):
        measured = {d: kept[str(d)] for d in (f.d1, f.d2)}
    else:
        measured = {}
        for d in (f.d1, f.d2):
            with Session(stack.factory(d), optimizer, precision) as s:
                measured[d] = s.measure(batch_of(b))
        plan_cache.save(name, {str(d): m for d, m in measured.items()})
    for d, m in measured.items():
        ref = f.measures[(d, b)]
        if m.parts["activations"] != ref.parts["activations"] or len(m.phases) != len(ref.phases):
            return None
    span = (stack.depth - f.d1) / (f.d2 - f.d1)

    def offsets(turn: Callable[[Measure], Measure]) -> list[int]:
        diffs = {
            d: [
                x.peak_bytes - y.peak_bytes
                for x, y in zip(phases(turn(m)), phases(turn(f.measures[(d, b)])))
            ]
            for d, m in measured.items()
        }
        return [round(x + (y - x) * span) for x, y in zip(diffs[f.d1], diffs[f.d2])]

    try:
        obw: Optional[list[int]] = offsets(in_backward)
    except ValueError:
        obw = None
    shifted = {c: fit_.shifted(offsets(lambda m: m)) for c, fit_ in fits.items()}
    return measured[f.d1], measured[f.d2], shifted, obw


def rung_row(
    stack: Stack,
    precision: str,
    batch_of: Callable[[int], Any],
    budget: int,
    limit: int,
    optimizer: Any,
    batch_size: int,
    fits: dict[bool, DepthFit],
    first: str,
    first_spec: str,
) -> Optional[tuple[PlanRow, dict[bool, DepthFit]]]:
    """``precision``'s row from :func:`_rung_fits`, and ``fits`` with what was measured for it below
    their batches (in ``first_spec``, the precision they are of); None: plan it on its own."""
    got = _rung_fits(stack, precision, batch_of, fits, optimizer)
    if got is None:
        return None
    m1, m2, shifted, obw_offsets = got
    try:
        found, at_b, grown = by_depth(
            stack,
            precision,
            batch_of,
            budget,
            limit,
            tuple(shifted),
            optimizer,
            batch_size,
            fits=shifted,
            measured_as=first_spec,
        )
    except DepthError:
        return None
    f = fits[False]
    span = (stack.depth - f.d1) / (f.d2 - f.d1)
    parts = dict(at_b[2])
    for k in PARTS[:4]:  # the rung's own weights, masters and state, extrapolated in the depth
        x = m1.parts[k] - f.measures[(f.d1, f.b1)].parts[k]
        y = m2.parts[k] - f.measures[(f.d2, f.b1)].parts[k]
        parts[k] = max(0, parts[k] + round(x + (y - x) * span))
    parts["temporaries"] = max(0, at_b[1] - sum(v for k, v in parts.items() if k != "temporaries"))
    base = {c: g.shifted(()) for c, g in grown.items()}
    obw = (
        largest_in_backward(base, stack.depth, budget, limit, obw_offsets)
        if obw_offsets is not None
        else {}
    )
    row = PlanRow(
        m1.precision,
        batch_size,
        at_b[1],
        parts,
        found[False],
        found.get(True),
        f"depth, rung of {first}",
        None,
        obw.get(False),
        obw.get(True),
    )
    return row, base


def twin_fits(
    stack: Stack,
    precision: str,
    batch_of: Callable[[int], Any],
    fits: dict[bool, DepthFit],
    optimizer: Any,
) -> Optional[tuple[str, dict[bool, DepthFit]]]:
    """``precision``'s label and fits as ``fits`` shifted by its own per-phase difference, measured on
    the first depth's copy at the first batch with each checkpointing setting of ``fits``; None (plan
    it on its own) unless its parameters, gradients, masters, optimizer state and activations there
    are byte for byte the fitted precision's and it ran the same phases."""
    out: dict[bool, DepthFit] = {}
    settings = tuple(fits)
    first = fits[settings[0]]
    name = plan_cache.key(
        stack.spec,
        precision,
        optimizer,
        batch_of(first.b1),
        depths=(first.d1,),
        batches=(first.b1,),
        checkpointing=settings,
        twin=True,
    )
    kept = plan_cache.load(name) or {}
    if all(str(int(c)) in kept for c in settings):
        measured = {c: kept[str(int(c))] for c in settings}
    else:
        measured = {}
        with Session(
            stack.factory(DEPTHS[0]), optimizer, precision, activation_checkpointing=settings[0]
        ) as s:
            for i, c in enumerate(settings):
                if i:
                    s.checkpointing(c)
                measured[c] = s.measure(batch_of(fits[c].b1))
        plan_cache.save(name, {str(int(c)): m for c, m in measured.items()})
    for c in settings:
        f = fits[c]
        m, ref = measured[c], f.measures[(f.d1, f.b1)]
        same = {k: v for k, v in m.parts.items() if k != "temporaries"} == {
            k: v for k, v in ref.parts.items() if k != "temporaries"
        }
        if not same or len(m.phases) != len(ref.phases):
            return None
        out[c] = f.shifted([x.peak_bytes - y.peak_bytes for x, y in zip(phases(m), phases(ref))])
    return m.precision, out
