"""The training-job service (``ampkit serve``; extra ``serve``): FastAPI routes (``app``), SQLite
state (``store``), one process group per run (``runner``), bearer tokens (``auth``)."""

from __future__ import annotations

__all__ = ["create_app", "serve"]


def create_app(*args, **kwargs):  # noqa: ANN002,ANN003,ANN201 -- imports FastAPI only when used
    from .app import create_app as make

    return make(*args, **kwargs)


def serve(host: str = "127.0.0.1", port: int = 8000, **config: object) -> None:
    """Run the service with uvicorn until interrupted."""
    import uvicorn

    from .app import ServiceConfig
    from .app import create_app as make

    uvicorn.run(make(ServiceConfig(**config)), host=host, port=port, log_level="warning")
