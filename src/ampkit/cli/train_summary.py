"""What ``ampkit train`` says as it ends: a line per completed epoch, the summary (or ``--json``),
and whether the run failed numerically."""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from ..distributed import is_main
from ..step.engine import MixedPrecision
from ..step.rung import Rung, join_spec
from .invocation import TrainInvocation

__all__ = ["EpochLines", "duration", "json_safe", "numerical_failure", "print_summary", "running"]


class EpochLines:
    """A Trainer callback that prints each completed epoch on one line (the Trainer closes an
    epoch's record before ``on_step_end``); ``total``: ``--epochs``, shown as ``epoch i/N``."""

    def __init__(self, console: Any, total: Optional[int]) -> None:
        self.console, self.total, self.shown = console, total, 0

    def on_step_end(self, trainer: Any, step: int, result: Any) -> None:
        records = trainer.epochs.records
        for r in records[self.shown :]:
            loss = f"{r['loss']:.4f}" if r["loss"] is not None else "—"
            speed = f" · {r['samples_per_s']:,.0f} samples/s" if r["samples_per_s"] else ""
            self.console.print(
                f"epoch {r['epoch'] + 1}{f'/{self.total}' if self.total else ''} · {r['steps']} "
                f"steps · mean loss {loss} · {r['seconds']:.1f} s{speed}"
            )
        self.shown = len(records)


def print_summary(
    run: TrainInvocation,
    console: Any,
    amp: MixedPrecision,
    summary: Any,
    log_dir: str,
    why: str,
    failure: Optional[str],
    model_path: Optional[str],
    seconds: float,
) -> None:
    args = run.args
    if args.json:
        if is_main():
            out = {k: v for k, v in summary.to_dict().items() if k != "losses"}
            out.update(
                model=args.model,
                size=args.size,
                batch_size=args.batch_size,
                batch_reason=run.batch_reason,
                accumulation_steps=amp.config.accumulation_steps,
                precision_spec=running(amp),
                precision_reason=why,
                failure=failure,
                model_path=model_path,
                seconds=seconds,
            )
            print(json.dumps(json_safe(out), indent=2, allow_nan=False))
        return
    for e in amp.events:
        if e.kind == "fallback":
            src, dst = (
                e.data.get("from_rung") or e.data["from"],
                e.data.get("to_rung") or e.data["to"],
            )
            console.print(
                f"[yellow]fell back[/] {src} → {dst} at step {e.step}: {e.data['reason']}"
            )
        elif e.kind == "fallback_retry":
            console.print(
                f"[yellow]retried[/] {e.data.get('from')} → {e.data.get('to')} at step {e.step}"
            )
    here = len(summary.losses)  # this process's steps (a resumed run did the others before)
    took = (
        f"in {duration(seconds)}"
        if here >= summary.optimizer_steps
        else f"({here} in this process, {duration(seconds)})"
    )
    console.print(
        f"{summary.optimizer_steps} steps {took} · ms/step {summary.ms_per_step:.1f}"
        + (f" · tokens/s {summary.tokens_per_s:,.0f}" if summary.tokens_per_s else "")
        + f" · final loss {summary.final_loss:.4f} · skipped steps {summary.skipped_steps}"
    )
    if summary.eval_losses:
        console.print(
            "eval loss: " + ", ".join(f"step {s}: {v:.4f}" for s, v in summary.eval_losses)
        )
    console.print(f"run written to [bold]{log_dir}[/]; plots: [bold]ampkit report {log_dir}[/]")


def running(amp: MixedPrecision) -> str:
    """The precision that runs as the header, the resume line, the run directory and ``--json``'s
    ``precision_spec`` name it: with its rung of bf16-pure's ladder (``bf16-pure:split``) unless
    the rung is the plain one."""
    rung = Rung.of(amp.config)
    return join_spec(amp.precision.name, None if rung.plain else rung)


def duration(seconds: float) -> str:
    """``42.1 s``, ``3 min 05 s``, ``2 h 03 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def numerical_failure(summary: Any, steps: int, skipped: int, diagnosis: Any) -> Optional[str]:
    """Why this run cannot count as a success (every step skipped, or a non-finite final loss)."""
    problem = None
    if steps and skipped >= steps:
        problem = f"all {steps} optimizer steps of this run were skipped (non-finite gradients)"
    elif not math.isfinite(summary.final_loss):
        problem = f"the final loss is {summary.final_loss} after {summary.optimizer_steps} steps"
    if problem and diagnosis:
        problem += f"; diagnosis: {diagnosis}"
    elif problem:
        problem += (
            "; run with the diagnosis on (no --no_diagnose) or `ampkit audit` to find the layer"
        )
    return problem


def json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: they become null (``json.dumps(allow_nan=False)`` then guards it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
