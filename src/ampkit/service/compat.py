"""The fine-tuning brief's routes (``../shared/SERVICE-API.md``), mapped onto ampkit's own.

* ``POST /finetuning/setup-mixed-precision``: resolves and stores the owner's precision and scaler
  settings (later runs without their own ``mixed_precision_config`` use them).
* ``GET /finetuning/mixed-precision-stats[?run_id=]``: ``enabled``, ``scaler_scale``,
  ``memory_savings_gb``, ``overflow_count``, ``underflow_count`` of a run (default: the owner's
  latest), read from its log.
* ``POST /finetuning/mixed-precision`` and ``POST /finetuning/optimized``: a training run
  (``/v1/runs``) of the model on the given texts (bytes as tokens); ``GET /finetuning/runs/{id}``
  (or ``/v1/runs/{id}``) gives ``model_path``, ``scaler_scale`` and ``memory_savings_gb`` when done.
* ``POST /finetuning/optimize-mixed-precision``: answered by the memory planner.

``memory_savings_gb`` is ampkit's estimate (:func:`ampkit.loop.estimate.estimate`: one training step on
fake tensors) of fp32's peak minus the run's precision's peak for the run's model and batch --
predicted, not measured, since a run trains in one precision. ``underflow_count`` counts the
logged steps whose gradient norm was exactly zero (all gradient signal lost to underflow).
Bodies follow the brief: unknown fields are ignored, missing optional ones defaulted.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Literal, Optional, Union

from fastapi import Depends, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..step.config import MixedPrecisionConfig
from ..step.precision import parse_precision, resolve_precision

__all__ = ["add_routes"]

GiB = 2**30
PLAN_PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure", "fp16-pure")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class MixedPrecisionBody(_Body):
    enabled: bool = True
    dtype: str = "float16"
    init_scale: Optional[float] = Field(65536.0, gt=0)
    memory_efficient: bool = False  # -> activation checkpointing

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        parse_precision(v)  # lists the valid names
        return v


class SetupBody(MixedPrecisionBody):
    model_name: str = "gpt2"
    model_overrides: dict[str, Union[bool, int, float, str, None]] = Field(default_factory=dict)


class DatasetConfig(_Body):
    texts: list[str] = Field(min_length=1)
    max_length: int = Field(512, ge=2, le=8192)


class TrainingConfig(_Body):
    epochs: int = Field(1, ge=1, le=100_000)
    learning_rate: float = Field(5e-5, gt=0, le=10)
    batch_size: int = Field(8, ge=1, le=65_536)


class TrainBody(_Body):
    model_name: str = "gpt2"
    model_overrides: dict[str, Union[bool, int, float, str, None]] = Field(default_factory=dict)
    dataset_config: DatasetConfig
    training_config: TrainingConfig = Field(default_factory=TrainingConfig)
    user_id: Optional[Union[int, str]] = None
    mixed_precision_config: Optional[MixedPrecisionBody] = None
    device: str = "cpu"
    max_seconds: Optional[float] = Field(None, gt=0)


class OptimizedBody(TrainBody):
    use_mixed_precision: bool = True
    use_gradient_accumulation: bool = True
    target_effective_batch_size: int = Field(64, ge=1, le=1_000_000)


class OptimizeBody(_Body):
    model_name: str = "gpt2"
    model_overrides: dict[str, Union[bool, int, float, str, None]] = Field(default_factory=dict)
    size: Literal["tiny", "small", "medium", "large"] = "small"  # for model_name "gpt"
    gpu_memory_gb: float = Field(gt=0, le=1_000_000)
    batch_size: int = Field(16, ge=1, le=65_536)
    max_length: int = Field(512, ge=2, le=8192)


def _precision(mp: MixedPrecisionBody, device: str) -> str:
    """The precision a body asks for, checked against the device (422 with the reason)."""
    name = "fp32" if not mp.enabled else parse_precision(mp.dtype)
    return resolve_precision(name, device).name


def _mixed_for(device: str) -> tuple[str, str]:
    """``use_mixed_precision: true``: ``auto``'s hardware pick, or bf16 autocast where ``auto`` would
    stay in fp32 (the user asked for mixed precision; the reason says what it costs here)."""
    p = resolve_precision("auto", device)
    if p.name != "fp32":
        return p.name, p.reason
    q = resolve_precision("bf16", device)
    return q.name, f"mixed precision requested; {q.reason}"


def _text_model(model: str, overrides: str, size: str) -> tuple[Callable[[], Any], int]:
    """``(factory, longest sequence)`` of a text model: a Hugging Face config, or the built-in GPT."""
    from ..loop.hf import build_hf, hf_config, is_hf, max_positions, parse_overrides
    from ..loop.models import build

    if is_hf(model):
        return (functools.partial(build_hf, model, parse_overrides(overrides)),
                max_positions(hf_config(model, parse_overrides(overrides))))
    if model == "gpt":
        return functools.partial(build, model, size), build(model, size).config.block_size
    raise ValueError(f"memory predictions here are for text models (gpt, Hugging Face configs), not {model!r}")


def _tokens(batch: int, length: int) -> tuple[Any, Any]:
    import torch

    x = torch.randint(0, 256, (batch, length))
    return x, x.clone()


@functools.lru_cache(maxsize=256)
def _peaks(model: str, overrides: str, size: str, batch: int, length: int, precisions: tuple[str, ...]) -> dict[str, int]:
    """Predicted peak bytes per precision for a text model at ``batch`` x ``length`` tokens (cached)."""
    from ..loop.estimate import estimate

    factory, limit = _text_model(model, overrides, size)
    batch_tokens = _tokens(batch, min(length, limit))
    return {p: estimate(factory, batch_tokens, precision=p).peak_bytes for p in precisions}


@functools.lru_cache(maxsize=256)
def _largest(model: str, overrides: str, size: str, length: int, budget: int, precision: str) -> int:
    """The largest batch whose predicted peak fits ``budget`` (:func:`ampkit.loop.estimate.largest_batch`; cached)."""
    from ..loop.estimate import largest_batch

    factory, limit = _text_model(model, overrides, size)
    return largest_batch(factory, lambda b: _tokens(b, min(length, limit)), budget, precision)[0]


def _overrides(d: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(d.items()))


def add_routes(app: FastAPI, owner: Callable[..., str], submit: Callable[..., dict[str, Any]],
               mine: Callable[[str, str], dict[str, Any]], view: Callable[[dict[str, Any]], dict[str, Any]],
               log_records: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> None:
    """Register the compatibility routes on ``app`` (``owner``, ``submit``, ``mine``, ``view`` and
    ``log_records`` are the service's own helpers)."""
    store = app.state.store

    def savings_gb(spec: dict[str, Any], precision: str) -> Optional[float]:
        if precision == "fp32":
            return 0.0
        try:
            length = spec.get("max_length") or 512
            texts = spec.get("texts")
            if texts:  # samples are padded to the longest text, up to max_length
                length = min(length, max(len(t.encode("utf-8")) for t in texts) - 1)
            batch = min(spec["batch_size"], len(texts)) if texts else spec["batch_size"]
            peaks = _peaks(spec["model"], _overrides(spec.get("model_overrides") or {}), spec.get("size", "small"),
                           batch, max(1, length), ("fp32", precision))
        except Exception:  # an estimate that cannot run is no reason to refuse the run
            return None
        return round((peaks["fp32"] - peaks[precision]) / GiB, 4) + 0.0  # (no -0.0)

    def train_spec(body: TrainBody, precision: str, init_scale: Optional[float], ckpt: bool,
                   batch: int, **extra: Any) -> dict[str, Any]:
        spec = {"model": body.model_name, "model_overrides": body.model_overrides, "precision": precision,
                "texts": body.dataset_config.texts, "max_length": body.dataset_config.max_length,
                "epochs": body.training_config.epochs, "lr": body.training_config.learning_rate,
                "batch_size": batch, "init_scale": init_scale, "activation_checkpointing": ckpt,
                "save_model": True, "user_id": body.user_id, "device": body.device,
                "max_seconds": body.max_seconds, **extra}
        from .app import RunSpec

        try:
            return RunSpec(**spec).model_dump()
        except ValueError as e:
            raise HTTPException(422, str(e)) from None

    def resolved(mp: MixedPrecisionBody, device: str = "cpu") -> dict[str, Any]:
        try:
            name = _precision(mp, device)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        p = resolve_precision(name, device)
        defaults = MixedPrecisionConfig()
        return {"enabled": name != "fp32", "precision": name, "dtype": str(p.compute_dtype).replace("torch.", ""),
                "reason": p.reason, "memory_efficient": mp.memory_efficient,
                "activation_checkpointing": mp.memory_efficient,
                "scaler": {"enabled": p.needs_scaler, "init_scale": mp.init_scale if p.needs_scaler else None,
                           "growth_factor": defaults.growth_factor, "backoff_factor": defaults.backoff_factor,
                           "growth_interval": defaults.growth_interval, "hysteresis": defaults.hysteresis,
                           "min_scale": defaults.min_scale, "max_scale": defaults.max_scale}}

    @app.post("/finetuning/setup-mixed-precision")
    def setup(body: SetupBody, who: str = Depends(owner)) -> dict[str, Any]:
        out = {"model_name": body.model_name, **resolved(body)}
        store.put_setting(who, "mixed_precision", {**body.model_dump(), "resolved": out})
        return out

    @app.post("/finetuning/mixed-precision", status_code=201)
    def mixed_precision(body: TrainBody, who: str = Depends(owner)) -> dict[str, Any]:
        mp = body.mixed_precision_config
        if mp is None:
            saved = store.get_setting(who, "mixed_precision")
            mp = MixedPrecisionBody(**saved) if saved else MixedPrecisionBody()
        cfg = resolved(mp, body.device)
        batch = min(body.training_config.batch_size, len(body.dataset_config.texts))
        spec = train_spec(body, cfg["precision"], cfg["scaler"]["init_scale"], mp.memory_efficient, batch)
        run = submit(who, "train", spec)
        # The predicted saving is answered with the run's result (GET /finetuning/runs/{id}); worked
        # out now in the background, so that this answer does not wait for the estimate.
        threading.Thread(target=savings_gb, args=(spec, cfg["precision"]), daemon=True).start()
        return {**view(run), "run_id": run["id"], "mixed_precision": cfg, "memory_savings_gb": None,
                "scaler_scale": cfg["scaler"]["init_scale"], "result": f"/finetuning/runs/{run['id']}"}

    @app.post("/finetuning/optimized", status_code=201)
    def optimized(body: OptimizedBody, who: str = Depends(owner)) -> dict[str, Any]:
        if body.use_mixed_precision:
            try:
                precision, reason = _mixed_for(body.device)
            except ValueError as e:
                raise HTTPException(422, str(e)) from None
        else:
            precision, reason = "fp32", "use_mixed_precision is false"
        batch = min(body.training_config.batch_size, len(body.dataset_config.texts))
        target = body.target_effective_batch_size if body.use_gradient_accumulation else None
        if target:  # the largest micro-batch <= batch that divides the target (as `ampkit train` does)
            batch = max(b for b in range(1, min(batch, target) + 1) if target % b == 0)
        accumulation = target // batch if target else 1
        spec = train_spec(body, precision, None, False, batch, accumulation_steps=accumulation)
        run = submit(who, "train", spec)
        return {**view(run), "run_id": run["id"], "precision": precision, "reason": reason,
                "mixed_precision_enabled": precision != "fp32", "gradient_accumulation_enabled": accumulation > 1,
                "batch_size": batch, "accumulation_steps": accumulation, "effective_batch_size": batch * accumulation,
                "memory_savings_gb": savings_gb(spec, precision)}

    @app.get("/finetuning/runs/{run_id}")
    def result(run_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        run = mine(run_id, who)
        out = view(run)
        precision = (run.get("summary") or {}).get("precision") or run["spec"]["precision"]  # after any fallback
        out["memory_savings_gb"] = savings_gb(run["spec"], precision) if run["kind"] == "train" else None
        return out

    @app.get("/finetuning/mixed-precision-stats")
    def stats(run_id: Optional[str] = None, who: str = Depends(owner)) -> dict[str, Any]:
        if run_id is None:
            latest = store.list(owner=who, limit=1_000)
            run = next((r for r in latest if r["kind"] == "train"), None)
        else:
            run = mine(run_id, who)
        if run is None:  # no run yet: the settings, nothing counted
            saved = (store.get_setting(who, "mixed_precision") or {}).get("resolved")
            return {"run_id": None, "enabled": bool(saved and saved["enabled"]),
                    "scaler_scale": saved["scaler"]["init_scale"] if saved else None, "memory_savings_gb": None,
                    "overflow_count": 0, "underflow_count": 0, "status": None}
        records = log_records(run)
        steps = [r for r in records if r.get("type") == "step"]
        summary = run.get("summary") or {}
        precision = summary.get("precision") or (steps[-1]["precision"] if steps else run["spec"]["precision"])
        scale = summary.get("final_scale") if summary else (steps[-1].get("scale") if steps else None)
        return {"run_id": run["id"], "status": run["status"], "precision": precision,
                "enabled": precision not in ("fp32", "tf32", "auto"),
                "scaler_scale": scale, "memory_savings_gb": savings_gb(run["spec"], precision),
                "overflow_count": sum(1 for r in records if r.get("type") == "event" and r.get("kind") == "overflow"),
                "underflow_count": sum(1 for r in steps if r.get("grad_norm") == 0.0),
                "skipped_steps": summary.get("skipped_steps", sum(1 for r in steps if r.get("skipped"))),
                "logged_steps": len(steps)}

    @app.post("/finetuning/optimize-mixed-precision")
    def optimize(body: OptimizeBody, who: str = Depends(owner)) -> dict[str, Any]:
        from .app import allowed_model, check_size

        try:
            allowed_model(body.model_name, ())
            check_size(body.model_name, body.model_overrides, app.state.config.max_params)
            return plan_answer(body)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None


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
    half = [r for r in rows[1:] if r["precision"] in ("bf16", "fp16")]
    best_half = max(half, key=lambda r: r["max_batch_size"])
    use = (not fp32["fits"] and best_half["fits"]) or best_half["max_batch_size"] > fp32["max_batch_size"]
    reason = (f"{best_half['precision']} fits batch {best_half['max_batch_size']} in {body.gpu_memory_gb:g} GB vs "
              f"fp32's {fp32['max_batch_size']}; its peak at batch {body.batch_size} is "
              f"{best_half['predicted_peak_gb']:.2f} GB vs {fp32['predicted_peak_gb']:.2f} GB")
    return {"model_name": body.model_name, "gpu_memory_gb": body.gpu_memory_gb, "batch_size": body.batch_size,
            "should_use_mixed_precision": bool(use), "reason": reason,
            "recommended_precision": best_half["precision"] if use else "fp32", "recommendations": rows,
            "note": "predicted by ampkit.loop.estimate.estimate (a training step on fake tensors, AdamW) "
                    "with this server's kernels"}

