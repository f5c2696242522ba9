"""The training-job service (``ampkit serve``; extra ``serve``).

``app.create_app`` wires the parts: ``schemas`` (settings and request bodies), ``deps`` (the
caller and their runs as FastAPI dependencies), ``routes/`` (``runs``: ampkit's API;
``finetuning``: the brief's), ``store`` (SQLite), ``runner`` (one process group per run) and
``runfile`` (the run's ``run.toml``, the one contract with ``ampkit train``), ``auth`` (tokens),
``lock`` (one server per data directory).
"""

from __future__ import annotations

__all__ = ["create_app", "serve"]


def create_app(*args, **kwargs):  # noqa: ANN002,ANN003,ANN201 -- imports FastAPI only when used
    from .app import create_app as make

    return make(*args, **kwargs)


def serve(host: str = "127.0.0.1", port: int = 8000, **config: object) -> None:
    """Run the service with uvicorn until interrupted (:func:`ampkit.service.server.serve`)."""
    from .server import serve as run

    run(host, port, **config)  # type: ignore[arg-type]
