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
        float(body.gpu_memory_gb),
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
    """Every precision's row (:func:`ampkit.plan.depth_plan.plan_precisions`, as ``ampkit plan``: by depth
    extrapolation for a stack of blocks, fp16 and fp16-pure as bf16's and bf16-pure's twins; else
    the full model measured)."""
    from ..plan.depth_plan import plan_groups, plan_precisions

    rows: dict[str, dict[str, Any]] = {}
    for group in plan_groups(PLAN_PRECISIONS, stack):
        found = plan_precisions(
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
            rows[p] = {
                "precision": p,
                "predicted_peak_gb": round(r.peak_bytes / GiB, 3),
                "fits": r.peak_bytes <= budget,
                "max_batch_size": r.largest,
                "method": r.method,
            }
    return [rows[p] for p in PLAN_PRECISIONS]


def plan_answer(body: OptimizeBody) -> dict[str, Any]:
    """``should_use_mixed_precision`` and, per precision, the predicted peak at ``batch_size`` and the
    largest batch that fits ``gpu_memory_gb`` (``B`` fits by the estimate, ``B + 1`` does not)."""
    budget = int(body.gpu_memory_gb * GiB)
    overrides = _overrides(body.model_overrides)
    factory, limit = _text_model(body.model_name, overrides, body.size)
    from ..plan.depth import stack_for

    stack = stack_for(body.model_name, body.size, dict(overrides))
    rows = _plan_rows(factory, min(body.max_length, limit), body, budget, stack)
    fp32 = rows[0]
    best_half = max(
        (r for r in rows if r["precision"] in _AUTOCAST), key=lambda r: r["max_batch_size"]
    )
    use = (not fp32["fits"] and best_half["fits"]) or best_half["max_batch_size"] > fp32[
        "max_batch_size"
    ]
    reason = (
        f"{best_half['precision']} fits batch {best_half['max_batch_size']} in {body.gpu_memory_gb:g} GB vs "
        f"fp32's {fp32['max_batch_size']}; its peak at batch {body.batch_size} is "
        f"{best_half['predicted_peak_gb']:.2f} GB vs {fp32['predicted_peak_gb']:.2f} GB"
    )
    return {
        "model_name": body.model_name,
        "gpu_memory_gb": body.gpu_memory_gb,
        "batch_size": body.batch_size,
        "should_use_mixed_precision": bool(use),
        "reason": reason,
        "recommended_precision": best_half["precision"] if use else "fp32",
        "recommendations": rows,
        "note": "predicted by ampkit.plan.estimate.estimate (a training step on fake tensors, AdamW; rows with "
        "method 'depth': extrapolated from 1- and 2-block copies of the model, ampkit.plan.depth) "
        "with this server's kernels",
    }
