"""Per-epoch figures: the epoch's mean loss, its time and its throughput, one ``epoch`` record each.

The losses are summed on the device as the steps go (no sync); the sum is read once, when the
epoch ends (the ``epoch`` record's one host read). A checkpoint inside an epoch carries the
partial sums, so a resumed run writes the same loss for that epoch as an uninterrupted one (its
``seconds`` are the time trained in it, both runs together).
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

__all__ = ["EpochLog"]


class EpochLog:
    """Sums of the current epoch (loss, steps, samples, seconds), closed into one record per epoch."""

    def __init__(self) -> None:
        self.loss_sum: Optional[torch.Tensor] = None
        self.steps = 0
        self.samples = 0
        self.seconds = 0.0  # trained in this epoch before the current timing started (a resume)
        self._started: Optional[float] = None
        self.records: list[dict[str, Any]] = []

    def start(self) -> None:
        """Start (or restart, after a resume) the clock of the current epoch."""
        self._started = time.perf_counter()

    def add(self, loss: torch.Tensor, samples: Optional[int]) -> None:
        """One optimizer step's mean loss (a device tensor; not read) and its samples."""
        if self._started is None:
            self.start()
        loss = loss.detach().float()
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.steps += 1
        self.samples += samples or 0

    def _elapsed(self) -> float:
        return self.seconds + (
            time.perf_counter() - self._started if self._started is not None else 0.0
        )

    def close(self, epoch: int, world_size: int = 1) -> dict[str, Any]:
        """The record of ``epoch`` (``epoch``, ``loss``, ``steps``, ``samples``, ``seconds``,
        ``samples_per_s``; samples counted on every rank), then start the next one. **Syncs** once."""
        seconds = self._elapsed()
        loss = (
            float(self.loss_sum) / self.steps if self.loss_sum is not None and self.steps else None
        )
        samples = self.samples * world_size
        record = {
            "epoch": epoch,
            "loss": loss,
            "steps": self.steps,
            "samples": samples,
            "seconds": seconds,
            "samples_per_s": samples / seconds if samples and seconds > 0 else None,
        }
        self.records.append(record)
        self.loss_sum, self.steps, self.samples, self.seconds = None, 0, 0, 0.0
        self.start()
        return record

    def state_dict(self) -> dict[str, Any]:
        """The current epoch's partial sums (**syncs**: reads the loss sum)."""
        return {
            "loss_sum": float(self.loss_sum) if self.loss_sum is not None else None,
            "steps": self.steps,
            "samples": self.samples,
            "seconds": self._elapsed(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        total = state.get("loss_sum")
        self.loss_sum = torch.tensor(total, dtype=torch.float32) if total is not None else None
        self.steps = int(state.get("steps", 0))
        self.samples = int(state.get("samples", 0))
        self.seconds = float(state.get("seconds", 0.0))
        self._started = None
