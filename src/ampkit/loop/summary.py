"""What a training run did, read once at the end: :class:`TrainSummary`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["TrainSummary"]


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
    micro_batch: Optional[int] = None  # samples per forward/backward (after batch_size='auto' or an OOM)
    notes: list[str] = field(default_factory=list)  # choices made for the user (auto batch, OOM rebatch, ...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
