"""Memory predictions for the brief's routes: what a run's precision saves over fp32, and which
precision and batch fit a GPU (``POST /finetuning/optimize-mixed-precision``).

``memory_savings_gb`` is ampkit's estimate (:func:`ampkit.plan.estimate.estimate`: one training
step on fake tensors) of fp32's peak minus the run's precision's peak for the run's model and
batch -- predicted, not measured, since a run trains in one precision. Estimates are cached.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from ..plan.estimate import PLAN_PRECISIONS
from ..step.precision import REFERENCE, REGISTRY
from .jobs import jobs as _jobs
from .schemas import OptimizeBody

__all__ = ["compute_plan", "peaks", "plan_answer", "plan_key", "savings_gb"]

GiB = 2**30
MAX_BATCH = 1 << 16  # the largest batch a plan reports
# the candidates for "mixed precision": bf16, fp16
_AUTOCAST = tuple(n for n in PLAN_PRECISIONS if REGISTRY[n].opt_level == "O1")


Overrides = tuple[
    tuple[str, Any], ...
]  # a config's overrides, hashable for the caches; never a joined string


def _text_model(model: str, overrides: Overrides, size: str) -> tuple[Callable[[], Any], int]:
    """``(factory, longest sequence)`` of a text model: a Hugging Face config, or the built-in GPT."""
    from ..models.builtin import build
    from ..models.hf_configs import build_hf, hf_config, is_hf, max_positions

    if is_hf(model):
        return functools.partial(build_hf, model, dict(overrides)), max_positions(
            hf_config(model, dict(overrides))
        )
    if model == "gpt":
        return functools.partial(build, model, size), build(model, size).config.block_size
    raise ValueError(
        f"memory predictions here are for text models (gpt, Hugging Face configs), not {model!r}"
    )


def _tokens(batch: int, length: int) -> tuple[Any, Any]:
    import torch

    x = torch.randint(0, 256, (batch, length))
    return x, x.clone()


def peaks(
    model: str,
    overrides: Overrides,
    size: str,
    batch: int,
    length: int,
    precisions: tuple[str, ...],
) -> dict[str, int]:
    """Predicted peak bytes per precision for a text model at ``batch`` x ``length`` tokens (the
    worker process runs this: :mod:`ampkit.service.jobs`)."""
    from ..plan.estimate import estimate

    factory, limit = _text_model(model, overrides, size)
    batch_tokens = _tokens(batch, min(length, limit))
    return {p: estimate(factory, batch_tokens, precision=p).peak_bytes for p in precisions}


def _overrides(d: dict[str, Any]) -> Overrides:
    """The overrides as they are, as a sorted tuple: what is estimated is what the request gave."""
    return tuple(sorted(d.items()))


def savings_gb(
    spec: dict[str, Any], precision: Optional[str], wait_s: float = 300.0
) -> Optional[float]:
    """Predicted fp32 peak minus ``precision``'s for a run's spec, in GiB; None when no estimate can
    be made (a model that is not a text model, ...; or none within ``wait_s``): that is no reason
    to refuse a run. The estimate runs in the worker process; this thread only waits."""
    if precision == REFERENCE:
        return 0.0
    try:
        length = spec.get("max_length") or 512
        texts = spec.get("texts")
        if texts:  # samples are padded to the longest text, up to max_length
            length = min(length, max(len(t.encode("utf-8")) for t in texts) - 1)
        batch = min(spec["batch_size"], len(texts)) if texts else spec["batch_size"]
        key = (
            spec["model"],
            _overrides(spec.get("model_overrides") or {}),
            spec.get("size", "small"),
            batch,
            max(1, length),
            ("fp32", precision),
        )
        got = _jobs().cached(("peaks", key))
        if (
            got is None
        ):  # worked out by the worker process; identical asks share the job, then the cache
            job = _jobs().wait(
                _jobs().submit("(server)", ("peaks", key), f"{__name__}:peaks", key), wait_s
            )
            got = (job["status"], job["result"] if job["status"] == "succeeded" else job["error"])
        if got[0] != "succeeded":
            return None
        peaks = got[1]
    except Exception:  # an estimate that cannot run is no reason to refuse the run
        return None
    return round((peaks["fp32"] - peaks[precision]) / GiB, 4) + 0.0  # (no -0.0)


def plan_key(body: OptimizeBody, max_params: Optional[int]) -> tuple[Any, ...]:
    """What a plan depends on: identical requests have the same key (and share the cached answer)."""
    return (
        "plan",
        body.model_name,
        _overrides(body.model_overrides),
        body.size,
        body.batch_size,
        body.max_length,
        body.memory_bytes(),
        body.device,
        max_params,
    )


def compute_plan(body: dict[str, Any], max_params: Optional[int]) -> dict[str, Any]:
    """The worker process's job for ``POST /finetuning/optimize-mixed-precision``: the size check
    (the route made it too; a job may come from another caller), then :func:`plan_answer`. A
    ValueError is the client's (a 422)."""
    from .deps import check_size

    b = OptimizeBody(**body)
    check_size(b.model_name, b.model_overrides, max_params)
    return plan_answer(b)


def _plan_rows(
    factory: Callable[[], Any], length: int, body: OptimizeBody, budget: int, stack: Any
) -> list[dict[str, Any]]:
    """Every precision's row (:func:`ampkit.plan.depth_plan.plan_on`, as ``ampkit plan``: for the
    body's device, by depth extrapolation for a stack of blocks, fp16 and fp16-pure as bf16's and
    bf16-pure's twins; else the full model measured; a precision the device cannot run refused),
    each with ``why_not`` where it fits no batch."""
    from ..plan.depth_plan import plan_groups, plan_on, why_not

    rows: dict[str, dict[str, Any]] = {}
    for group in plan_groups(PLAN_PRECISIONS, stack):
        found = plan_on(
            body.target(),
            factory,
            lambda b: _tokens(b, length),
            budget,
            group,
            body.batch_size,
            stack=stack,
            checkpointing=False,
            limit=MAX_BATCH,
        )
        for p, r in zip(group, found):
            rows[p] = (
                {
                    "precision": p,
                    "predicted_peak_gb": None,
                    "fits": False,
                    "max_batch_size": 0,
                    "method": "refused",
                    "why_not": r,
                }
                if isinstance(r, str)
                else {
                    "precision": p,
                    "predicted_peak_gb": round(r.peak_bytes / GiB, 3),
                    "fits": r.peak_bytes <= budget,
                    "max_batch_size": r.largest,
                    "method": r.method,
                    "why_not": why_not(r, budget),
                }
            )
    return [rows[p] for p in PLAN_PRECISIONS]


def _gb(n: int) -> float:
    return round(n / GiB, 3)


def plan_answer(body: OptimizeBody) -> dict[str, Any]:
    """``should_use_mixed_precision`` and, per precision, the predicted peak at ``batch_size`` and the
    largest batch that fits the budget (``B`` fits by the estimate, ``B + 1`` does not): on the
    body's ``device`` (:mod:`ampkit.plan.devices`), whose name the answer carries."""
    from ..plan.depth import stack_for
    from ..plan.devices import figures_for

    target = body.target()
    budget = body.budget_bytes()
    memory = body.memory_bytes()
    assert memory is not None  # budget_bytes() refused a plan without one
    overrides = _overrides(body.model_overrides)
    factory, limit = _text_model(body.model_name, overrides, body.size)
    stack = stack_for(body.model_name, body.size, dict(overrides))
    rows = _plan_rows(factory, min(body.max_length, limit), body, budget, stack)
    fp32 = rows[0]
    halves = [r for r in rows if r["precision"] in _AUTOCAST and r["method"] != "refused"]
    best_half = max(halves, key=lambda r: r["max_batch_size"]) if halves else None
    use = best_half is not None and (
        (not fp32["fits"] and best_half["fits"])
        or best_half["max_batch_size"] > fp32["max_batch_size"]
    )
    shown_gb = body.gpu_memory_gb if body.gpu_memory_gb is not None else _gb(memory)
    device, device_name = figures_for(target)
    room = (
        f"the {_gb(budget):g} GB budget of {shown_gb:g} GB"
        if target is not None
        else f"{shown_gb:g} GB"
    )
    reason = (
        f"{best_half['precision']} fits batch {best_half['max_batch_size']} in {room} vs "
        f"fp32's {fp32['max_batch_size']}; its peak at batch {body.batch_size} is "
        f"{best_half['predicted_peak_gb']:.2f} GB vs {fp32['predicted_peak_gb']:.2f} GB"
        if best_half is not None
        else f"the {device_name} runs neither of {', '.join(_AUTOCAST)}"
    )
    kernels = (
        f"for the {device_name} ({device}) from this server: its caching allocator's blocks, cuBLAS "
        "workspaces and fused attention; the budget is its memory less the CUDA context and "
        "fragmentation"
        if target is not None
        else f"with this server's kernels ({device_name})"
    )
    return {
        "model_name": body.model_name,
        "device": device,
        "device_name": device_name,
        "gpu_memory_gb": shown_gb,
        "budget_gb": _gb(budget) if target is not None else shown_gb,
        "batch_size": body.batch_size,
        "should_use_mixed_precision": bool(use),
        "reason": reason,
        "recommended_precision": best_half["precision"] if use and best_half else "fp32",
        "recommendations": rows,
        "note": "predicted by ampkit.plan.estimate.estimate (a training step on fake tensors, AdamW; "
        "rows with method 'depth': extrapolated from 1- and 2-block copies of the model, "
        f"ampkit.plan.depth) {kernels}",
    }
