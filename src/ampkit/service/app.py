"""The REST API (FastAPI): launch, watch, cancel, resume, compare runs and ask for a recommendation
(``routes.runs``), and the fine-tuning brief's routes (``routes.finetuning``).

Every route but ``/health`` needs ``Authorization: Bearer <token>``; a run belongs to its
token's owner and is 404 for anyone else. Bad input is a 4xx with the same message the CLI
gives (422 validation, 413 body too large, 429 queue full, 409 wrong state, 507 disk full),
never a 500. The body cap holds while the body is read (:mod:`ampkit.service.middleware`), and
every call is one line of the request log (logger ``ampkit.service``). With
``ServiceConfig.private_docs`` the API description (``/docs``, ``/openapi.json``) needs a token too.
While the app's lifespan runs it holds its data directory's lock (:mod:`ampkit.service.lock`): a
second server on the same directory is refused.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from .. import __version__
from . import lock
from .auth import load_tokens
from .checks import shown
from .deps import Owner, Service, warm_size_check
from .memcap import run_cap
from .middleware import BodyCap, RequestLog
from .routes import finetuning, runs
from .runner import Runner
from .schemas import RunSpec, ServiceConfig
from .store import Store, disk_full
from .ui import router as ui_router

__all__ = ["RunSpec", "ServiceConfig", "create_app"]


def create_app(config: ServiceConfig, tokens: Optional[dict[str, str]] = None) -> FastAPI:
    """The service's app: one store, one runner (started and stopped with the app) and the routers.
    ``tokens`` maps each token to its owner (default: :func:`ampkit.service.auth.load_tokens`)."""
    store = Store(config.data_dir)
    runner = Runner(
        store,
        max_concurrent=config.max_concurrent,
        poll_s=config.poll_s,
        max_gpu_temp=config.max_gpu_temp,
        memory_cap=run_cap(config.run_memory_gb, config.max_concurrent),
    )
    svc = Service(
        config, store, runner, tokens if tokens is not None else load_tokens(config.data_dir)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        key = lock.hold(
            config.data_dir
        )  # one server per data directory (DataDirBusy names the holder)
        try:
            if config.max_params:
                warm_size_check()  # before the server listens: the first size check imports nothing
            runner.start()
            yield
            runner.stop()
        finally:
            lock.release(key)

    hidden = (
        {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.private_docs else {}
    )
    app = FastAPI(
        title="ampkit",
        version=__version__,
        lifespan=lifespan,
        default_response_class=SafeJSONResponse,
        **hidden,
    )
    app.exception_handler(RequestValidationError)(invalid_request)
    app.exception_handler(HTTPException)(http_error)
    app.exception_handler(OSError)(storage_error)
    app.exception_handler(sqlite3.Error)(storage_error)
    app.state.service = svc
    app.state.store, app.state.runner, app.state.config = store, runner, config
    app.add_middleware(BodyCap, cap=lambda scope: config.body_cap)
    app.add_middleware(
        RequestLog, owner=lambda scope: _owner_of(svc, scope)
    )  # outermost: sees every answer
    app.include_router(runs.router)
    app.include_router(finetuning.router)
    app.include_router(ui_router)  # the web UI at / and /ui/ (ui/routes.py)
    if config.private_docs:
        _private_docs(app)
    return app


def _owner_of(svc: Service, scope: dict[str, Any]) -> Optional[str]:
    auth = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    return svc.tokens.get(token.strip()) if scheme.lower() == "bearer" else None


def _private_docs(app: FastAPI) -> None:
    """``/openapi.json`` and ``/docs`` behind the bearer token (401 without one)."""

    @app.get("/openapi.json", include_in_schema=False)
    def openapi(who: Owner) -> dict[str, Any]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    def docs(who: Owner) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="ampkit")


async def storage_error(request: Request, exc: Exception) -> Response:
    """507 when the disk (or the database) is full: the request was not stored; anything else is re-raised."""
    if not disk_full(exc):
        raise exc
    return SafeJSONResponse(
        {
            "detail": f"the server's disk is full; nothing was stored ({type(exc).__name__}: "
            f"{exc}); retry when an operator has freed space"
        },
        status_code=507,
        headers={"Retry-After": "60"},
    )


class SafeJSONResponse(JSONResponse):
    """JSON that any value serialises to: non-ASCII escaped (a lone surrogate a client sent, or one
    stored by an older server, is written as ``\\ud800`` instead of failing to encode: no 500) and
    non-finite floats as strings."""

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), ensure_ascii=True, separators=(",", ":")).encode(
            "ascii"
        )


def _finite(x: Any) -> Any:
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """422 naming each bad field and why; the value as sent is shown cut short (a 200,000-character
    string is not echoed back) and escaped."""
    errors = [
        {
            "loc": [
                x if not isinstance(x, str) or len(x) <= 80 else shown(x) for x in e.get("loc", ())
            ],
            "msg": e.get("msg", "") + _closest(request, e),
            "type": e.get("type", ""),
            "input": shown(e.get("input"), 120),
        }
        for e in exc.errors()
    ]
    return SafeJSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


def _closest(request: Request, error: dict[str, Any]) -> str:
    """`` (did you mean 'steps'?)`` for a field the body model does not have (``stepz``) or a
    value that is not one of a field's choices (``size: "tinny"``); else ``""``."""
    import difflib
    import re
    import typing

    loc, kind = list(error.get("loc", ())), error.get("type")
    typed = loc[-1] if kind == "extra_forbidden" and loc else error.get("input")
    if not isinstance(typed, str):
        return ""
    if kind == "literal_error":
        names = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
    elif kind == "extra_forbidden":
        field = getattr(request.scope.get("route"), "body_field", None)
        model = getattr(getattr(field, "field_info", None), "annotation", None)
        for key in loc[1:-1]:  # down to the object that holds the key
            info = getattr(model, "model_fields", {}).get(key)
            kinds = [info.annotation, *typing.get_args(info.annotation)] if info else []
            model = next((k for k in kinds if hasattr(k, "model_fields")), None)
        names = list(getattr(model, "model_fields", {}))
    else:
        return ""
    close = difflib.get_close_matches(typed, names, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


async def http_error(request: Request, exc: HTTPException) -> Response:
    return SafeJSONResponse(
        {"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers
    )
