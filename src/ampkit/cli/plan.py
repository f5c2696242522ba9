"""``ampkit plan``: will it fit? Predicted memory per precision and the largest batch for a budget."""

from __future__ import annotations

import argparse
import json
import os
import threading
from typing import Any, Optional

from ..plan.depth import METHOD_NOTE
from ..plan.depth_plan import plan_groups, plan_on, why_not
from ..plan.devices import DEVICES
from ..plan.estimate import PLAN_PRECISIONS, parse_bytes, size_text
from ..step.precision import REFERENCE, REGISTRY
from ..step.rung import PLAIN, split_spec
from .common import estimate_inputs, flag, memory_size, model_label, positive_int, wide_console
from .flags import model_flags, precision_list
from .invocation import Invocation

DEFAULT = ",".join(PLAN_PRECISIONS)  # and fp8 where torchao is installed
LIMIT = 1 << 16  # the largest batch a plan reports


def _unmeasured(name: str) -> bool:
    """True for a precision whose activations the estimate cannot follow (fp8): it plans longest."""
    row = REGISTRY.get(name.partition(":")[0])
    return row is not None and not row.measures_activations


#: a GPU plan's rows: the autocast reference and every rung of bf16-pure's memory ladder, with fp32 and
#: bf16 optimizer states (a card without bf16 plans fp16's instead)
GPU_DEFAULT = (
    "fp32,bf16,bf16-pure,bf16-pure:split,bf16-pure:kahan,bf16-pure:stochastic,bf16-pure:fp32+bf16,"
    "bf16-pure:split+bf16,bf16-pure:stochastic+bf16"
)


def default_precisions(target: Any = None) -> str:
    """The rows of a plan without ``--precisions``: for the CPU every precision (and fp8 with
    torchao); for a GPU every rung (:data:`GPU_DEFAULT`; fp8 where the card and torchao have it)."""
    import importlib.util

    fp8 = importlib.util.find_spec("torchao") is not None
    if target is None:
        return DEFAULT + (",fp8" if fp8 else "")
    if not target.bf16:
        return "fp32,fp16,fp16-pure"
    return GPU_DEFAULT + (",fp8" if fp8 and target.fp8 else "")


def _model_only(args: argparse.Namespace, factory: Any) -> Any:
    """A factory that builds the model and nothing else (``estimate_inputs``' factory also builds
    the data, once per call): a Hugging Face config or a built-in model; a user's factory as is."""
    import functools

    from ..models.builtin import MODELS, build
    from ..models.hf_configs import build_hf, is_hf, parse_overrides

    if is_hf(args.model):
        return functools.partial(
            build_hf, args.model, parse_overrides(getattr(args, "model_config", None))
        )
    return functools.partial(build, args.model, args.size) if args.model in MODELS else factory


def _stack(args: argparse.Namespace) -> Any:
    """The model as a stack of blocks (built-in gpt, Hugging Face configs), or None: measured whole."""
    from ..models.hf_configs import is_hf, parse_overrides
    from ..plan.depth import stack_for

    overrides = parse_overrides(getattr(args, "model_config", None)) if is_hf(args.model) else None
    return stack_for(args.model, args.size, overrides)


def _device(args: argparse.Namespace) -> Any:
    """The GPU of ``--device`` (:class:`ampkit.plan.devices.GPU`), or None for the CPU."""
    from ..plan.devices import parse_device

    return parse_device(getattr(args, "device", None) or "cpu")


def budget_of(args: argparse.Namespace) -> int:
    """The bytes a step may take: ``--memory`` on the CPU; on a GPU ``--memory`` (default: the device's
    memory) less the CUDA context and the allocator's fragmentation (:meth:`GPU.budget`)."""
    from ..plan.devices import plan_budget

    return plan_budget(_device(args), parse_bytes(args.memory) if args.memory is not None else None)


def _group(
    factory: Any,
    batch_of: Any,
    budget: int,
    precisions: list[str],
    args: argparse.Namespace,
    stack: Any,
) -> list[dict[str, Any]]:
    """The rows of precisions planned together (:func:`ampkit.plan.depth_plan.plan_on`: the first
    by depth extrapolation for a stack of blocks, else each search builds the full model once and
    measures a handful of batch sizes; a twin takes the first's fits shifted by its own difference;
    a precision the device cannot run, refused with the reason): the step at ``--batch_size`` and
    the largest batch with and without activation checkpointing."""
    from ..plan import cache as plan_cache

    with plan_cache.use(None if getattr(args, "no_cache", True) else plan_cache.cache_dir()):
        found = plan_on(
            _device(args),
            factory,
            batch_of,
            budget,
            precisions,
            args.batch_size,
            stack=stack,
            verify=getattr(args, "verify", False),
            limit=LIMIT,
        )
    out = []
    for p, r in zip(precisions, found):
        if isinstance(r, str):
            out.append(
                {
                    "precision": p,
                    "peak_bytes": None,
                    "parts": None,
                    "batch_size": args.batch_size,
                    "fits": False,
                    "largest_batch": 0,
                    "largest_batch_activation_checkpointing": 0,
                    "largest_batch_optimizer_in_backward": 0,
                    "largest_batch_optimizer_in_backward_activation_checkpointing": 0,
                    "method": "refused",
                    "verified": None,
                    "why_not": r,
                }
            )
            continue
        out.append(
            {
                "precision": r.precision,
                "peak_bytes": r.peak_bytes,
                "parts": dict(r.parts),
                "batch_size": args.batch_size,
                "fits": r.peak_bytes <= budget,
                "largest_batch": r.largest,
                "largest_batch_activation_checkpointing": r.largest_checkpointed,
                "largest_batch_optimizer_in_backward": r.largest_in_backward,
                "largest_batch_optimizer_in_backward_activation_checkpointing": r.largest_in_backward_checkpointed,
                "method": r.method,
                "verified": r.verified,
                "why_not": why_not(r, budget),
            }
        )
    return out


_JOB: Any = None  # what a forked worker of _rows needs (set before the fork, read in the child)


def _job_rows(group: list[str]) -> list[dict[str, Any]]:
    return _group(*_JOB[:3], group, *_JOB[3:])


def workers(n_rows: int, asked: Optional[int] = None) -> int:
    """How many processes measure the rows: ``asked`` (``--workers``), else one per core up to one
    per group of rows. Rows run in forked copies of this process, so only where forking is safe: a
    POSIX ``fork``, and no other Python thread (a forked thread's locks could be held forever)."""
    n = asked if asked is not None else min(n_rows, os.cpu_count() or 1)
    if n < 2 or n_rows < 2 or not hasattr(os, "fork") or threading.active_count() > 1:
        return 1
    return min(n, n_rows)


def _rows(
    factory: Any,
    batch_of: Any,
    budget: int,
    precisions: list[str],
    args: argparse.Namespace,
    stack: Any,
) -> list[dict[str, Any]]:
    """Each precision's row, in the order asked; the groups are independent, so ``workers()`` forked
    processes share them (the costlier first: fp8's casts, then the pairs)."""
    global _JOB
    todo = plan_groups(precisions, stack, getattr(args, "verify", False))
    n = workers(len(todo), getattr(args, "workers", None))
    if n == 1:
        done = [_group(factory, batch_of, budget, g, args, stack) for g in todo]
    else:
        import gc
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        todo.sort(key=lambda g: (not any(_unmeasured(n) for n in g), -len(g)))  # slow ones first
        _JOB = (factory, batch_of, budget, args, stack)
        # what the imports made is never garbage: out of the collector's sight, a collection in a child
        # walks only what the measures make (fp32, bf16, fp8 measured in one process: 7.4 s -> 6.5 s
        # once, within this machine's noise otherwise), and forked pages stay shared
        gc.freeze()
        try:
            import torch

            # one intra-op thread in each child: its measures run fake tensors (no kernels), and a forked
            # child must not start the parent's OpenMP pool (what DataLoader workers do too). An executor,
            # not a Pool: a child killed from outside (the OOM killer) fails the plan instead of hanging it
            with ProcessPoolExecutor(
                n,
                mp_context=multiprocessing.get_context("fork"),
                initializer=torch.set_num_threads,
                initargs=(1,),
            ) as pool:
                done = list(pool.map(_job_rows, todo))
        finally:
            _JOB = None
            gc.unfreeze()
    by_name = {p: r for g, rs in zip(todo, done) for p, r in zip(g, rs)}
    return [by_name[p] for p in precisions]


def plan_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    budget = budget_of(args)
    factory, batch_of = estimate_inputs(argparse.Namespace(**{**vars(args), "seed": 0}))
    factory = _model_only(args, factory)
    stack = _stack(args)
    given = args.precisions or default_precisions(
        _device(args)
    )  # --precisions' list (checked), or a string
    precisions = precision_list(given) if isinstance(given, str) else list(given)
    rows = _rows(factory, batch_of, budget, precisions, args, stack)
    ref = next((r for r in rows if r["precision"] == REFERENCE), None)
    for r in rows:
        known = ref and ref["peak_bytes"] and r["peak_bytes"] is not None
        r["saving_vs_fp32"] = 1 - r["peak_bytes"] / ref["peak_bytes"] if known else None
    return rows


def _method_line(rows: list[dict[str, Any]]) -> str:
    """How the rows were found, for the caption and ``--json``'s ``"method"``."""
    twins = [
        f"{r['precision']} as {r['method'][len('depth, as ') :]}"
        for r in rows
        if r["method"].startswith("depth, as ")
    ]
    rungs = [f"{r['precision']}" for r in rows if r["method"].startswith("depth, rung of ")]
    rows = [r for r in rows if r["method"] != "refused"]
    methods = {
        "depth" if r["method"].startswith(("depth, as ", "depth, rung of ")) else r["method"]
        for r in rows
    }
    if (
        rungs
    ):  # a ladder's rungs: the fits of the first row of their precision, shifted by their own bytes
        note = (
            f"{', '.join(rungs)}: the same extrapolation plus the rung's own difference in each phase's peak "
            "(its masters and optimizer state), measured on the 1- and 2-block copies at batch 4"
        )
        rest = _method_line([r for r in rows if not r["method"].startswith("depth, rung of ")])
        return f"{rest}; {note}"
    if twins:  # e.g. fp16: byte for byte bf16's steps where both were measured (1 block, batch 4)
        note = (
            f"{', '.join(twins)}: the same extrapolation plus its own difference in each phase's peak (the "
            "loss scaler's few bytes), measured on a 1-block copy at batch 4 with and without checkpointing"
        )
        return (
            f"{METHOD_NOTE}; {note}"
            if methods == {"depth"}
            else f"per row: {', '.join(sorted(methods))}; {note}"
        )
    if not methods:
        return "no row was estimated: the device runs none of these precisions (each row says why)"
    if methods == {"measured"}:
        return "measured: the full model's training step on fake tensors (B fits, B + 1 does not)"
    if methods == {"depth"}:
        return METHOD_NOTE
    if methods == {"depth, verified"}:
        agreed = all(r["verified"] for r in rows)
        return (
            "depth extrapolation, verified: the full model measured at the batch and at each answer B and "
            + (
                "B + 1 (the extrapolation had every value)"
                if agreed
                else "B + 1 (the extrapolation missed somewhere; the measured values are shown)"
            )
        )
    return f"per row (see each row's method): {', '.join(sorted(methods))}; depth: {METHOD_NOTE}"


def figures_device(args: Optional[argparse.Namespace] = None) -> tuple[str, str]:
    """``(device, its name)`` the plan's figures are for: ``--device``'s GPU (its allocator, workspaces
    and fused attention, planned on fake CPU tensors), else this CPU (its kernels' memory)."""
    from ..plan.devices import figures_for

    return figures_for(_device(args) if args is not None else None)


def cmd_plan(inv: Invocation) -> int:
    args = inv.args
    rows = plan_rows(args)
    device, name = figures_device(args)
    target = _device(args)
    budget = budget_of(args)
    memory = parse_bytes(args.memory) if args.memory is not None else target.memory_bytes
    if args.json:
        print(
            json.dumps(
                {
                    "model": model_label(args),
                    "memory_bytes": memory,
                    "budget_bytes": budget,
                    "device": device,
                    "device_name": name,
                    **({"device_info": target.to_dict()} if target is not None else {}),
                    "method": _method_line(rows),
                    "rows": rows,
                },
                indent=2,
            )
        )
        return 0
    from rich.table import Table

    where = f"{name} ({device})" if target is not None else f"{device} ({name})"
    table = Table(
        title=f"ampkit plan for {where}: {model_label(args)}, budget {size_text(budget)} of {size_text(memory)}, "
        f"batch {args.batch_size}"
    )
    for col in (
        "precision",
        "peak at batch",
        "fits",
        "largest batch",
        "… with act. ckpt",
        "… opt. in bwd",
        "… both",
        "saving vs fp32",
    ):
        table.add_column(col, justify="right" if col != "precision" else "left")
    notes = []

    def cell(v: Any) -> str:
        return "—" if v is None else str(v)

    for r in rows:
        saving = f"{100 * r['saving_vs_fp32']:.0f}%" if r["saving_vs_fp32"] is not None else "—"
        peak = f"{r['peak_bytes'] / 2**20:,.0f} MiB" if r["peak_bytes"] is not None else "—"
        table.add_row(
            r["precision"],
            peak,
            "yes" if r["fits"] else "no",
            cell(r["largest_batch"]),
            cell(r["largest_batch_activation_checkpointing"]),
            cell(r["largest_batch_optimizer_in_backward"]),
            cell(r["largest_batch_optimizer_in_backward_activation_checkpointing"]),
            saving,
        )
        if r.get("why_not"):  # a row the device cannot run is not one whose batch is too big
            cannot = "cannot run" if r["method"] == "refused" else "no batch fits"
            notes.append(f"{cannot} {r['precision']}: {r['why_not']}")
    kernels = (
        "its allocator's blocks, cuBLAS workspaces and fused attention; the budget is its memory less "
        "the CUDA context and fragmentation"
        if target is not None
        else "its kernels' memory"
    )
    lever = (
        "opt. in bwd: the optimizer stepped in backward, planned from the measured steps with the "
        "gradients held at each operation replaced by the largest parameter's"
    )
    ladder = [
        r["precision"]
        for r in rows
        if r.get("method") != "refused" and (split_spec(r["precision"])[1] or PLAIN).half_grads
    ]
    grads = (
        [
            f"{', '.join(ladder)}: gradients planned in bf16 (one micro-step a step, one "
            "process); with accumulation or DDP they are fp32, 2 more bytes per parameter"
        ]
        if ladder
        else []
    )
    table.caption = "\n".join(
        [
            f"figures for {where}, {kernels}; {_method_line(rows)}",
            lever,
            *grads,
            *notes,
        ]
    )
    wide_console().print(table)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="will it fit? predicted memory per precision, the largest batch for a budget"
    )
    model_flags(
        p, size="small", device=False
    )  # the estimate runs on fake tensors: --device is what it plans for
    flag(
        p,
        "device",
        default="cpu",
        metavar="DEVICE",
        help="the device the plan is for, planned from this machine (no GPU needed): cpu (default: this CPU's "
        f"kernels), cuda (a GPU of --memory) or a named GPU: {', '.join(n for n in DEVICES if n != 'cuda')}",
    )
    flag(
        p,
        "memory",
        type=memory_size,
        default=None,
        help="the memory budget, e.g. 8GiB, 512MiB, 16GB (needed for cpu and cuda; a named GPU: its memory)",
    )
    flag(
        p,
        "precisions",
        type=precision_list,
        default=None,
        help=f"comma-separated (default: {DEFAULT}, and fp8 with torchao; for a GPU: {GPU_DEFAULT})",
    )
    flag(
        p,
        "batch_size",
        type=positive_int,
        default=16,
        help="batch size to predict the peak for (default: 16)",
    )
    flag(
        p,
        "verify",
        action="store_true",
        help="measure the full model at --batch_size and at each answer B and B + 1 (gpt and Hugging Face models "
        "are otherwise extrapolated from 1- and 2-block copies: seconds instead of minutes)",
    )
    flag(
        p,
        "workers",
        type=positive_int,
        default=None,
        help="processes that measure the precisions side by side (default: one per CPU core, up to one per "
        "precision; 1: one after another)",
    )
    flag(
        p,
        "no_cache",
        action="store_true",
        help="measure every step afresh: by default a repeat plan of the same model (another --memory or "
        "--batch_size) reads the steps measured before from plan/ in $AMPKIT_CACHE_DIR (~/.cache/ampkit); "
        "AMPKIT_PLAN_CACHE=off turns that off too",
    )
    flag(p, "json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)
