"""``ampkit report``: plots and a Markdown summary from a run's logs."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from rich.markup import escape

from .common import flag
from .invocation import Invocation


def latest_run(path: str) -> Optional[str]:
    """``path`` when it is a run (a directory with a ``log.jsonl``, or a log file); for a directory
    of runs (``runs/``, where ``ampkit train`` writes them), its newest run by the log's time; None
    when ``path`` is neither."""
    from ..observe.report import LOG_NAME

    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, LOG_NAME)):
        return path
    runs = [
        os.path.join(path, d)
        for d in os.listdir(path)
        if os.path.isfile(os.path.join(path, d, LOG_NAME))
    ]
    return max(runs, key=lambda r: os.path.getmtime(os.path.join(r, LOG_NAME)), default=None)


def cmd_report(inv: Invocation) -> int:
    args = inv.args
    from ..observe.report import make_report

    run_dir = latest_run(args.run_dir)
    if run_dir is None:
        raise FileNotFoundError(
            f"{args.run_dir!r} holds no run (a directory with a log.jsonl, as "
            "`ampkit train` writes under runs/); pass a run directory or a "
            "directory of runs"
        )
    metrics = args.metrics.split(",") if args.metrics else None
    out = make_report(run_dir, compare=args.compare or (), out_dir=args.out, metrics=metrics)
    if run_dir != args.run_dir and not args.json:
        print(f"the latest run in {args.run_dir}: {run_dir}")
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    from rich.console import Console

    from ..observe.monitor import summary_table

    console = Console()
    for label, s in out["summaries"].items():
        console.print(summary_table(s, title=label))
        if out["evals"].get(label):
            console.print(
                "eval loss: " + ", ".join(f"step {st}: {v:.4f}" for st, v in out["evals"][label])
            )
    for note in out["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")
    console.print(f"wrote {len(out['pngs'])} plots and {out['markdown']}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="plots and a Markdown summary from a run's logs")
    p.add_argument(
        "run_dir",
        nargs="?",
        default="runs",
        help="a run directory written by `ampkit train` (or its log.jsonl), or a "
        "directory of runs: its latest (default: runs, where ampkit train writes them)",
    )
    flag(
        p,
        "compare",
        nargs="+",
        default=None,
        metavar="RUN_DIR",
        help="overlay these runs (e.g. fp32 vs bf16)",
    )
    flag(p, "out", default=None, help="where to write (default: RUN_DIR/report)")
    flag(p, "metrics", default=None, help="comma-separated subset of: loss, scale, speed, memory")
    flag(p, "json", action="store_true", help="print paths and summaries as JSON")
    p.set_defaults(func=cmd_report)
