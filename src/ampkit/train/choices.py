"""The Trainer's choices: ``auto`` precision confirmed by measurement and ``batch_size="auto"``
before the first step, and halving the micro-batch after an out-of-memory error (same effective
batch, same gradient math).

Functions of the :class:`~ampkit.train.trainer.Trainer` (``self``), kept out of its module so the
step loop there stays short.
"""

from __future__ import annotations

from typing import Any

import torch

from ..choose.autoselect import auto_decision, confirm_auto
from ..distributed import is_main
from ..models.data import batch_size
from ..plan.autobatch import choose_split, device_budget

__all__ = ["choose_batch", "confirm_auto_precision", "rebatch"]


def confirm_auto_precision(self: Any) -> None:
    """``auto`` settled by measurement before the first step (a no-op for other precisions,
    off the CPU, with several processes, and once decided: the CLI may have done it already)."""
    if auto_decision(self.amp) is not None:
        return
    sampled: list[Any] = []

    def batches(
        i: int,
    ) -> Any:  # drawn only if a measurement runs (an iterable: its first batches, cycled)
        if not sampled:
            sampled.append(self.source.as_function())
        return sampled[0](i)

    batches.batch_size = getattr(self.batches, "batch_size", None)  # type: ignore[attr-defined]
    console = self.settings.log.console if is_main() else None
    choice = confirm_auto(
        self.amp,
        self.model,
        batches,
        loss_fn=self.loss_fn,
        announce=console.print if console is not None else None,
    )
    if auto_decision(self.amp) is not None:
        self.notes.append(f"precision auto: {choice.reason}")
        if console is not None:
            console.print(f"precision auto: {choice.reason}")


def choose_batch(self: Any) -> None:
    """``batch_size='auto'``: cut each batch into the fewest micro-batches that fit (see ``autobatch``)."""
    budget = device_budget(self.amp.device, self.settings.batching.memory_budget)
    choice = choose_split(
        self.model,
        self.optimizer,
        self.amp.precision.name,
        self.amp.device,
        self.source.sample()[0],
        budget,
    )
    accum = self.amp.config.accumulation_steps // self.split
    self.split = choice.split
    self.amp.set_accumulation_steps(accum * choice.split)
    self.auto_batch, self.micro_batch = choice, choice.micro_batch
    self.notes.append(choice.reason)
    console = self.settings.log.console
    if console is not None and is_main():
        console.print(f"batch_size auto: {choice.reason}")


def rebatch(self: Any, error: BaseException, accum: int, monitor: Any) -> None:
    """After an out-of-memory error: free the window, halve the micro-batch, double the
    accumulation (same effective batch, same gradient math), record ``oom_rebatch``."""
    self.amp.discard_window()
    if self.amp.device.type == "cuda":
        torch.cuda.empty_cache()
    if not self._window_batches:
        raise error
    batch = self._window_batches[0]
    size = batch_size(batch) // self.split
    if size < 2:
        raise RuntimeError(
            f"out of memory even with a micro-batch of {size}: nothing left to split "
            f"({str(error).splitlines()[0][:200]})"
        ) from error
    self.split *= 2
    self.micro_batch = size // 2
    self.amp.set_accumulation_steps(accum * self.split)
    monitor.log_event(
        "oom_rebatch",
        micro_batch=batch_size(batch) // self.split,
        accumulation_steps=accum * self.split,
        error=str(error).splitlines()[0][:200],
    )
    self.notes.append(
        f"out of memory at step {self.amp.optimizer_steps + 1}: micro-batch halved to "
        f"{batch_size(batch) // self.split}, accumulation doubled to {accum * self.split}"
    )
