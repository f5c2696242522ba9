"""What a training run did, read once at the end: :class:`TrainSummary`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..step.precision import REGISTRY

__all__ = ["TrainSummary", "opt_level"]


@dataclass
class TrainSummary:
    """What a run did, read once at the end."""

    precision: str
    device: str
    optimizer_steps: int
    skipped_steps: int
    final_loss: float
    first_loss: float
    ms_per_step: float
    samples_per_s: float
    tokens_per_s: Optional[float]
    final_scale: Optional[float]
    losses: list[float] = field(default_factory=list)
    log_dir: Optional[str] = None
    peak_mem_bytes: Optional[int] = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (optimizer step, loss)
    run_id: Optional[str] = None
    world_size: int = 1  # processes that trained together (throughput counts all of them)
    micro_batch: Optional[int] = (
        None  # samples per forward/backward (after batch_size='auto' or an OOM)
    )
    notes: list[str] = field(
        default_factory=list
    )  # choices made for the user (auto batch, OOM rebatch, ...)
    #: one dict per epoch completed in this fit(): epoch, loss, steps, samples, seconds, samples_per_s
    epochs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_run(
        cls,
        stats: dict[str, Any],
        summary: dict[str, Any],
        records: list[dict[str, Any]],
        events: list[dict[str, Any]],
        **run: Any,
    ) -> TrainSummary:
        """From the engine's ``stats()``, the monitor's closing ``summary``, its step ``records`` and
        ``events``; ``run`` gives the rest (``log_dir``, ``run_id``, ``world_size``, ...)."""
        losses = [r["loss"] for r in records]
        return cls(
            precision=stats["precision"],
            device=stats["device"],
            optimizer_steps=stats["optimizer_steps"],
            skipped_steps=stats["skipped_steps"],
            final_loss=_f(losses[-1]),
            first_loss=_f(losses[0]),
            ms_per_step=summary["step_time_ms_median"] or 0.0,
            samples_per_s=summary["samples_per_s"] or 0.0,
            tokens_per_s=summary["tokens_per_s"],
            final_scale=stats["scale"],
            losses=[_f(v) for v in losses],
            peak_mem_bytes=summary["peak_mem_bytes"],
            eval_losses=[(e["step"], e["loss"]) for e in events if e.get("kind") == "eval"],
            epochs=[{k: e.get(k) for k in _EPOCH} for e in events if e.get("kind") == "epoch"],
            **run,
        )


def opt_level(precision: str) -> str:
    """The apex opt level a precision amounts to, for run headers: ``O0`` (fp32), ``O1`` (autocast:
    bf16, fp16), ``O2`` (half weights with fp32 masters: ``*-pure``); tf32 and fp8 have none (``-``)."""
    return REGISTRY[precision].opt_level if precision in REGISTRY else "-"


_EPOCH = ("epoch", "step", "loss", "steps", "samples", "seconds", "samples_per_s")


def _f(v: Optional[float]) -> float:
    return math.nan if v is None else float(v)
