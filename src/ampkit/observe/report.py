"""Plots and a Markdown summary from runs' JSONL logs (``ampkit report RUN_DIR [--compare RUN ...]``)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from .monitor.sinks import read_jsonl
from .monitor.summary import summarize
from .plots import pyplot

__all__ = ["METRICS", "Run", "load_run", "make_report", "save_figure"]

METRICS = ("loss", "scale", "speed", "memory")
LOG_NAME = "log.jsonl"
FIGSIZE, DPI = (8.0, 4.5), 100  # 800 x 450 px


@dataclass
class Run:
    """One run's log: step records and events, and a label for legends."""

    path: str
    label: str
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]
    run_id: Optional[str] = None
    notes: tuple[str, ...] = ()

    @property
    def summary(self) -> dict[str, Any]:
        return summarize(self.steps, self.events)


def load_run(path: str, label: Optional[str] = None) -> Run:
    """Read a run directory (its ``log.jsonl``) or a JSONL file. Clear errors when there is none."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"run directory {path!r} does not exist")
    log = os.path.join(path, LOG_NAME) if os.path.isdir(path) else path
    if not os.path.isfile(log):
        raise FileNotFoundError(
            f"{path!r} holds no {LOG_NAME}; pass a run directory written by "
            "`ampkit train --log_dir DIR` (or a .jsonl log file)"
        )
    records = read_jsonl(log)
    notes: tuple[str, ...] = ()
    run_ids = list(dict.fromkeys(r.get("run_id") for r in records if r.get("run_id")))
    run_id = run_ids[-1] if run_ids else None
    if len(run_ids) > 1:
        # Several runs appended to one log (a reused --log_dir): never merge them.
        records = [r for r in records if r.get("run_id") == run_id]
        notes = (
            f"{log} holds {len(run_ids)} runs ({', '.join(run_ids)}); showing the last one, {run_id}. "
            "Give each run its own --log_dir.",
        )
    steps = [r for r in records if r.get("type") == "step"]
    if not steps:
        raise ValueError(
            f"{log!r} holds no step records; was the run stopped before its first log interval?"
        )
    events = [r for r in records if r.get("type") == "event"]
    name = label or os.path.basename(
        os.path.normpath(path if os.path.isdir(path) else os.path.dirname(path) or path)
    )
    precisions = sorted({r.get("precision") for r in steps if r.get("precision")})
    return Run(
        path=path,
        label=f"{name} ({', '.join(precisions)})",
        steps=steps,
        events=events,
        run_id=run_id,
        notes=notes,
    )


def _parse_metrics(metrics: Optional[Sequence[str]]) -> list[str]:
    if not metrics:
        return list(METRICS)
    chosen = [m.strip() for m in metrics if m.strip()]
    unknown = [m for m in chosen if m not in METRICS]
    if unknown:
        raise ValueError(
            f"unknown metric(s) {', '.join(map(repr, unknown))}; known metrics: {', '.join(METRICS)}"
        )
    return chosen


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in run.steps:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _plot_loss(plt: Any, runs: list[Run], path: str) -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for run in runs:
        ax.plot(*_series(run, "loss"), label=run.label, linewidth=1.2)
        skipped = [
            (r["step"], r["loss"])
            for r in run.steps
            if r.get("skipped") and r.get("loss") is not None
        ]
        if skipped:
            ax.scatter(*zip(*skipped), marker="x", color="red", zorder=3, s=20)
        evals = _evals(run)
        if evals:
            ax.plot(*zip(*evals), marker="o", linestyle="--", label=f"{run.label} eval", zorder=3)
    ax.set(xlabel="optimizer step", ylabel="loss", title="training loss (dashed: held-out eval)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def save_figure(fig: Any, path: str) -> None:
    """``fig`` as the image ``path`` names, written atomically (a temporary file, then renamed): a
    report stopped halfway leaves the previous image or none, never a cut one."""
    root, ext = os.path.splitext(path)
    tmp = f"{root}.{os.getpid()}.tmp{ext}"  # (the extension tells matplotlib the format)
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _evals(run: Run) -> list[tuple[int, float]]:
    return [
        (e["step"], e["loss"])
        for e in run.events
        if e.get("kind") == "eval" and e.get("loss") is not None
    ]


def _plot_scale(plt: Any, runs: list[Run], path: str) -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    any_scale = False
    for run in runs:
        xs, ys = _series(run, "scale")
        if xs:
            any_scale = True
            line = ax.step(xs, ys, where="post", label=run.label)[0]
            ov = [
                (e["step"], e["scale_before"])
                for e in run.events
                if e.get("kind") == "overflow" and e.get("scale_before") is not None
            ]
            if ov:
                ax.scatter(
                    *zip(*ov),
                    marker="v",
                    color=line.get_color(),
                    edgecolor="red",
                    zorder=3,
                    label=f"{run.label}: overflow ({len(ov)})",
                )
    if any_scale:
        ax.set_yscale("log", base=2)
    else:
        ax.text(
            0.5,
            0.5,
            "no loss scaling in these runs (bf16/fp32)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set(
        xlabel="optimizer step",
        ylabel="loss scale",
        title="loss scale (▼ = overflow, step skipped)",
    )
    ax.grid(alpha=0.3)
    if any_scale:
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _plot_speed(plt: Any, runs: list[Run], path: str) -> None:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=FIGSIZE, dpi=DPI)
    for run in runs:
        a1.plot(*_series(run, "step_time_ms"), label=run.label, linewidth=1)
        key = "tokens_per_s" if any(r.get("tokens_per_s") for r in run.steps) else "samples_per_s"
        a2.plot(*_series(run, key), label=f"{run.label} [{key.split('_')[0]}/s]", linewidth=1)
    a1.set(xlabel="optimizer step", ylabel="ms", title="step time")
    a2.set(xlabel="optimizer step", ylabel="per second", title="throughput")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _plot_memory(plt: Any, runs: list[Run], path: str) -> None:
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    for run in runs:
        xs, ys = _series(run, "peak_mem_bytes")
        ax.plot(xs, [y / 2**20 for y in ys], label=run.label)
    ax.set(xlabel="optimizer step", ylabel="MiB", title="peak memory (CUDA allocated / CPU RSS)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


_PLOTS = {"loss": _plot_loss, "scale": _plot_scale, "speed": _plot_speed, "memory": _plot_memory}


def _markdown(runs: list[Run], pngs: list[str], extra: Sequence[str] = ()) -> str:
    cols = [
        ("precision", "precision", "{}"),
        ("steps", "steps", "{}"),
        ("final loss", "final_loss", "{:.4f}"),
        ("ms/step (median)", "step_time_ms_median", "{:.2f}"),
        ("ms/step (p90)", "step_time_ms_p90", "{:.2f}"),
        ("tokens/s", "tokens_per_s", "{:,.0f}"),
        ("samples/s", "samples_per_s", "{:,.0f}"),
        ("skipped", "skipped_steps", "{}"),
        ("overflow rate", "overflow_rate", "{:.2%}"),
        ("scale min/max/last", None, ""),
        ("peak MiB", "peak_mem_bytes", ""),
    ]
    lines = [
        "# ampkit run report",
        "",
        "| run | " + " | ".join(c[0] for c in cols) + " |",
        "| --- |" + " ---: |" * len(cols),
    ]
    for run in runs:
        s = run.summary
        cells = []
        for _, key, fmt in cols:
            if key is None:
                cells.append(
                    "/".join(
                        "—" if s[k] is None else f"{s[k]:g}"
                        for k in ("scale_min", "scale_max", "scale_last")
                    )
                )
            elif key == "peak_mem_bytes":
                cells.append(f"{s[key] / 2**20:,.1f}" if s.get(key) else "—")
            else:
                v = s.get(key)
                cells.append("—" if v is None else fmt.format(v))
        lines.append(f"| {run.label} | " + " | ".join(cells) + " |")
    evals = [(run.label, _evals(run)) for run in runs if _evals(run)]
    if evals:
        lines += [
            "",
            "## Held-out evaluation",
            "",
            "| run | step | eval loss |",
            "| --- | ---: | ---: |",
        ]
        lines += [
            f"| {label} | {step} | {loss:.4f} |" for label, pts in evals for step, loss in pts
        ]
    notes = [n for run in runs for n in run.notes] + list(extra)
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    events = [
        (run.label, e)
        for run in runs
        for e in run.events
        if e.get("kind") not in ("summary", "overflow", "eval")
    ]
    if events:
        lines += ["", "## Events", ""]
        for label, e in events:
            details = {
                k: v
                for k, v in e.items()
                if k not in ("schema_version", "type", "kind", "step", "time")
            }
            lines.append(
                f"- {label}, step {e['step']}: **{e['kind']}** {json.dumps(details, default=str)}"
            )
    if pngs:
        lines += ["", "## Plots", ""] + [
            f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs
        ]
    return "\n".join(lines) + "\n"


def make_report(
    run_dir: str,
    compare: Sequence[str] = (),
    out_dir: Optional[str] = None,
    metrics: Optional[Sequence[str]] = None,
) -> dict[str, Any]:
    """Write PNG plots and ``report.md`` for ``run_dir`` (overlaid with ``compare`` runs).

    Returns ``{"out_dir", "pngs", "markdown", "summaries", "evals", "notes"}``. Default ``out_dir``:
    ``RUN_DIR/report``. Without matplotlib, ``report.md`` and the summaries are written all the same
    and a note says how to get the plots. ``report.md`` is written beside and renamed into place.
    """
    chosen = _parse_metrics(metrics)
    runs = [load_run(run_dir)] + [load_run(p) for p in compare]
    labels = [r.label for r in runs]
    for i, r in enumerate(runs):  # disambiguate identical labels
        if labels.count(r.label) > 1:
            r.label = f"{r.label} #{i + 1}"
    extra: list[str] = []
    try:
        plt = pyplot()
    except ImportError as e:  # the summary needs no plots: write it, say how to get them
        plt, extra = None, [f"no plots: {e}"]
    base = run_dir if os.path.isdir(run_dir) else os.path.dirname(run_dir) or "."
    out = out_dir or os.path.join(base, "report")
    os.makedirs(out, exist_ok=True)
    pngs = []
    for m in chosen if plt is not None else ():
        path = os.path.join(out, f"{m}.png")
        _PLOTS[m](plt, runs, path)
        pngs.append(path)
    md_path = os.path.join(out, "report.md")
    tmp = f"{md_path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:  # beside it, then renamed: whole or the old one
        f.write(_markdown(runs, pngs, extra))
    os.replace(tmp, md_path)
    return {
        "out_dir": out,
        "pngs": pngs,
        "markdown": md_path,
        "summaries": {r.label: r.summary for r in runs},
        "evals": {r.label: _evals(r) for r in runs},
        "notes": [n for r in runs for n in r.notes] + extra,
    }
