"""The REST API (FastAPI): launch, watch, cancel, resume, compare runs and ask for a recommendation
(``routes.runs``), and the fine-tuning brief's routes (``routes.finetuning``).

Every route but ``/health`` needs ``Authorization: Bearer <token>``; a run belongs to its
token's owner and is 404 for anyone else. Bad input is a 4xx with the same message the CLI
gives (422 validation, 413 body too large, 429 queue full, 409 wrong state), never a 500.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from .. import __version__
from .auth import load_tokens
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

    app = FastAPI(title="ampkit", version=__version__, lifespan=lifespan)
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

