"""``ampkit serve``: the training-job REST service (FastAPI + uvicorn; ``pip install -e ".[serve]"``)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .common import flag, positive_int
from .invocation import Invocation


def cmd_serve(inv: Invocation) -> int:
    args = inv.args
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ImportError('ampkit serve needs FastAPI and uvicorn: pip install -e ".[serve]"') from None
    from ..loop.estimate import parse_bytes
    from ..service.server import preflight, serve

    body_cap = parse_bytes(args.max_body)
    if body_cap < 1024:
        raise ValueError(f"--max_body {args.max_body}: must be at least 1KiB (requests carry JSON bodies)")
    preflight(args.data_dir)  # a full disk or an unwritable directory: said before anything else
    factories = tuple(f for f in os.environ.get("AMPKIT_ALLOWED_FACTORIES", "").split(",") if f)
    print(f"ampkit serve: http://{args.host}:{args.port} · data in {os.path.abspath(args.data_dir)} · "
          f"{args.max_concurrent} run(s) at a time · tokens: AMPKIT_TOKENS / AMPKIT_TOKEN / "
          f"{os.path.join(args.data_dir, 'tokens.json')}", flush=True)
    serve(args.host, args.port, data_dir=args.data_dir, max_concurrent=args.max_concurrent,
          queue_cap=args.queue_cap, body_cap=body_cap, allowed_factories=factories,
          max_params=args.max_params, max_seconds=args.max_seconds, max_gpu_temp=args.max_gpu_temp,
          private_docs=args.private_docs, header_timeout=args.header_timeout)
    return 0


def _celsius(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a temperature in °C (e.g. 83)") from None
    if not 0 < value <= 150:
        raise argparse.ArgumentTypeError(f"{text} °C is not a GPU temperature limit: give one in (0, 150]")
    return value


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 and at most 3600 seconds")
    return value


def _seconds(text: str) -> float:
    from ..service.schemas import MAX_SECONDS

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text} must be > 0 and at most {MAX_SECONDS:g} seconds (30 days)")
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="the REST service: launch, watch, compare runs (FastAPI + uvicorn)")
    flag(p, "host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    flag(p, "port", type=positive_int, default=8000, help="port (default: 8000)")
    flag(p, "data_dir", default="ampkit-service", help="SQLite database, tokens and run directories (default: ./ampkit-service)")
    flag(p, "max_concurrent", type=positive_int, default=1, help="runs at a time (default: 1)")
    flag(p, "queue_cap", type=positive_int, default=16,
         help="queued runs per owner before that owner's new ones get 429 (default: 16)")
    flag(p, "max_seconds", type=_seconds, default=86_400.0,
         help="a run's time limit when its request gives none, in seconds (default: 86400; at most 30 days)")
    flag(p, "max_params", type=positive_int, default=2_000_000_000,
         help="refuse Hugging Face config models with more parameters (default: 2e9)")
    flag(p, "max_body", default="1MiB", help="largest request body; larger ones get 413 (default: 1MiB)")
    flag(p, "max_gpu_temp", type=_celsius, default=None,
         help="hold queued runs while a GPU is hotter than this many °C (default: no hold)")
    flag(p, "header_timeout", type=_timeout, default=10.0,
         help="close a connection whose request head, or a pause in its body, takes longer (seconds; default: 10)")
    flag(p, "private_docs", action="store_true", help="require the token for /docs and /openapi.json too")
    p.set_defaults(func=cmd_serve)
