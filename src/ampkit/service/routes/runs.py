"""ampkit's own routes: launch, list, watch, cancel, resume and compare runs, and ask for a
recommendation (``ampkit tune`` as a job). ``/health`` is the only route without a token."""

from __future__ import annotations

import difflib
import json
import os
import sqlite3
from typing import Any, Optional

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response

from ... import __version__
from ..checks import shown
from ..deps import OwnedRun, Owner, Svc, each_query_once, lookup, submit
from ..gpu import gpu_status
from ..limits import limit
from ..runner import read_log
from ..schemas import RecommendSpec, RunSpec, run_view
from ..store import STATUSES

__all__ = ["router"]

router = APIRouter(dependencies=[Depends(each_query_once)])  # a parameter twice: 422


@router.get("/health")
def health(svc: Svc, response: Response) -> dict[str, Any]:
    """No token. `200 {"status": "ok", "version": "0.1.0", "scheduler": {"alive": true,
    "last_tick_s_ago": 0.12, "error": null}, "run_memory_bytes": 22000000000, "queued": 0, "running":
    0}` (`run_memory_bytes`: each run's memory cap, `ampkit serve --run_memory_gb`; null: none).
    `scheduler.error` is the
    last scheduler tick's error (a full disk, ...) until a tick succeeds. When the scheduler is not
    alive (its thread ended, or no tick finished for 300 s) or the database cannot be read
    (`store_error`): `503` with `"status": "degraded"` -- queued runs would not start. Where CUDA
    devices are present, also `gpus`: `[{"index": 0, "name": ..., "temperature_c": 61.0,
    "memory_used_bytes": ..., "memory_total_bytes": ...}]` (a value it cannot read is null); while a
    device is over `--max_gpu_temp`, `held`: why queued runs wait. On a CPU server neither field is
    present."""
    scheduler = svc.runner.scheduler()
    out: dict[str, Any] = {
        "status": "ok" if scheduler["alive"] else "degraded",
        "version": __version__,
        "scheduler": scheduler,
        "run_memory_bytes": svc.runner.memory_cap,
    }
    try:
        out["queued"], out["running"] = svc.store.count("queued"), svc.store.count("running")
    except sqlite3.Error as e:  # the database cannot be read: say so, still answer
        out["status"], out["store_error"] = "degraded", f"{type(e).__name__}: {e}"
    if out["status"] != "ok":
        response.status_code = 503
    gpus = gpu_status()
    if gpus:
        out["gpus"] = gpus
    if svc.runner.hold.reason:
        out["held"] = svc.runner.hold.reason
    return out


@router.post("/v1/runs", status_code=201)
def create_run(spec: RunSpec, who: Owner, svc: Svc) -> dict[str, Any]:
    """A training run: `python -m ampkit train` in its own process group, logs and checkpoints in
    `DATA_DIR/runs/{id}/`, its settings in its `run.toml` (each field below is an `ampkit train`
    option or, in `amp`, a `MixedPrecisionConfig` field). Answer: the run object, `status` `queued`."""
    return run_view(submit(svc, who, "train", spec.model_dump()))


@router.get("/v1/runs")
def list_runs(
    who: Owner,
    svc: Svc,
    status: Optional[str] = Query(None, description="only runs in this status"),
    limit: int = Query(100, ge=1, le=1000, description="at most this many runs"),
) -> dict[str, Any]:
    """This owner's runs, newest first: `{"runs": [run, ...]}`. No run's training texts are in it
    (`texts_count` and `texts_bytes` instead). A `status` that is none of the statuses is 422."""
    if status is not None and status not in STATUSES:
        close = difflib.get_close_matches(status, STATUSES, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise HTTPException(
            422, f"status {shown(status)} is no status{hint}; choose one of: {', '.join(STATUSES)}"
        )
    return {
        "runs": [
            run_view(svc.runner.shown(r))
            for r in svc.store.list(owner=who, status=status, limit=limit)
        ]
    }


@router.get("/v1/runs/{run_id}")
def get_run(run: OwnedRun, svc: Svc) -> dict[str, Any]:
    """The run object plus `events`: the run's `type == "event"` JSONL records."""
    view = run_view(svc.runner.shown(run))
    view["events"] = [
        r for r in map(json.loads, read_log(run["run_dir"])) if r.get("type") == "event"
    ]
    return view


@router.get("/v1/runs/{run_id}/metrics")
def metrics(
    run: OwnedRun,
    after: int = Query(
        0, ge=0, description="the index of the first record (`next` of the previous page)"
    ),
    limit: int = Query(1000, ge=1, le=10_000, description="at most this many records"),
) -> dict[str, Any]:
    """The run's JSONL records (steps and events, docs/reference/jsonl-schema.md) from every
    attempt, in order, complete lines only, so it can be polled while the run trains: `{"id",
    "status", "records": [...], "next": <index to pass as after>, "total": <records so far>}`. While
    a run on a CUDA device is running, also `gpus` (as in `/health`)."""
    lines = read_log(run["run_dir"])
    page = lines[after : after + limit]
    out = {
        "id": run["id"],
        "status": run["status"],
        "records": [json.loads(x) for x in page],
        "next": after + len(page),
        "total": len(lines),
    }
    if run["status"] == "running" and str(run["spec"].get("device", "")).startswith("cuda"):
        out["gpus"] = gpu_status()  # the devices now, while it runs on them
    return out


@router.delete("/v1/runs/{run_id}")
def cancel(run: OwnedRun, svc: Svc) -> dict[str, Any]:
    """Cancel a `queued` or `running` run: its process group gets SIGTERM, then SIGKILL after 2 s,
    and is gone when the answer comes. The run object, `status` `cancelled`; 409 if it had already
    ended."""
    if not svc.runner.cancel(run["id"]):
        now = svc.store.get(run["id"]) or run
        raise HTTPException(409, f"run {run['id']} has already ended ({now['status']})")
    return run_view(svc.store.get(run["id"]) or run)


@router.post("/v1/runs/{run_id}/resume", status_code=202)
def resume(run: OwnedRun, svc: Svc) -> dict[str, Any]:
    """Put an `interrupted`, `failed` or `cancelled` training run back in the queue; it continues
    from its newest checkpoint (`ampkit train --resume`), `resumes` + 1. 409 for any other status
    or when no checkpoint was written yet."""
    run_id = run["id"]
    if run["kind"] != "train" or run["status"] not in ("interrupted", "failed", "cancelled"):
        raise HTTPException(
            409,
            f"run {run_id} is {run['status']}: only an interrupted, failed or cancelled "
            "training run can be resumed",
        )
    ckpt = os.path.join(run["run_dir"], "ckpt")
    if not os.path.isdir(ckpt) or not any(n.startswith("ckpt-") for n in os.listdir(ckpt)):
        raise HTTPException(
            409,
            f"run {run_id} has no checkpoint to resume from (checkpoint_every="
            f"{run['spec'].get('checkpoint_every')} steps were not reached)",
        )
    svc.store.update(
        run_id,
        expect=(run["status"],),
        status="queued",
        resumes=run["resumes"] + 1,
        error=None,
        ended=None,
        started=None,
        pid=None,
    )
    return run_view(svc.store.get(run_id) or run)


@router.get("/v1/compare")
def compare(
    ids: str = Query(description="run ids, comma-separated: the first is the baseline"),
    *,
    who: Owner,
    svc: Svc,
) -> dict[str, Any]:
    """Train runs that succeeded, compared with the first: `{"baseline": "A", "runs": [{"id",
    "precision", "final_loss", "loss_gap", "ms_per_step", "speedup", "samples_per_s",
    "peak_mem_bytes", "memory_ratio", "skipped_steps", "differs"}, ...]}` (`loss_gap` = final loss
    - the baseline's; `speedup` = the baseline's ms/step / this one's; `memory_ratio` = peak / the
    baseline's peak; `differs`: the settings other than the precision in which the run is not the
    baseline's, e.g. `["batch_size", "model"]`, where the gaps are not the precision's alone). 422
    with fewer than two ids, an id given twice or a `recommend` run; 409 if one has not succeeded."""
    wanted = [i for i in ids.split(",") if i]
    if len(wanted) < 2:
        raise HTTPException(422, "compare needs at least two run ids: ids=a,b[,c...]")
    twice = sorted({i for i in wanted if wanted.count(i) > 1})
    if twice:
        raise HTTPException(
            422, f"run {twice[0]!r} is named twice; compare takes each run once: ids=a,b[,c...]"
        )
    runs = [lookup(svc, i, who) for i in wanted]
    other = [r["id"] for r in runs if r["kind"] != "train"]
    if other:
        raise HTTPException(
            422,
            f"run {other[0]!r} is a {runs[wanted.index(other[0])]['kind']} run: compare takes "
            "train runs (a recommendation's own answer compares its precisions)",
        )
    missing = [f"{r['id']} ({r['status']})" for r in runs if r["status"] != "succeeded"]
    if missing:
        raise HTTPException(
            409, f"run(s) {', '.join(missing)} have not succeeded: compare takes finished runs"
        )
    base = runs[0]["summary"]
    rows = []
    for r in runs:
        s = r["summary"]
        rows.append(
            {
                "id": r["id"],
                "precision": s["precision"],
                "final_loss": s["final_loss"],
                "loss_gap": _sub(s["final_loss"], base["final_loss"]),
                "ms_per_step": s["ms_per_step"],
                "speedup": _div(base["ms_per_step"], s["ms_per_step"]),
                "samples_per_s": s["samples_per_s"],
                "peak_mem_bytes": s.get("peak_mem_bytes"),
                "memory_ratio": _div(s.get("peak_mem_bytes"), base.get("peak_mem_bytes")),
                "skipped_steps": s["skipped_steps"],
                "differs": _differs(r["spec"], runs[0]["spec"]),
            }
        )
    return {"baseline": runs[0]["id"], "runs": rows}


# What a compared run may change without its gaps being more than the precision's: the precision and
# its scaling, and what does not touch the training (a label, the time limit, the cadences).
_PRECISION_ONLY = {
    "precision",
    "init_scale",
    "amp",
    "user_id",
    "max_seconds",
    "checkpoint_every",
    "log_every",
}


def _differs(spec: dict[str, Any], base: dict[str, Any]) -> list[str]:
    """The settings of ``spec`` other than the precision's that are not ``base``'s, sorted."""
    keys = (set(spec) | set(base)) - _PRECISION_ONLY
    return sorted(k for k in keys if spec.get(k) != base.get(k))


@router.post("/v1/recommend", status_code=201)
def recommend(spec: RecommendSpec, who: Owner, svc: Svc, request: Request) -> dict[str, Any]:
    """A `recommend` run: `ampkit tune` on the model (rate-limited per owner, 429). Answer: the run
    object; when it succeeded, `summary` holds `recommendation` (`precision`, `speedup_vs_fp32`,
    `loss_gap`, `tolerance`, `batch_size`, `accumulation_steps`, `why_not`, ...) and `bench`
    (every precision's measurements)."""
    limit(
        request, who, "recommend"
    )  # per-owner rate limit (429 with Retry-After), as the planner route
    return run_view(submit(svc, who, "recommend", spec.model_dump()))


def _sub(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if not a or not b else a / b
