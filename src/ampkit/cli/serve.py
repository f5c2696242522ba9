"""``ampkit serve``: the training-job REST service (FastAPI + uvicorn; ``pip install -e ".[serve]"``)."""

from __future__ import annotations

import os
from typing import Any

from ..service.settings import SERVE_NUMBERS
from .common import bounded, flag, memory_size
from .invocation import Invocation


def cmd_serve(inv: Invocation) -> int:
    args = inv.args
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError(
            'ampkit serve needs FastAPI and uvicorn: pip install -e ".[serve]"'
        ) from None
    from ..plan.estimate import parse_bytes
    from ..service.server import preflight, serve

    body_cap = parse_bytes(args.max_body)
    if body_cap < 1024:
        raise ValueError(
            f"--max_body {args.max_body}: must be at least 1KiB (requests carry JSON bodies)"
        )
    preflight(args.data_dir)  # a full disk or an unwritable directory: said before anything else
    factories = tuple(f for f in os.environ.get("AMPKIT_ALLOWED_FACTORIES", "").split(",") if f)
    from ..service.auth import token_source

    start_line = (
        f"ampkit serve: http://{args.host}:{args.port} · data in {os.path.abspath(args.data_dir)} · "
        f"{args.max_concurrent} run(s) at a time · tokens: {token_source(args.data_dir)}"
    )
    serve(
        args.host,
        args.port,
        announce=lambda: print(start_line, flush=True),  # once it listens: not before an error
        data_dir=args.data_dir,
        max_concurrent=args.max_concurrent,
        queue_cap=args.queue_cap,
        body_cap=body_cap,
        allowed_factories=factories,
        max_params=args.max_params,
        max_seconds=args.max_seconds,
        max_gpu_temp=args.max_gpu_temp,
        run_memory_gb=args.run_memory_gb,
        private_docs=args.private_docs,
        header_timeout=args.header_timeout,
    )
    return 0


def number(p: Any, name: str) -> None:
    """``--name``, a bounded number: type, bounds, default and help from :data:`SERVE_NUMBERS`."""
    b = SERVE_NUMBERS[name]
    flag(p, name, type=bounded(b.kind, unit=b.unit, **b.bounds()), default=b.default, help=b.help)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="the REST service: launch, watch, compare runs (FastAPI + uvicorn)"
    )
    flag(
        p,
        "host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only)",
    )
    number(p, "port")
    flag(
        p,
        "data_dir",
        default="ampkit-service",
        help="SQLite database, tokens and run directories (default: ./ampkit-service)",
    )
    number(p, "max_concurrent")
    number(p, "queue_cap")
    number(p, "max_seconds")
    number(p, "max_params")
    flag(
        p,
        "max_body",
        type=memory_size,
        default="1MiB",
        help="largest request body; larger ones get 413 (default: 1MiB)",
    )
    number(p, "max_gpu_temp")
    number(p, "run_memory_gb")
    number(p, "header_timeout")
    flag(
        p,
        "private_docs",
        action="store_true",
        help="require the token for /docs and /openapi.json too",
    )
    p.set_defaults(func=cmd_serve)
