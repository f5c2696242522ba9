"""``ampkit report``: plots and a Markdown summary from a run's logs."""

from __future__ import annotations

import json
from typing import Any

from .common import flag
from .invocation import Invocation


def cmd_report(inv: Invocation) -> int:
    args = inv.args
    from ..observe.report import make_report

    metrics = args.metrics.split(",") if args.metrics else None
    out = make_report(args.run_dir, compare=args.compare or (), out_dir=args.out, metrics=metrics)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    from rich.console import Console

    from ..observe.monitor import summary_table

    console = Console()
    for label, s in out["summaries"].items():
        console.print(summary_table(s, title=label))
        if out["evals"].get(label):
            console.print("eval loss: " + ", ".join(f"step {st}: {v:.4f}" for st, v in out["evals"][label]))
    for note in out["notes"]:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"wrote {len(out['pngs'])} plots and {out['markdown']}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="plots and a Markdown summary from a run's logs")
    p.add_argument("run_dir", help="a run directory written by `ampkit train` (or its log.jsonl)")
    flag(p, "compare", nargs="+", default=None, metavar="RUN_DIR", help="overlay these runs (e.g. fp32 vs bf16)")
    flag(p, "out", default=None, help="where to write (default: RUN_DIR/report)")
    flag(p, "metrics", default=None, help="comma-separated subset of: loss, scale, speed, memory")
    flag(p, "json", action="store_true", help="print paths and summaries as JSON")
    p.set_defaults(func=cmd_report)
