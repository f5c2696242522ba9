"""The REST API (FastAPI): launch, watch, cancel, resume, compare runs and ask for a recommendation.

Every route but ``/health`` needs ``Authorization: Bearer <token>``; a run belongs to its
token's owner and is 404 for anyone else. Bad input is a 4xx with the same message the CLI
gives (422 validation, 413 body too large, 429 queue full, 409 wrong state), never a 500.
"""

from __future__ import annotations

import functools
import json
import os
import uuid
from typing import Any, Literal, Optional, Union

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .. import __version__
from ..step.hardware import normalize_device
from ..step.precision import parse_precision
from .auth import load_tokens
from .runner import Runner
from .store import Store

__all__ = ["RunSpec", "ServiceConfig", "allowed_model", "check_size", "create_app", "hf_parameters"]

BUILTIN_MODELS = ("gpt", "mlp", "cnn")


class ServiceConfig(BaseModel):
    data_dir: str = "ampkit-service"
    max_concurrent: int = Field(1, ge=1)
    queue_cap: int = Field(16, ge=1)
    body_cap: int = Field(1 << 20, ge=1024)  # bytes; training texts travel in the body
    poll_s: float = Field(0.2, gt=0)
    allowed_factories: tuple[str, ...] = ()
    max_params: Optional[int] = Field(2_000_000_000, ge=1)  # Hugging Face configs larger than this: 422


def allowed_model(model: str, factories: tuple[str, ...]) -> str:
    from ..loop.hf import ALIASES, is_hf

    if model in BUILTIN_MODELS or model in factories:
        return model
    if is_hf(model) and (model in ALIASES or model.startswith("transformers.")):
        return model  # built from its config class, never downloaded
    extra = f" or an allowed factory ({', '.join(factories)})" if factories else \
        " (module:factory models must be allowed by the operator: AMPKIT_ALLOWED_FACTORIES)"
    raise ValueError(f"model {model!r} is not available here; choose {', '.join(BUILTIN_MODELS)}, a Hugging Face "
                     f"config ({', '.join(ALIASES)}, transformers.<Name>Config){extra}")


Scalar = Union[bool, int, float, str, None]


class RunSpec(BaseModel):
    """A training run (``POST /v1/runs``): the same names and checks as ``ampkit train``."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str = "mlp"
    size: Literal["tiny", "small", "medium", "large"] = "tiny"
    precision: str = "auto"
    steps: int = Field(100, ge=1, le=1_000_000)
    batch_size: int = Field(16, ge=1, le=65_536)
    accumulation_steps: int = Field(1, ge=1, le=4096)
    lr: float = Field(1e-3, gt=0, le=10)
    seed: int = 0
    init_scale: Optional[float] = Field(None, gt=0)
    device: str = "cpu"
    max_seconds: Optional[float] = Field(None, gt=0)
    checkpoint_every: int = Field(10, ge=1)
    log_every: int = Field(5, ge=1)
    model_overrides: dict[str, Scalar] = Field(default_factory=dict)  # a Hugging Face config's fields
    texts: Optional[list[str]] = Field(None, min_length=1)  # training texts (bytes as tokens), else the stdlib

    @field_validator("texts")
    @classmethod
    def _texts(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        short = [i for i, t in enumerate(v or []) if len(t.encode("utf-8")) < 2]
        if short:
            raise ValueError(f"texts {short[:10]} have fewer than 2 bytes: each text needs at least one next "
                             "byte to predict")
        return v
    max_length: Optional[int] = Field(None, ge=2, le=8192)  # tokens per sample for text models
    epochs: Optional[int] = Field(None, ge=1, le=100_000)  # instead of steps
    target_effective_batch_size: Optional[int] = Field(None, ge=1, le=1_000_000)
    activation_checkpointing: bool = False
    save_model: bool = False  # write the trained fp32 weights to <run dir>/model
    user_id: Optional[Union[int, str]] = None  # a label (the owner is the token's)
    amp: dict[str, Union[Scalar, list[str]]] = Field(default_factory=dict)  # more MixedPrecisionConfig fields

    @field_validator("amp")
    @classmethod
    def _amp(cls, v: dict[str, Any]) -> dict[str, Any]:
        from ..step.config import MixedPrecisionConfig

        clash = [k for k in ("precision", "accumulation_steps", "init_scale") if k in v]
        if clash:
            raise ValueError(f"amp: give {', '.join(clash)} as the run's own field(s), not inside amp")
        MixedPrecisionConfig.from_dict(v)  # unknown keys and bad values: the config's own message
        return v

    @field_validator("model_overrides")
    @classmethod
    def _overrides(cls, v: dict[str, Scalar]) -> dict[str, Scalar]:
        bad = [k for k in v if not k.isidentifier()]
        if bad or any(isinstance(x, str) and ("," in x or "=" in x) for x in v.values()):
            raise ValueError(f"model_overrides: keys must be identifiers and values plain scalars (bad: {bad or v})")
        return v

    @field_validator("precision")
    @classmethod
    def _precision(cls, v: str) -> str:
        parse_precision(v)  # PrecisionError (a ValueError) lists the valid names
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        normalize_device(v)
        return v


class RecommendSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str = "mlp"
    size: Literal["tiny", "small", "medium", "large"] = "tiny"
    batch_size: int = Field(16, ge=1, le=65_536)
    steps: int = Field(10, ge=1, le=10_000)
    precisions: str = "fp32,bf16,fp16"
    device: str = "cpu"
    max_seconds: Optional[float] = Field(None, gt=0)

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, v: str) -> str:
        for p in v.split(","):
            parse_precision(p.strip())
        return v


@functools.lru_cache(maxsize=128)
def hf_parameters(model: str, overrides: tuple[tuple[str, Any], ...]) -> int:
    """Parameters of a Hugging Face config model, counted on the meta device (nothing allocated)."""
    import torch

    from ..loop.hf import build_hf

    with torch.device("meta"):
        return sum(p.numel() for p in build_hf(model, dict(overrides)).parameters())


def check_size(model: str, overrides: dict[str, Any], max_params: Optional[int]) -> None:
    """A Hugging Face config model over ``max_params`` parameters: ValueError (a 422)."""
    from ..loop.hf import is_hf

    if not (is_hf(model) and max_params):
        return
    n = hf_parameters(model, tuple(sorted(overrides.items())))
    if n > max_params:
        raise ValueError(f"model {model!r} with {overrides or 'its defaults'} has {n / 1e6:,.0f}M parameters, over "
                         f"this server's limit of {max_params / 1e6:,.0f}M (ampkit serve --max_params)")


def _view(run: dict[str, Any]) -> dict[str, Any]:
    summary = run.get("summary") or {}
    return {"id": run["id"], "kind": run["kind"], "status": run["status"], "spec": run["spec"],
            "created": run["created"], "started": run["started"], "ended": run["ended"], "error": run["error"],
            "resumes": run["resumes"], "summary": summary or None, "skipped_steps": summary.get("skipped_steps"),
            "model_path": summary.get("model_path"), "scaler_scale": summary.get("final_scale"),
            "user_id": run["spec"].get("user_id")}


def _log_lines(run_dir: str) -> list[str]:
    """Complete JSONL lines of every attempt's log, in order (a line still being written is left out)."""
    out: list[str] = []
    attempts = sorted((n for n in os.listdir(run_dir) if n.startswith("log-")), key=lambda n: int(n[4:])) \
        if os.path.isdir(run_dir) else []
    for name in attempts:
        path = os.path.join(run_dir, name, "log.jsonl")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            continue
        lines = text.split("\n")
        out += [ln for ln in lines[:-1] if ln.strip()]  # the last piece has no newline yet (or is empty)
    return out


def create_app(config: ServiceConfig, tokens: Optional[dict[str, str]] = None) -> FastAPI:
    store = Store(config.data_dir)
    tokens = tokens if tokens is not None else load_tokens(config.data_dir)
    runner = Runner(store, max_concurrent=config.max_concurrent, poll_s=config.poll_s)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="ampkit", version=__version__, lifespan=lifespan)
    app.state.store, app.state.runner, app.state.config = store, runner, config

    @app.middleware("http")
    async def body_cap(request: Request, call_next: Any) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > config.body_cap):
            return JSONResponse({"detail": f"request body of {length} bytes exceeds the limit of {config.body_cap}"},
                                status_code=413)
        if request.method in ("POST", "PUT", "PATCH") and length is None:
            body = await request.body()
            if len(body) > config.body_cap:
                return JSONResponse({"detail": f"request body exceeds the limit of {config.body_cap} bytes"},
                                    status_code=413)
        return await call_next(request)

    def owner(request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        who = tokens.get(token.strip()) if scheme.lower() == "bearer" else None
        if who is None:
            raise HTTPException(401, "missing or invalid token: send Authorization: Bearer <token>",
                                headers={"WWW-Authenticate": "Bearer"})
        return who

    def mine(run_id: str, who: str) -> dict[str, Any]:
        run = store.get(run_id, owner=who)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        return run

    def submit(who: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        from ..loop.hf import is_hf

        try:
            allowed_model(spec["model"], config.allowed_factories)
            if spec.get("model_overrides") and not is_hf(spec["model"]):
                raise ValueError(f"model_overrides are for Hugging Face config models, not {spec['model']!r}")
            check_size(spec["model"], spec.get("model_overrides") or {}, config.max_params)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        if store.count("queued") >= config.queue_cap:
            raise HTTPException(429, f"the queue is full ({config.queue_cap} runs waiting); retry later",
                                headers={"Retry-After": "10"})
        run_id = uuid.uuid4().hex[:12]
        return store.create(run_id, who, kind, spec, os.path.join(os.path.abspath(config.data_dir), "runs", run_id))

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "version": __version__, "queued": store.count("queued"),
                "running": store.count("running")}

    @app.post("/v1/runs", status_code=201)
    def create_run(spec: RunSpec, who: str = Depends(owner)) -> dict[str, Any]:
        return _view(submit(who, "train", spec.model_dump()))

    @app.get("/v1/runs")
    def list_runs(status: Optional[str] = None, limit: int = Query(100, ge=1, le=1000),
                  who: str = Depends(owner)) -> dict[str, Any]:
        return {"runs": [_view(r) for r in store.list(owner=who, status=status, limit=limit)]}

    @app.get("/v1/runs/{run_id}")
    def get_run(run_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        run = mine(run_id, who)
        view = _view(run)
        view["events"] = [r for r in map(json.loads, _log_lines(run["run_dir"])) if r.get("type") == "event"]
        return view

    @app.get("/v1/runs/{run_id}/metrics")
    def metrics(run_id: str, after: int = Query(0, ge=0), limit: int = Query(1000, ge=1, le=10_000),
                who: str = Depends(owner)) -> dict[str, Any]:
        run = mine(run_id, who)
        lines = _log_lines(run["run_dir"])
        page = lines[after:after + limit]
        return {"id": run_id, "status": run["status"], "records": [json.loads(x) for x in page],
                "next": after + len(page), "total": len(lines)}

    @app.delete("/v1/runs/{run_id}")
    def cancel(run_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        run = mine(run_id, who)
        if not runner.cancel(run_id):
            raise HTTPException(409, f"run {run_id} has already ended ({store.get(run_id)['status']})")  # type: ignore[index]
        return _view(store.get(run_id) or run)

    @app.post("/v1/runs/{run_id}/resume", status_code=202)
    def resume(run_id: str, who: str = Depends(owner)) -> dict[str, Any]:
        run = mine(run_id, who)
        if run["kind"] != "train" or run["status"] not in ("interrupted", "failed", "cancelled"):
            raise HTTPException(409, f"run {run_id} is {run['status']}: only an interrupted, failed or cancelled "
                                     "training run can be resumed")
        ckpt = os.path.join(run["run_dir"], "ckpt")
        if not os.path.isdir(ckpt) or not any(n.startswith("ckpt-") for n in os.listdir(ckpt)):
            raise HTTPException(409, f"run {run_id} has no checkpoint to resume from (checkpoint_every="
                                     f"{run['spec'].get('checkpoint_every')} steps were not reached)")
        store.update(run_id, expect=(run["status"],), status="queued", resumes=run["resumes"] + 1, error=None,
                     ended=None, started=None, pid=None)
        return _view(store.get(run_id) or run)

    @app.get("/v1/compare")
    def compare(ids: str, who: str = Depends(owner)) -> dict[str, Any]:
        wanted = [i for i in ids.split(",") if i]
        if len(wanted) < 2:
            raise HTTPException(422, "compare needs at least two run ids: ids=a,b[,c...]")
        runs = [mine(i, who) for i in wanted]
        missing = [r["id"] for r in runs if not r.get("summary")]
        if missing:
            raise HTTPException(409, f"run(s) {', '.join(missing)} have no summary yet (not succeeded)")
        base = runs[0]["summary"]
        rows = []
        for r in runs:
            s = r["summary"]
            rows.append({"id": r["id"], "precision": s["precision"], "final_loss": s["final_loss"],
                         "loss_gap": _sub(s["final_loss"], base["final_loss"]),
                         "ms_per_step": s["ms_per_step"], "speedup": _div(base["ms_per_step"], s["ms_per_step"]),
                         "samples_per_s": s["samples_per_s"], "peak_mem_bytes": s.get("peak_mem_bytes"),
                         "memory_ratio": _div(s.get("peak_mem_bytes"), base.get("peak_mem_bytes")),
                         "skipped_steps": s["skipped_steps"]})
        return {"baseline": runs[0]["id"], "runs": rows}

    @app.post("/v1/recommend", status_code=201)
    def recommend(spec: RecommendSpec, who: str = Depends(owner)) -> dict[str, Any]:
        return _view(submit(who, "recommend", spec.model_dump()))

    from .compat import add_routes

    add_routes(app, owner, submit, mine, _view,
               lambda run: [json.loads(x) for x in _log_lines(run["run_dir"])])

    return app


def _sub(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def _div(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if not a or not b else a / b
