"""A plan by depth: each precision's largest batch (as is, with activation checkpointing, with the
optimizer in backward) from the shallow copies' fits of :mod:`ampkit.plan.depth`, the rungs and
twins from their plain precision's fits (:mod:`ampkit.plan.depth_rungs`), the full model measured
where a fit is refused. What ``ampkit plan`` and the service's planner both call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch

from ..step.policies.pure.ladder import parse_rung
from ..step.precision import REGISTRY
from . import devices as plan_devices
from .depth import DepthError, DepthFit, PlanRow, Stack, by_depth
from .depth_rungs import largest_in_backward, rung_row, twin_fits
from .estimate import size_text
from .session import Measure, Session, fit

__all__ = ["TWINS", "plan_groups", "plan_on", "plan_precision", "plan_precisions", "why_not"]


def _measured(
    factory: Callable[[], torch.nn.Module],
    precision: str,
    batch_of: Callable[[int], Any],
    budget: int,
    limit: int,
    ckpt: bool,
    optimizer: Any,
    at_batch: Optional[int],
    guess: Optional[int],
) -> tuple[Optional[Measure], int]:
    """The full model measured: the step at ``at_batch`` (if given) and the exact largest batch
    (:func:`fit`, started from ``guess`` and ``guess + 1`` when there is one)."""
    with Session(factory, optimizer, precision, activation_checkpointing=ckpt) as session:
        at = session.measure(batch_of(at_batch)) if at_batch else None
        if guess is not None and guess >= 2:
            first = (guess, at if guess == at_batch else session.measure(batch_of(guess)))
        else:
            first = (at_batch, at) if at is not None else None
        return at, fit(session, batch_of, budget, limit, first=first)[0]


def plan_precision(
    factory: Callable[[], torch.nn.Module],
    batch_of: Callable[[int], Any],
    budget: int,
    precision: str,
    batch_size: int,
    *,
    stack: Optional[Stack] = None,
    checkpointing: bool = True,
    verify: bool = False,
    limit: int = 1 << 16,
    optimizer: Any = "adamw",
) -> PlanRow:
    """One precision's row of a plan for a budget of ``budget`` bytes.

    With a ``stack`` (:func:`stack_for`) the peaks come from shallow copies (:class:`DepthFit`:
    seconds instead of minutes for GPT-2); ``verify`` then also measures the full model at
    ``batch_size`` and at the answers ``B`` and ``B + 1`` (an exact search continues where the
    extrapolation missed), so the row holds the measured values and ``verified`` says whether the
    extrapolation had them. Without a stack -- or when the shallow measures do not make a
    consistent fit (:class:`DepthError`) -- the full model is measured: ``B`` fits and ``B + 1``
    does not, by the estimate of the full model's step."""
    return _plan(
        factory,
        batch_of,
        budget,
        precision,
        batch_size,
        stack,
        checkpointing,
        verify,
        limit,
        optimizer,
    )[0]


def _plan(
    factory: Callable[[], torch.nn.Module],
    batch_of: Callable[[int], Any],
    budget: int,
    precision: str,
    batch_size: int,
    stack: Optional[Stack],
    checkpointing: bool,
    verify: bool,
    limit: int,
    optimizer: Any,
) -> tuple[PlanRow, Optional[dict[bool, DepthFit]]]:
    """:func:`plan_precision`, and the depth fits its row came from (None: measured whole or verified)."""
    if stack is not None:
        try:
            found, at_b, fits = by_depth(
                stack,
                precision,
                batch_of,
                budget,
                limit,
                (False, True) if checkpointing else (False,),
                optimizer,
                batch_size,
            )
        except DepthError:
            stack = None
        else:
            best, best_ckpt = found[False], found.get(True)

            obw = largest_in_backward(fits, stack.depth, budget, limit)
            row = PlanRow(
                at_b[0],
                batch_size,
                at_b[1],
                at_b[2],
                best,
                best_ckpt,
                "depth",
                None,
                obw[False],
                obw.get(True),
            )
            if not verify:
                return row, fits
            at, exact = _measured(
                factory, precision, batch_of, budget, limit, False, optimizer, batch_size, best
            )
            exact_ckpt = (
                _measured(
                    factory, precision, batch_of, budget, limit, True, optimizer, None, best_ckpt
                )[1]
                if checkpointing
                else None
            )
            assert at is not None
            agreed = (at.peak_bytes, exact, exact_ckpt) == (row.peak_bytes, best, best_ckpt)
            return PlanRow(
                at.precision,
                batch_size,
                at.peak_bytes,
                dict(at.parts),
                exact,
                exact_ckpt,
                "depth, verified",
                agreed,
            ), None
    at, best = _measured(
        factory, precision, batch_of, budget, limit, False, optimizer, batch_size, None
    )
    assert at is not None
    best_ckpt = (
        _measured(factory, precision, batch_of, budget, limit, True, optimizer, None, None)[1]
        if checkpointing
        else None
    )
    return PlanRow(
        at.precision, batch_size, at.peak_bytes, dict(at.parts), best, best_ckpt, "measured"
    ), None


#: precisions whose steps differ only by the loss scaler's scalars (the same element sizes; fp16 adds a
#: scaled loss held through the backward, the scale and found-inf scalars through the optimizer step)
#: ((bf16, fp16), (bf16-pure, fp16-pure)), from the registry's ``twin``
TWINS = tuple((n, r.twin) for n, r in REGISTRY.items() if r.twin and n < r.twin)


def plan_groups(
    precisions: Sequence[str], stack: Optional[Stack], verify: bool = False
) -> list[list[str]]:
    """The precisions :func:`plan_precisions` plans together where they are asked of a stack model (not
    with ``verify``: each is measured whole then): both of a :data:`TWINS` pair, and the rungs of a
    memory ladder (``bf16-pure:split``, ``bf16-pure:stochastic+bf16``) with their precision, the plain
    one first (it holds the most: a rung's answers are then within its measured batches); else each alone."""
    out: list[list[str]] = []
    taken: set[str] = set()
    together = stack is not None and not verify
    for p in precisions:
        if p in taken:
            continue
        base = parse_rung(p)[0]
        rungs = [q for q in precisions if together and parse_rung(q)[0] == base and q not in taken]
        group = sorted(rungs or [p], key=lambda q: q != base)  # stable: the plain precision first
        twin = next((b if a == base else a for a, b in TWINS if base in (a, b)), None)
        if together and twin in precisions and twin not in taken and group[0] == base:
            group.insert(1, twin)
        out.append(group)
        taken.update(group)
    return out


def plan_precisions(
    factory: Callable[[], torch.nn.Module],
    batch_of: Callable[[int], Any],
    budget: int,
    precisions: list[str],
    batch_size: int,
    *,
    stack: Optional[Stack] = None,
    checkpointing: bool = True,
    verify: bool = False,
    limit: int = 1 << 16,
    optimizer: Any = "adamw",
) -> list[PlanRow]:
    """:func:`plan_precision` for each of ``precisions`` (in order). Where the first is planned by
    depth extrapolation, each later one is measured on the 1-block copy at the first batch (each
    checkpointing setting: one small session) and, where its parts there are the first's, takes the
    first's fits shifted by its own difference in each phase's peak (:func:`~.depth_rungs.twin_fits`; method
    ``"depth, as <first>"``) -- for :data:`TWINS` the loss scaler's scalars, the same at every depth
    and batch (tested against their own fits). Anything else, or ``verify``: its own plan."""
    first, fits = _plan(
        factory,
        batch_of,
        budget,
        precisions[0],
        batch_size,
        stack,
        checkpointing,
        verify,
        limit,
        optimizer,
    )

    rows = [first]
    family = parse_rung(precisions[0])[0]
    for p in precisions[1:]:
        if (
            fits is not None
            and stack is not None
            and parse_rung(p)[0] == family
            and p != precisions[0]
        ):
            got = rung_row(
                stack,
                p,
                batch_of,
                budget,
                limit,
                optimizer,
                batch_size,
                fits,
                first.precision,
                precisions[0],
            )
            if got is not None:
                rows.append(got[0])
                fits = got[1]
                continue
        twin = (
            twin_fits(stack, p, batch_of, fits, optimizer)
            if fits is not None and stack is not None
            else None
        )
        if twin is not None:
            try:
                found, at_b, grown = by_depth(
                    stack,
                    p,
                    batch_of,
                    budget,
                    limit,
                    tuple(twin[1]),
                    optimizer,
                    batch_size,
                    fits=twin[1],
                )
            except DepthError:
                twin = None
            else:
                obw = largest_in_backward(grown, stack.depth, budget, limit)
                rows.append(
                    PlanRow(
                        twin[0],
                        batch_size,
                        at_b[1],
                        at_b[2],
                        found[False],
                        found.get(True),
                        f"depth, as {first.precision}",
                        None,
                        obw[False],
                        obw.get(True),
                    )
                )
        if twin is None:
            rows.append(
                plan_precision(
                    factory,
                    batch_of,
                    budget,
                    p,
                    batch_size,
                    stack=stack,
                    checkpointing=checkpointing,
                    verify=verify,
                    limit=limit,
                    optimizer=optimizer,
                )
            )
    return rows


def plan_on(
    target: Optional[plan_devices.GPU],
    factory: Callable[[], torch.nn.Module],
    batch_of: Callable[[int], Any],
    budget: int,
    precisions: list[str],
    batch_size: int,
    **options: Any,
) -> list[Union[PlanRow, str]]:
    """:func:`plan_precisions` of ``precisions`` for ``target`` (a GPU of
    :mod:`ampkit.plan.devices`, planned on fake CPU tensors with its allocator and workspaces; None:
    this CPU), in order: each a row, or, where the device cannot run the precision (a card without
    bf16), the reason it refuses it. ``options``: :func:`plan_precisions`' keywords. What ``ampkit
    plan --device`` and the service's planner both call."""
    refused = {p: target.refuses(p) for p in precisions} if target is not None else {}
    asked = [p for p in precisions if not refused.get(p)]
    with plan_devices.use(target):
        rows = (
            plan_precisions(factory, batch_of, budget, asked, batch_size, **options)
            if asked
            else []
        )
    found = dict(zip(asked, rows))
    return [refused.get(p) or found[p] for p in precisions]


def why_not(row: PlanRow, budget: int) -> Optional[str]:
    """Why a row fits no batch at all in ``budget`` bytes (None when batch 1 fits): its state alone,
    or batch 1's activations and temporaries."""
    if row.static_bytes > budget:
        return (
            f"its parameters, gradients, masters and optimizer state alone need "
            f"{size_text(row.static_bytes)}, more than the budget's {size_text(budget)}"
        )
    if row.largest == 0:
        return (
            f"not even batch 1 fits the budget's {size_text(budget)} (activations and temporaries)"
        )
    return None
