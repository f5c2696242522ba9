"""Memory predictions for the brief's routes: what a run's precision saves over fp32, and which
precision and batch fit a GPU (``POST /finetuning/optimize-mixed-precision``).

``memory_savings_gb`` is ampkit's estimate (:func:`ampkit.loop.estimate.estimate`: one training
step on fake tensors) of fp32's peak minus the run's precision's peak for the run's model and
batch -- predicted, not measured, since a run trains in one precision. Estimates are cached.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

from ..loop.estimate import PLAN_PRECISIONS
from .schemas import OptimizeBody

__all__ = ["plan_answer", "savings_gb"]

GiB = 2**30
_AUTOCAST = PLAN_PRECISIONS[1:3]  # the candidates for "mixed precision"


Overrides = tuple[tuple[str, Any], ...]  # a config's overrides, hashable for the caches; never a joined string


def _text_model(model: str, overrides: Overrides, size: str) -> tuple[Callable[[], Any], int]:
    """``(factory, longest sequence)`` of a text model: a Hugging Face config, or the built-in GPT."""
    from ..loop.hf import build_hf, hf_config, is_hf, max_positions
    from ..loop.models import build

    if is_hf(model):
        return functools.partial(build_hf, model, dict(overrides)), max_positions(hf_config(model, dict(overrides)))
    if model == "gpt":
        return functools.partial(build, model, size), build(model, size).config.block_size
    raise ValueError(f"memory predictions here are for text models (gpt, Hugging Face configs), not {model!r}")


def _tokens(batch: int, length: int) -> tuple[Any, Any]:
    import torch

    x = torch.randint(0, 256, (batch, length))
    return x, x.clone()


@functools.lru_cache(maxsize=256)
def _peaks(model: str, overrides: Overrides, size: str, batch: int, length: int, precisions: tuple[str, ...]) -> dict[str, int]:
    """Predicted peak bytes per precision for a text model at ``batch`` x ``length`` tokens (cached)."""
    from ..loop.estimate import estimate

    factory, limit = _text_model(model, overrides, size)
    batch_tokens = _tokens(batch, min(length, limit))
    return {p: estimate(factory, batch_tokens, precision=p).peak_bytes for p in precisions}


@functools.lru_cache(maxsize=256)
def _largest(model: str, overrides: Overrides, size: str, length: int, budget: int, precision: str) -> int:
    """The largest batch whose predicted peak fits ``budget`` (:func:`ampkit.loop.estimate.largest_batch`; cached)."""
    from ..loop.estimate import largest_batch

    factory, limit = _text_model(model, overrides, size)
    return largest_batch(factory, lambda b: _tokens(b, min(length, limit)), budget, precision)[0]


def _overrides(d: dict[str, Any]) -> Overrides:
    """The overrides as they are, as a sorted tuple: what is estimated is what the request gave."""
    return tuple(sorted(d.items()))


_LOCKS: dict[tuple[Any, ...], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _one_at_a_time(key: tuple[Any, ...]) -> threading.Lock:
    """One lock per estimate: the background estimate started at submit and the result route asking
    for the same numbers compute them once (``_peaks`` caches; the lock makes the second caller wait)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(key, threading.Lock())


def savings_gb(spec: dict[str, Any], precision: Optional[str]) -> Optional[float]:
    """Predicted fp32 peak minus ``precision``'s for a run's spec, in GiB; None when no estimate can
    be made (a model that is not a text model, ...): that is no reason to refuse a run."""
    if precision == "fp32":
        return 0.0
    try:
        length = spec.get("max_length") or 512
        texts = spec.get("texts")
        if texts:  # samples are padded to the longest text, up to max_length
            length = min(length, max(len(t.encode("utf-8")) for t in texts) - 1)
        batch = min(spec["batch_size"], len(texts)) if texts else spec["batch_size"]
        key = (spec["model"], _overrides(spec.get("model_overrides") or {}), spec.get("size", "small"),
               batch, max(1, length), ("fp32", precision))
        with _one_at_a_time(key):  # a second asker waits for the first's estimate, then reads the cache
            peaks = _peaks(*key)
    except Exception:  # an estimate that cannot run is no reason to refuse the run
        return None
    return round((peaks["fp32"] - peaks[precision]) / GiB, 4) + 0.0  # (no -0.0)


def plan_answer(body: OptimizeBody) -> dict[str, Any]:
    """``should_use_mixed_precision`` and, per precision, the predicted peak at ``batch_size`` and the
    largest batch that fits ``gpu_memory_gb`` (``B`` fits by the estimate, ``B + 1`` does not)."""
    budget = int(body.gpu_memory_gb * GiB)
    overrides = _overrides(body.model_overrides)
    rows = []
    for p in PLAN_PRECISIONS:
        at = _peaks(body.model_name, overrides, body.size, body.batch_size, body.max_length, (p,))[p]
        rows.append({"precision": p, "predicted_peak_gb": round(at / GiB, 3), "fits": at <= budget,
                     "max_batch_size": _largest(body.model_name, overrides, body.size, body.max_length, budget, p)})
    fp32 = rows[0]
    best_half = max((r for r in rows if r["precision"] in _AUTOCAST), key=lambda r: r["max_batch_size"])
    use = (not fp32["fits"] and best_half["fits"]) or best_half["max_batch_size"] > fp32["max_batch_size"]
    reason = (f"{best_half['precision']} fits batch {best_half['max_batch_size']} in {body.gpu_memory_gb:g} GB vs "
              f"fp32's {fp32['max_batch_size']}; its peak at batch {body.batch_size} is "
              f"{best_half['predicted_peak_gb']:.2f} GB vs {fp32['predicted_peak_gb']:.2f} GB")
    return {"model_name": body.model_name, "gpu_memory_gb": body.gpu_memory_gb, "batch_size": body.batch_size,
            "should_use_mixed_precision": bool(use), "reason": reason,
            "recommended_precision": best_half["precision"] if use else "fp32", "recommendations": rows,
            "note": "predicted by ampkit.loop.estimate.estimate (a training step on fake tensors, AdamW) "
                    "with this server's kernels"}
