"""The fine-tuning brief's routes (``../shared/SERVICE-API.md``), mapped onto ampkit's own.

* ``POST /finetuning/setup-mixed-precision``: resolves and stores the owner's precision and scaler
  settings (later runs without their own ``mixed_precision_config`` use them).
* ``GET /finetuning/mixed-precision-stats[?run_id=]``: ``enabled``, ``scaler_scale``,
  ``memory_savings_gb``, ``overflow_count``, ``underflow_count`` of a run (default: the owner's
  latest), read from its log.
* ``POST /finetuning/mixed-precision`` and ``POST /finetuning/optimized``: a training run
  (``/v1/runs``) of the model on the given texts (bytes as tokens); ``GET /finetuning/runs/{id}``
  (or ``/v1/runs/{id}``) gives ``model_path``, ``scaler_scale`` and ``memory_savings_gb`` when done.
* ``POST /finetuning/optimize-mixed-precision``: answered by the memory planner (``..planner``).

``underflow_count`` counts the logged steps whose gradient norm was exactly zero (all gradient
signal lost to underflow). Bodies follow the brief: unknown fields are ignored, missing optional
ones defaulted.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Optional

import torch
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import JSONResponse

from ...models.hf_configs import is_hf
from ...step.config import MixedPrecisionConfig
from ...step.precision import REFERENCE, Precision, resolve_precision
from ..checks import check_overrides
from ..deps import (
    OwnedRun,
    Owner,
    Svc,
    allowed_model,
    check_size,
    each_query_once,
    lookup,
    submit,
)
from ..jobs import jobs
from ..limits import limit
from ..planner import compute_plan, plan_key, savings_gb
from ..runner import read_log
from ..schemas import (
    MixedPrecisionBody,
    OptimizeBody,
    OptimizedBody,
    RunSpec,
    SetupBody,
    TrainBody,
    run_view,
)

__all__ = ["router"]

router = APIRouter(prefix="/finetuning", dependencies=[Depends(each_query_once)])


def _resolve(name: str, device: str) -> Precision:
    """``name`` resolved on ``device``; a precision the device cannot run is a 422 with the reason."""
    try:
        return resolve_precision(name, device)
    except ValueError as e:
        raise HTTPException(422, str(e)) from None


def _settings(mp: MixedPrecisionBody, device: str = "cpu") -> dict[str, Any]:
    """The precision and scaler settings a body asks for, resolved on ``device``."""
    p = _resolve(mp.dtype if mp.enabled else "fp32", device)
    defaults = MixedPrecisionConfig()
    return {
        "enabled": p.compute_dtype != torch.float32,
        "precision": p.name,
        "dtype": str(p.compute_dtype).replace("torch.", ""),
        "reason": p.reason,
        "memory_efficient": mp.memory_efficient,
        "activation_checkpointing": mp.memory_efficient,
        "scaler": {
            "enabled": p.needs_scaler,
            "init_scale": mp.init_scale if p.needs_scaler else None,
            "growth_factor": defaults.growth_factor,
            "backoff_factor": defaults.backoff_factor,
            "growth_interval": defaults.growth_interval,
            "hysteresis": defaults.hysteresis,
            "min_scale": defaults.min_scale,
            "max_scale": defaults.max_scale,
        },
    }


def _mixed_for(device: str) -> Precision:
    """``use_mixed_precision: true``: ``auto``'s hardware pick, or bf16 autocast where ``auto`` would
    stay in fp32 (the user asked for mixed precision; the reason says what it costs here)."""
    p = _resolve("auto", device)
    if p.compute_dtype != torch.float32:
        return p
    q = _resolve("bf16", device)
    return dataclasses.replace(q, reason=f"mixed precision requested; {q.reason}")


def _is_mixed(name: Optional[str], device: str) -> bool:
    """Does ``name`` compute in less than fp32 on ``device`` (False when it cannot run there)? The
    brief's ``enabled``, the same rule as setup's: tf32 computes fp32 matmuls, so it is not mixed."""
    try:
        return (
            resolve_precision(name or "fp32", device, emulate_fp8=True).compute_dtype
            != torch.float32
        )
    except (ValueError, RuntimeError):
        return False


def _run_spec(
    body: TrainBody,
    precision: str,
    init_scale: Optional[float],
    ckpt: bool,
    batch: int,
    **extra: Any,
) -> dict[str, Any]:
    """The body as a RunSpec (checked like ``POST /v1/runs``; 422 with its message)."""
    try:
        return RunSpec(
            model=body.model_name,
            model_overrides=body.model_overrides,
            precision=precision,
            texts=body.dataset_config.texts,
            max_length=body.dataset_config.max_length,
            lr=body.training_config.learning_rate,
            batch_size=batch,
            init_scale=init_scale,
            activation_checkpointing=ckpt,
            save_model=True,
            user_id=body.user_id,
            device=body.device,
            max_seconds=body.max_seconds,
            **{"epochs": body.training_config.epochs, **_weight_decay(body), **extra},
        ).model_dump()
    except ValueError as e:
        raise HTTPException(422, str(e)) from None


def _weight_decay(body: TrainBody) -> dict[str, Any]:
    """``training_config.weight_decay`` for the run's optimizer, once the schemas carry it (a
    ``TrainingConfig`` and ``RunSpec`` field, and ``ampkit train --weight_decay``)."""
    wd = getattr(body.training_config, "weight_decay", None)
    return {} if wd is None else {"weight_decay": wd}


@router.post("/setup-mixed-precision")
def setup(body: SetupBody, who: Owner, svc: Svc) -> dict[str, Any]:
    """Resolves the precision on the server's CPU and stores the settings for this owner (later
    `mixed-precision` runs without their own `mixed_precision_config` use them). Answer:
    `model_name`, `enabled`, `precision`, `dtype`, `reason`, `memory_efficient`,
    `activation_checkpointing`, `scaler` (`enabled`, `init_scale`, `growth_factor`,
    `backoff_factor`, `growth_interval`, `hysteresis`, `min_scale`, `max_scale`), `ignored_fields`
    (the body's fields this route does not have, each with the closest one)."""
    out = {"model_name": body.model_name, **_settings(body)}
    svc.store.put_setting(who, "mixed_precision", {**body.model_dump(), "resolved": out})
    return {**out, "ignored_fields": body.ignored_fields()}


@router.post("/mixed-precision", status_code=201)
def mixed_precision(body: TrainBody, who: Owner, svc: Svc) -> dict[str, Any]:
    """Starts a training run (`POST /v1/runs`) with `save_model` on; the batch is `batch_size`
    capped at the number of texts. Answer at once: the run object plus `run_id`,
    `mixed_precision` (the setup answer's fields), `memory_savings_gb` (null now), `scaler_scale`
    (the initial scale), `result` (`/finetuning/runs/{id}`), `ignored_fields` (as `setup`'s)."""
    mp = body.mixed_precision_config
    if mp is None:
        saved = svc.store.get_setting(who, "mixed_precision")
        mp = MixedPrecisionBody(**saved) if saved else MixedPrecisionBody()
    cfg = _settings(mp, body.device)
    batch = min(body.training_config.batch_size, len(body.dataset_config.texts))
    spec = _run_spec(
        body, cfg["precision"], cfg["scaler"]["init_scale"], mp.memory_efficient, batch
    )
    run = submit(svc, who, "train", spec)
    # The predicted saving is answered with the run's result (GET /finetuning/runs/{id}); worked
    # out now in the background (it is cached), so that this answer does not wait for the estimate.
    threading.Thread(target=savings_gb, args=(spec, cfg["precision"]), daemon=True).start()
    return {
        **run_view(run),
        "run_id": run["id"],
        "mixed_precision": cfg,
        "memory_savings_gb": None,
        "scaler_scale": cfg["scaler"]["init_scale"],
        "result": f"/finetuning/runs/{run['id']}",
        "ignored_fields": body.ignored_fields(),
    }


@router.post("/optimized", status_code=201)
def optimized(body: OptimizedBody, who: Owner, svc: Svc) -> dict[str, Any]:
    """A training run as `mixed-precision`, its precision and accumulation chosen here; as many
    optimizer steps as `ampkit train --epochs` would take, but never fewer than every text
    `epochs` times. Answer: the run object plus `run_id`, `precision`, `reason`,
    `mixed_precision_enabled`, `gradient_accumulation_enabled`, `batch_size`,
    `accumulation_steps`, `effective_batch_size`, `optimizer_steps`, `epochs`, `data_passes`,
    `memory_savings_gb` (when the estimate is ready within a second, else null), `ignored_fields`
    (as `setup`'s)."""
    if body.use_mixed_precision:
        p = _mixed_for(body.device)
        precision, reason = p.name, p.reason
    else:
        precision, reason = "fp32", "use_mixed_precision is false"
    batch = min(body.training_config.batch_size, len(body.dataset_config.texts))
    target = body.target_effective_batch_size if body.use_gradient_accumulation else None
    if target:  # the largest micro-batch <= batch that divides the target (as `ampkit train` does)
        batch = max(b for b in range(1, min(batch, target) + 1) if target % b == 0)
    accumulation = target // batch if target else 1
    steps, passes = _steps_for_epochs(
        len(body.dataset_config.texts), batch, accumulation, body.training_config.epochs
    )
    spec = _run_spec(
        body,
        precision,
        None,
        False,
        batch,
        accumulation_steps=accumulation,
        steps=steps,
        epochs=None,
    )
    run = submit(svc, who, "train", spec)
    # the predicted saving, if the worker has it within a second; else with the result (GET /finetuning/runs/{id})
    return {
        **run_view(run),
        "run_id": run["id"],
        "precision": precision,
        "reason": reason,
        "mixed_precision_enabled": precision != REFERENCE,
        "gradient_accumulation_enabled": accumulation > 1,
        "batch_size": batch,
        "accumulation_steps": accumulation,
        "effective_batch_size": batch * accumulation,
        "optimizer_steps": steps,
        "epochs": body.training_config.epochs,
        "data_passes": passes,
        "memory_savings_gb": savings_gb(spec, precision, wait_s=1.0),
        "ignored_fields": body.ignored_fields(),
    }


def _steps_for_epochs(
    samples: int, batch: int, accumulation: int, epochs: int
) -> tuple[int, float]:
    """Optimizer steps for ``epochs`` passes over ``samples`` texts, and the passes they make. As
    ``ampkit train --epochs`` counts them (whole batches per epoch, then whole optimizer steps), but
    never fewer than every text ``epochs`` times: an effective batch larger than the data (64 of 2
    texts) still trains ``epochs`` passes or more, in as few steps as hold them, and says how many."""
    effective = batch * accumulation
    per_epoch = -(-samples // batch)
    steps = max(1, epochs * per_epoch // accumulation, -(-epochs * samples // effective))
    return steps, round(steps * effective / samples, 3)


@router.get("/runs/{run_id}")
def result(run: OwnedRun) -> dict[str, Any]:
    """The run object plus `memory_savings_gb` (predicted: fp32's estimated peak minus the run's
    precision's, in GiB; null when the estimate cannot run)."""
    out = run_view(run)
    precision = (run.get("summary") or {}).get("precision") or run["spec"].get(
        "precision"
    )  # after any fallback
    out["memory_savings_gb"] = (
        savings_gb(run["spec"], precision) if run["kind"] == "train" else None
    )
    return out


@router.get("/mixed-precision-stats")
def stats(
    who: Owner,
    svc: Svc,
    run_id: Optional[str] = Query(None, description="default: this owner's latest training run"),
) -> dict[str, Any]:
    """`run_id`, `status`, `precision`, `enabled`, `scaler_scale`, `memory_savings_gb`,
    `overflow_count` (overflow events), `underflow_count` (logged steps whose gradient norm was
    exactly 0), `skipped_steps`, `logged_steps`. With no run yet: `run_id` null, the stored
    setup's `enabled` and `scaler_scale`, zero counts. A `recommend` run's id is a 422."""
    if run_id is None:
        run = next(
            (r for r in svc.store.list(owner=who, limit=1_000) if r["kind"] == "train"), None
        )
    else:
        run = lookup(svc, run_id, who)
        if run["kind"] != "train":
            raise HTTPException(
                422,
                f"run {run_id!r} is a {run['kind']} run: these stats are a training run's "
                f"(its answer, GET /v1/runs/{run_id}, has the measurements)",
            )
    if run is None:  # no run yet: the settings, nothing counted
        saved = (svc.store.get_setting(who, "mixed_precision") or {}).get("resolved")
        return {
            "run_id": None,
            "enabled": bool(saved and saved["enabled"]),
            "scaler_scale": saved["scaler"]["init_scale"] if saved else None,
            "memory_savings_gb": None,
            "overflow_count": 0,
            "underflow_count": 0,
            "status": None,
        }
    records = [json.loads(x) for x in read_log(run["run_dir"])]
    steps = [r for r in records if r.get("type") == "step"]
    summary = run.get("summary") or {}
    precision = summary.get("precision") or (
        steps[-1]["precision"] if steps else run["spec"].get("precision")
    )
    scale = summary.get("final_scale") if summary else (steps[-1].get("scale") if steps else None)
    return {
        "run_id": run["id"],
        "status": run["status"],
        "precision": precision,
        "enabled": _is_mixed(precision, run["spec"].get("device", "cpu")),
        "scaler_scale": scale,
        "memory_savings_gb": savings_gb(run["spec"], precision),
        "overflow_count": sum(
            1 for r in records if r.get("type") == "event" and r.get("kind") == "overflow"
        ),
        "underflow_count": sum(1 for r in steps if r.get("grad_norm") == 0.0),
        "skipped_steps": summary.get("skipped_steps", sum(1 for r in steps if r.get("skipped"))),
        "logged_steps": len(steps),
    }


PLAN_WAIT_S = 3.0  # how long the planner route waits for its job before answering 202 with it


def _job_answer(job: dict[str, Any], status_code: int = 202) -> JSONResponse:
    """A job's answer: its result when it succeeded, a 422 when the request was bad, else its state."""
    if job["status"] == "succeeded":
        return JSONResponse({**job["result"], "job_id": job["id"]}, status_code=200)
    if job["status"] == "invalid":
        raise HTTPException(422, job["error"])
    view = {
        "job_id": job["id"],
        "status": job["status"],
        "error": job["error"],
        "poll": f"/finetuning/optimize-mixed-precision/jobs/{job['id']}",
    }
    headers = {"Location": view["poll"], "Retry-After": "5"} if job["status"] != "failed" else None
    return JSONResponse(
        view, status_code=status_code if job["status"] != "failed" else 200, headers=headers
    )


@router.post("/optimize-mixed-precision")
def optimize(body: OptimizeBody, who: Owner, svc: Svc, request: Request) -> Any:
    """The memory planner's answer for every precision (no run), for `device` (as `ampkit plan
    --device`: a GPU is planned from this server without one): `model_name`, `device` and
    `device_name` (what the figures are for), `gpu_memory_gb`, `budget_gb` (a GPU's memory less
    the CUDA context and fragmentation), `batch_size`, `should_use_mixed_precision`, `reason`,
    `recommended_precision`, `recommendations` (per precision: `precision`, `predicted_peak_gb`,
    `fits`, `max_batch_size`, `method` (`refused`: the device cannot run it), `why_not` (why it
    fits no batch, else null)), `note`. 200 when it is ready within 3 s or cached
    (`"cached": true`); else 202 with the job to poll (`poll`, also in `Location`). Per owner a
    rate limit and at most 2 plans in flight (429).
    \f
    The estimates run in the worker process (``..jobs``), never in this thread."""
    limits = limit(request, who, "planner")
    try:
        allowed_model(body.model_name, ())
        if body.model_overrides or is_hf(body.model_name):
            check_overrides(body.model_name, body.model_overrides)
        check_size(
            body.model_name, body.model_overrides, svc.config.max_params
        )  # by depth: fast at 8000 layers
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    key = plan_key(body, svc.config.max_params)
    hit = jobs().cached(key)
    if hit is not None:
        if hit[0] == "invalid":
            raise HTTPException(422, hit[1])
        return {**hit[1], "cached": True}
    if not jobs().pending(
        who, key
    ):  # a repeat of a job in flight follows that job; a new one counts
        limits.check_in_flight(who, jobs().in_flight(who))
    job = jobs().submit(
        who,
        key,
        f"{compute_plan.__module__}:compute_plan",
        (body.model_dump(), svc.config.max_params),
    )
    return _job_answer(jobs().wait(job, PLAN_WAIT_S))


@router.get("/optimize-mixed-precision/jobs/{job_id}")
def optimize_job(job_id: str, who: Owner) -> Any:
    """A planner job: 202 while it is queued or running, then its answer (200, or 422); another
    owner's job is a 404."""
    job = jobs().get(job_id, who)
    if job is None:
        raise HTTPException(404, f"no planner job {job_id!r}")
    return _job_answer(job)
