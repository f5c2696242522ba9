"""A small training loop composed from the engine: what ``ampkit train`` runs.

Reads top to bottom: take batch ``i``, forward under ``amp.autocast()``, ``amp.backward``,
``amp.step``. Losses stay on the device and are read to the host only every ``log_every``
optimizer steps, so the loop adds no per-step host sync of its own.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch

from .engine import MixedPrecision

__all__ = ["TrainSummary", "Trainer"]

BatchFn = Callable[[int], Any]


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """Built-in models return their loss when given ``(inputs, targets)``."""
    x, y = batch
    return model(x, y)


class Trainer:
    """Train ``model`` with ``amp`` on ``batches`` (a function from batch index to batch).

    Args:
        model, optimizer: already passed through ``amp.setup``.
        batches: ``batches(i)`` returns micro-batch ``i``; may expose ``samples_per_batch`` and
            ``tokens_per_batch`` for throughput figures.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``; default ``model(x, y)``.
        log_every: read losses to the host every this many optimizer steps (the only syncs).
        progress: show a rich progress bar with live loss, scale and throughput.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        amp: MixedPrecision,
        batches: BatchFn,
        *,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = _default_loss,
        log_every: int = 10,
        progress: bool = True,
        warmup_steps: int = 3,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every={log_every} must be >= 1")
        self.model, self.optimizer, self.amp = model, optimizer, amp
        self.batches, self.loss_fn = batches, loss_fn
        self.log_every, self.progress, self.warmup_steps = log_every, progress, warmup_steps
        self.micro_index = 0  # the data position: index of the next micro-batch

    def fit(self, steps: int) -> TrainSummary:
        """Run ``steps`` optimizer steps (each ``accumulation_steps`` micro-batches)."""
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        amp, accum = self.amp, self.amp.config.accumulation_steps
        pending: list[torch.Tensor] = []
        losses: list[float] = []
        step_times: list[float] = []
        bar = _Progress(steps, self.progress)
        self.model.train()
        t_start = t_last = time.perf_counter()
        t_measured = None
        with bar:
            for step in range(steps):
                step_loss = None
                for _ in range(accum):
                    batch = self.batches(self.micro_index)
                    self.micro_index += 1
                    with amp.autocast():
                        loss = self.loss_fn(self.model, batch)
                    amp.backward(loss)
                    amp.step(self.optimizer)
                    step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
                assert step_loss is not None
                pending.append(step_loss / accum)
                now = time.perf_counter()
                step_times.append(now - t_last)
                t_last = now
                if step + 1 == self.warmup_steps:
                    _sync(amp.device)
                    t_measured = (time.perf_counter(), step + 1)
                if (step + 1) % self.log_every == 0 or step + 1 == steps:
                    losses.extend(torch.stack(pending).float().tolist())  # the one sync per log interval
                    pending.clear()
                    bar.update(step + 1, losses[-1], amp, self._throughput(step_times))
        _sync(amp.device)
        t_end = time.perf_counter()
        if t_measured is not None and steps > t_measured[1]:
            ms = (t_end - t_measured[0]) / (steps - t_measured[1]) * 1e3
        else:
            ms = (t_end - t_start) / steps * 1e3
        stats = amp.stats()
        samples = getattr(self.batches, "samples_per_batch", None)
        tokens = getattr(self.batches, "tokens_per_batch", None)
        return TrainSummary(
            precision=stats["precision"], device=stats["device"], optimizer_steps=stats["optimizer_steps"],
            skipped_steps=stats["skipped_steps"], final_loss=losses[-1], first_loss=losses[0],
            ms_per_step=ms,
            samples_per_s=(samples * accum / (ms / 1e3)) if samples else 0.0,
            tokens_per_s=(tokens * accum / (ms / 1e3)) if tokens else None,
            final_scale=stats["scale"], losses=losses,
        )

    def _throughput(self, step_times: list[float]) -> Optional[float]:
        tokens = getattr(self.batches, "tokens_per_batch", None)
        recent = step_times[-self.log_every:]
        if not tokens or not recent:
            return None
        return tokens * self.amp.config.accumulation_steps / statistics.median(recent)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Progress:
    """A rich progress bar with live loss / scale / throughput, or nothing when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total = enabled, total
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )
            self._p = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                               TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
            self._task = self._p.add_task("train", total=total, info="")

    def __enter__(self) -> _Progress:
        if self.enabled:
            self._p.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._p.__exit__(*exc)

    def update(self, step: int, loss: float, amp: MixedPrecision, tokens_per_s: Optional[float]) -> None:
        if not self.enabled:
            return
        info = f"loss {loss:.4f}"
        if amp.precision.needs_scaler and amp.scaler.scale_tensor is not None:
            info += f"  scale {amp.scaler.scale_tensor.item():.0f}"
        if tokens_per_s:
            info += f"  {tokens_per_s:,.0f} tok/s"
        self._p.update(self._task, completed=step, info=info)
