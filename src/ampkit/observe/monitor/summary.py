"""Summaries of a run's step records: a dict for machines, a rich table for people."""

from __future__ import annotations

import statistics
from typing import Any, Optional

import torch

__all__ = ["ERROR_EVENTS", "state_memory_saved", "summarize", "summary_table"]

# Events that are numerical errors (the run could not go on as configured); skipped steps count too.
ERROR_EVENTS = ("scale_exhausted", "fallback_exhausted")


def _pct(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(
    records: list[dict[str, Any]], events: Optional[list[dict[str, Any]]] = None
) -> dict[str, Any]:
    """Step time median/p90, throughput, overflow rate, skipped steps, scale statistics, peak memory;
    usage per precision (``steps_by_precision``, ``precision_usage``: the share of steps), and the
    error counts (``fallbacks``, ``errors``: skipped steps plus :data:`ERROR_EVENTS`).

    ``records`` are step records (``type == "step"``), e.g. ``Monitor.records`` or a JSONL log.
    The first step's time is left out of the timing figures (it includes warm-up).
    """
    steps = [r for r in records if r.get("type", "step") == "step"]
    events = events or []
    times = [r["step_time_ms"] for r in steps[1:] if r.get("step_time_ms") is not None]
    if not times:
        times = [r["step_time_ms"] for r in steps if r.get("step_time_ms") is not None]
    scales = [r["scale"] for r in steps if r.get("scale") is not None]
    losses = [r["loss"] for r in steps if r.get("loss") is not None]
    skipped = sum(1 for r in steps if r.get("skipped"))
    changes = sum(1 for a, b in zip(scales, scales[1:]) if a != b)
    median = statistics.median(times) if times else None

    def rate(key: str) -> Optional[float]:
        vals = [r[key] for r in steps[1:] if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {
        "steps": len(steps),
        "first_step": steps[0]["step"] if steps else None,
        "last_step": steps[-1]["step"] if steps else None,
        "precision": steps[-1]["precision"] if steps else None,
        "final_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "step_time_ms_median": median,
        "step_time_ms_p90": _pct(times, 0.9),
        "samples_per_s": rate("samples_per_s"),
        "tokens_per_s": rate("tokens_per_s"),
        "skipped_steps": skipped,
        "overflow_rate": skipped / len(steps) if steps else 0.0,
        "scale_min": min(scales) if scales else None,
        "scale_max": max(scales) if scales else None,
        "scale_last": scales[-1] if scales else None,
        "scale_changes": changes,
        "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0 for r in steps), default=None),
        "events": {
            k: sum(1 for e in events if e.get("kind") == k)
            for k in sorted({e.get("kind") for e in events if e.get("kind") != "summary"})
        },
        **_usage(steps, events, skipped),
    }


def _usage(
    steps: list[dict[str, Any]], events: list[dict[str, Any]], skipped: int
) -> dict[str, Any]:
    by: dict[str, int] = {}
    for r in steps:
        by[str(r.get("precision"))] = by.get(str(r.get("precision")), 0) + 1
    return {
        "steps_by_precision": by,
        "precision_usage": {k: v / len(steps) for k, v in by.items()},
        "fallbacks": sum(1 for e in events if e.get("kind") == "fallback"),
        "errors": skipped + sum(1 for e in events if e.get("kind") in ERROR_EVENTS),
    }


def state_memory_saved(amp: Any) -> Optional[int]:
    """Bytes of training state this run saves against the same run in fp32, predicted from the
    tensors it keeps: its parameters, their gradients as the step holds them (fp32 on fp32 masters,
    bf16 where the memory ladder keeps them: one micro-step a step), masters (fp32 copies, the
    ladder's remainders) and optimizer state, against 4 bytes per element of each in fp32. Negative
    where the run keeps more (``bf16-pure`` with fp32 masters: 18 against 16 bytes per parameter
    with AdamW). Autocast's saving is not here: it is in the activations, which only a measurement
    can tell (``ampkit plan`` / :func:`ampkit.observe.memory.activations`). None before ``setup()``."""
    model = getattr(amp, "model", None)
    if model is None:
        return None
    policy = getattr(amp, "policy", None)
    half_grads = getattr(policy, "before_step", None) is not None and (
        getattr(getattr(amp, "config", None), "accumulation_steps", 1) == 1
    )
    keeps_masters = bool(getattr(policy, "keeps_masters", False))
    saved = 0
    for p in model.parameters():
        if p.is_floating_point():
            grad = 2 if half_grads else 4 if keeps_masters else p.element_size()
            saved += p.numel() * (8 - p.element_size() - grad)
    own = {id(p) for p in model.parameters()}
    storages: dict[
        int, int
    ] = {}  # fp32 masters; the ladder's stand-ins (a shared scalar), remainders
    for t in [*amp.master_params(), *getattr(policy, "master_storage", list)()]:
        if id(t) not in own:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    saved -= sum(storages.values())
    for opt in getattr(amp, "optimizers", None) or []:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    saved += v.numel() * (4 - v.element_size())
    return saved


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.4g}{unit}"
    return f"{value}{unit}"


def summary_table(summary: dict[str, Any], title: str = "run summary") -> Any:
    """A rich Table of :func:`summarize`'s output."""
    from rich.table import Table

    t = Table(title=title, show_header=False)
    mem = summary.get("peak_mem_bytes")
    rows = [
        ("precision", summary.get("precision")),
        ("optimizer steps", summary.get("steps")),
        ("final loss", _fmt(summary.get("final_loss"))),
        (
            "step time median / p90",
            f"{_fmt(summary.get('step_time_ms_median'), ' ms')} / {_fmt(summary.get('step_time_ms_p90'), ' ms')}",
        ),
        ("samples/s", _fmt(summary.get("samples_per_s"))),
        ("tokens/s", _fmt(summary.get("tokens_per_s"))),
        (
            "skipped steps (overflow rate)",
            f"{summary.get('skipped_steps')} ({summary.get('overflow_rate', 0):.2%})",
        ),
        (
            "loss scale min / max / last",
            f"{_fmt(summary.get('scale_min'))} / {_fmt(summary.get('scale_max'))} / {_fmt(summary.get('scale_last'))}",
        ),
        ("scale changes", summary.get("scale_changes")),
        ("peak memory", f"{mem / 2**20:,.1f} MiB" if mem else "—"),
    ]
    if summary.get("steps_by_precision"):
        rows.append(
            (
                "steps by precision",
                ", ".join(
                    f"{k}: {v} ({summary['precision_usage'][k]:.0%})"
                    for k, v in summary["steps_by_precision"].items()
                ),
            )
        )
    rows.append(
        ("fallbacks / errors", f"{summary.get('fallbacks', 0)} / {summary.get('errors', 0)}")
    )
    saved = summary.get("memory_saved_bytes_predicted")
    if saved is not None:
        rows.append(("state memory saved vs fp32 (predicted)", f"{saved / 2**20:,.1f} MiB"))
    if summary.get("events"):
        rows.append(("events", ", ".join(f"{k}: {v}" for k, v in summary["events"].items())))
    for k, v in rows:
        t.add_row(k, str(v))
    return t
