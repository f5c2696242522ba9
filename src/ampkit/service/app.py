"""The REST API (FastAPI): launch, watch, cancel, resume, compare runs and ask for a recommendation
(``routes.runs``), and the fine-tuning brief's routes (``routes.finetuning``).

Every route but ``/health`` needs ``Authorization: Bearer <token>``; a run belongs to its
token's owner and is 404 for anyone else. Bad input is a 4xx with the same message the CLI
gives (422 validation, 413 body too large, 429 queue full, 409 wrong state), never a 500.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .. import __version__
from .auth import load_tokens
from .checks import shown
from .deps import Service
from .routes import finetuning, runs
from .runner import Runner
from .schemas import RunSpec, ServiceConfig
from .store import Store

__all__ = ["RunSpec", "ServiceConfig", "create_app"]


def create_app(config: ServiceConfig, tokens: Optional[dict[str, str]] = None) -> FastAPI:
    """The service's app: one store, one runner (started and stopped with the app) and the routers.
    ``tokens`` maps each token to its owner (default: :func:`ampkit.service.auth.load_tokens`)."""
    store = Store(config.data_dir)
    runner = Runner(store, max_concurrent=config.max_concurrent, poll_s=config.poll_s)
    svc = Service(config, store, runner, tokens if tokens is not None else load_tokens(config.data_dir))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        yield
        runner.stop()

    app = FastAPI(title="ampkit", version=__version__, lifespan=lifespan, default_response_class=SafeJSONResponse)
    app.exception_handler(RequestValidationError)(invalid_request)
    app.exception_handler(HTTPException)(http_error)
    app.state.service = svc
    app.state.store, app.state.runner, app.state.config = store, runner, config
    app.middleware("http")(cap_body)
    app.include_router(runs.router)
    app.include_router(finetuning.router)
    return app


async def cap_body(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """413 for a body over the server's ``body_cap``, by its Content-Length or, without one, as read."""
    cap = request.app.state.config.body_cap
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > cap):
        return JSONResponse({"detail": f"request body of {length} bytes exceeds the limit of {cap}"}, status_code=413)
    if request.method in ("POST", "PUT", "PATCH") and length is None:
        body = await request.body()
        if len(body) > cap:
            return JSONResponse({"detail": f"request body exceeds the limit of {cap} bytes"}, status_code=413)
    return await call_next(request)



class SafeJSONResponse(JSONResponse):
    """JSON that any value serialises to: non-ASCII escaped (a lone surrogate a client sent, or one
    stored by an older server, is written as ``\\ud800`` instead of failing to encode: no 500) and
    non-finite floats as strings."""

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), ensure_ascii=True, separators=(",", ":")).encode("ascii")


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
    errors = [{"loc": [x if not isinstance(x, str) or len(x) <= 80 else shown(x) for x in e.get("loc", ())],
               "msg": e.get("msg", ""), "type": e.get("type", ""),
               "input": shown(e.get("input"), 120)} for e in exc.errors()]
    return SafeJSONResponse({"detail": jsonable_encoder(errors)}, status_code=422)


async def http_error(request: Request, exc: HTTPException) -> Response:
    return SafeJSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)
