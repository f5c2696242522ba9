"""The memory of a deep stack of identical blocks, predicted from shallow copies of it.

A transformer's training step is a prefix (embeddings), ``n`` identical blocks and a suffix (the
head, the loss), forward and backward, then the optimizer step. Its parameters, gradients,
optimizer state and saved activations grow by the same bytes per block, and so does the memory
at the end of the forward, at either end of the backward and in the optimizer step: each phase's
peak is affine in the depth, as each is affine in the batch (:class:`~ampkit.plan.session.Curve`).
The step's peak is the largest of them -- which phase holds it can change with the depth, so the
phases are extrapolated one by one, then the maximum taken (:class:`DepthFit`).

So the model is built at two depths (1 and 2 blocks), each measured at two batch sizes (4 and 5):
four fake-tensor steps of a one- or two-block model instead of a dozen of the full one. A fit
that does not reproduce its own four measures (the phases' maximum is not the peak measured) is
refused (:class:`DepthError`) and the caller measures the full model instead. The plan built on
these (:func:`ampkit.plan.depth_plan.plan_precision`, what ``ampkit plan`` and the service's planner
both call) is in :mod:`ampkit.plan.depth_plan`: the measurement and the fit here, their use there.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from . import cache as plan_cache
from .depth_fit import DepthError, DepthFit, phases
from .session import Measure, Session

__all__ = [
    "BATCHES",
    "DEPTHS",
    "METHOD_NOTE",
    "DepthError",
    "DepthFit",
    "PlanRow",
    "Stack",
    "by_depth",
    "measure_both",
    "measure_depths",
    "phases",
    "stack_for",
]

DEPTHS = (1, 2)  # the shallow copies measured (peaks are affine in the depth from one block on)
BATCHES = (4, 5)  # the batch sizes each is measured at: batches 1 and 2 can run other operations (a
# size-1 or size-2 dimension takes another path; fp8's casts at batch 3), which no line through them would foresee
METHOD_NOTE = (
    "estimated by depth extrapolation from 1- and 2-block copies of the model (each phase's peak "
    "extrapolated, then the largest taken; measured error 0 bytes on GPT-2 at 3, 6 and 12 layers and "
    "the built-in gpt small/medium, see docs/benchmarks.md); --verify measures the full model at the "
    "answer"
)


@dataclass(frozen=True)
class Stack:
    """A model made of ``depth`` identical blocks; ``factory(n)`` is a zero-argument factory of the
    same model with ``n`` blocks (called under fake tensors)."""

    name: str
    depth: int
    factory: Callable[[int], Callable[[], torch.nn.Module]]
    spec: str = (
        ""  # the configuration, as text: names its measures in the plan cache ("": not kept)
    )


def _gpt(cfg: dict[str, Any]) -> torch.nn.Module:
    from ..models.builtin import GPT, GPTConfig

    return GPT(GPTConfig(**cfg))


def _gpt_at(cfg: dict[str, Any], n: int) -> Callable[[], torch.nn.Module]:
    return functools.partial(_gpt, {**cfg, "n_layer": n})


def _hf_at(spec: str, overrides: dict[str, Any], key: str, n: int) -> Callable[[], torch.nn.Module]:
    from ..models.hf_configs import build_hf

    return functools.partial(build_hf, spec, {**overrides, key: n})


def stack_for(
    model: str, size: str = "small", overrides: Optional[dict[str, Any]] = None
) -> Optional[Stack]:
    """The built-in ``gpt`` at ``size``, or a Hugging Face config model with a layer count
    (``num_hidden_layers``, ``n_layer`` for GPT-2), as a :class:`Stack`; None for any other model
    (an MLP, a CNN, a user's ``module:factory``): those are measured whole."""
    from ..models.builtin import SIZES
    from ..models.hf_configs import config_file, hf_config, is_hf

    if model == "gpt" and size in SIZES["gpt"]:
        cfg = dict(SIZES["gpt"][size])
        return Stack(
            f"gpt/{size}",
            int(cfg["n_layer"]),
            functools.partial(_gpt_at, cfg),
            json.dumps(["gpt", cfg], sort_keys=True, default=repr),
        )
    if not is_hf(model):
        return None
    config = hf_config(model, overrides)
    key = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
        return None
    rest = {k: v for k, v in (overrides or {}).items() if k not in (key, "num_hidden_layers")}
    spec = [model, rest, key] + (
        [config.to_dict()] if config_file(model) else []
    )  # a file: its fields
    return Stack(
        model,
        depth,
        functools.partial(_hf_at, model, rest, key),
        json.dumps(spec, sort_keys=True, default=repr),
    )


def measure_depths(
    stack: Stack,
    precision: str,
    batch_of: Callable[[int], Any],
    *,
    optimizer: Any = "adamw",
    activation_checkpointing: bool = False,
    depths: tuple[int, int] = DEPTHS,
    batches: tuple[int, ...] = BATCHES,
) -> DepthFit:
    """Build ``stack`` at each of ``depths``, measure each at ``batches``: the :class:`DepthFit`."""
    return measure_both(
        stack,
        precision,
        batch_of,
        (activation_checkpointing,),
        optimizer=optimizer,
        depths=depths,
        batches=batches,
    )[activation_checkpointing]


def measure_both(
    stack: Stack,
    precision: str,
    batch_of: Callable[[int], Any],
    checkpointing: tuple[bool, ...],
    *,
    optimizer: Any = "adamw",
    depths: tuple[int, int] = DEPTHS,
    batches: tuple[int, ...] = BATCHES,
) -> dict[bool, DepthFit]:
    """:func:`measure_depths` for each activation checkpointing setting in ``checkpointing``, one
    session (one build and warm-up) per depth: the setting is switched between measures."""
    measures = _measures(stack, precision, batch_of, checkpointing, optimizer, depths, batches)
    return {c: DepthFit(m) for c, m in measures.items()}


def _measures(
    stack: Stack,
    precision: str,
    batch_of: Callable[[int], Any],
    checkpointing: tuple[bool, ...],
    optimizer: Any,
    depths: tuple[int, ...],
    batches: tuple[int, ...],
) -> dict[bool, dict[tuple[int, int], Measure]]:
    """The measures of :func:`measure_both` (read from ``ampkit plan``'s cache where it has them)."""
    name = plan_cache.key(
        stack.spec,
        precision,
        optimizer,
        batch_of(batches[0]),
        depths=depths,
        batches=batches,
        checkpointing=checkpointing,
    )
    kept = plan_cache.load(name)
    try:  # a repeat plan: the measures made before
        if kept is not None:
            return {
                c: {(d, b): kept[f"{int(c)},{d},{b}"] for d in depths for b in batches}
                for c in checkpointing
            }
    except KeyError:
        pass
    measures: dict[bool, dict[tuple[int, int], Measure]] = {c: {} for c in checkpointing}
    for d in depths:
        with Session(
            stack.factory(d), optimizer, precision, activation_checkpointing=checkpointing[0]
        ) as s:
            for i, ckpt in enumerate(checkpointing):
                if i:
                    s.checkpointing(ckpt)
                for (
                    b
                ) in batches:  # the warm-up runs at the first batch: its shapes are the measure's
                    measures[ckpt][(d, b)] = s.measure(batch_of(b))
    plan_cache.save(
        name, {f"{int(c)},{d},{b}": m for c, ms in measures.items() for (d, b), m in ms.items()}
    )
    return measures


@dataclass(frozen=True)
class PlanRow:
    """One precision of a plan: the peak and parts at ``batch_size``, the largest batch that fits
    (``largest_checkpointed``: with activation checkpointing; None when not asked), and how they
    were found: ``"measured"`` (the full model's steps) or ``"depth"`` (:class:`DepthFit`).
    ``verified``: with ``verify``, whether the extrapolated answers were the measured ones."""

    precision: str
    batch_size: int
    peak_bytes: int
    parts: dict[str, int]
    largest: int
    largest_checkpointed: Optional[int]
    method: str
    verified: Optional[bool] = None
    #: the largest batch with the optimizer in backward (:func:`ampkit.plan.levers.in_backward`), without
    #: and with activation checkpointing; None where not planned (a model measured whole, ``verify``)
    largest_in_backward: Optional[int] = None
    largest_in_backward_checkpointed: Optional[int] = None

    @property
    def static_bytes(self) -> int:
        """Parameters, gradients, masters and optimizer state: what no batch size changes."""
        return sum(v for k, v in self.parts.items() if k not in ("activations", "temporaries"))


def by_depth(
    stack: Stack,
    precision: str,
    batch_of: Callable[[int], Any],
    budget: int,
    limit: int,
    checkpointing: tuple[bool, ...],
    optimizer: Any,
    at_batch: int,
    fits: Optional[dict[bool, DepthFit]] = None,
    measured_as: Optional[str] = None,
) -> tuple[dict[bool, int], Any, dict[bool, DepthFit]]:
    """The largest batch by depth extrapolation per checkpointing setting, ``(label, peak,
    parts)`` at ``at_batch`` without checkpointing, and the fits. Batches below :data:`BATCHES` (an
    answer of 0-3, ``at_batch`` 1-3) are measured too, at both depths, and added to that setting's
    fit (returned so: a twin's shifted fits then answer there without measuring again); for given
    (shifted) fits they are measured in ``measured_as``, the precision the fits are of (None: a
    :class:`DepthError` instead)."""
    given = fits is not None
    fits = (
        fits
        if fits is not None
        else measure_both(stack, precision, batch_of, checkpointing, optimizer=optimizer)
    )
    best = {c: f.largest(stack.depth, budget, limit) for c, f in fits.items()}
    b1 = fits[False].b1
    # parameters, gradients, masters and optimizer state: the parts' phase (shifted too) less the activations
    static = (
        fits[False]._phase_peaks(stack.depth, b1)[-1]
        - fits[False].parts(stack.depth, b1)["activations"]
    )
    beyond = (
        static > budget
    )  # the state alone does not fit: no batch does, none is measured below b1
    low = tuple(c for c in checkpointing if best[c] < b1 and not beyond and fits[c].batches[0] > 1)
    redo = tuple(
        c
        for c in checkpointing
        if c in low or (not c and not beyond and at_batch < b1 and at_batch not in fits[c].batches)
    )
    if redo and given and measured_as is None:
        raise DepthError("the answer is below the measured batches: the twin is planned on its own")
    # every batch below b1 where the answer is there, else only --batch_size's (one session per depth)
    for batches in dict.fromkeys(tuple(range(1, b1)) if c in low else (at_batch,) for c in redo):
        settings = tuple(
            c for c in redo if (tuple(range(1, b1)) if c in low else (at_batch,)) == batches
        )
        below = _measures(
            stack, measured_as or precision, batch_of, settings, optimizer, DEPTHS, batches
        )
        fits = {
            **fits,
            **{
                c: DepthFit({**fits[c].measures, **below[c]}).shifted(fits[c].offsets)
                for c in settings
            },
        }  # 4 and 5 as measured
    for c in checkpointing:
        if beyond:
            best[c] = 0
        elif best[c] < b1:
            best[c] = next(
                (b for b in range(b1 - 1, 0, -1) if fits[c].peak(stack.depth, b) <= budget), 0
            )
    use = fits[False]
    label = use.measures[(use.d1, use.b1)].precision
    return best, (label, use.peak(stack.depth, at_batch), use.parts(stack.depth, at_batch)), fits
