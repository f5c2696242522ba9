"""The one way ampkit runs training steps: the loss of a batch, one optimizer step, n steps.

Every loop in :mod:`ampkit.loop` trains through :class:`Steps` -- the :class:`Trainer`, ``bench``'s
side-by-side runs, ``auto``'s measurement and the memory estimate -- so they all do exactly what
the engine's happy path does, in the same order::

    with amp.autocast():
        loss = loss_fn(model, batch)
    amp.backward(loss)
    amp.step(optimizer)

Nothing here reads the device: losses are returned as device tensors (detached), results as the
engine's :class:`~ampkit.step.events.StepResult`. Batches are fetched one at a time, in index
order, just before their forward pass (a batch function that draws from a global generator sees
the same interleaving as a hand-written loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..models.data import split_batch
from ..step.engine import MixedPrecision
from ..step.events import StepResult

__all__ = ["LossFn", "StepOutcome", "Steps", "batch_loss"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def batch_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss of ``batch``: ``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list,
    else ``model(batch)``. Built-in models (and factories' models) return their loss this way."""
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step left: the engine's result for its last micro-step (the boundary)
    and every micro-batch's loss, detached, on the device (not read)."""

    result: Optional[StepResult]
    losses: tuple[torch.Tensor, ...]

    def mean_loss(self) -> torch.Tensor:
        """The step's loss: the mean of its micro-batches' losses in fp32 (a device tensor, no sync)."""
        total = None
        for loss in self.losses:
            total = loss.float() if total is None else total + loss.float()
        assert total is not None, "an optimizer step has at least one micro-batch"
        return total / len(self.losses)


@dataclass(frozen=True, eq=False)
class Steps:
    """Train ``model`` with ``optimizer`` under ``amp``; ``loss_fn(model, batch)`` is the loss.

    ``model`` and ``optimizer`` are the ones ``amp.setup`` returned. Each method runs the engine's
    four calls and nothing else, so a loop built from it is bitwise the loop a user would write by
    hand with ``torch.autocast`` and ``torch.amp.GradScaler``. No method syncs with the device.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    amp: MixedPrecision
    loss_fn: LossFn = batch_loss

    def forward_backward(self, batch: Any) -> torch.Tensor:
        """Forward ``batch`` under ``amp.autocast()`` and ``amp.backward`` its loss; no optimizer
        step. Returns the loss, detached."""
        with self.amp.autocast():
            loss = self.loss_fn(self.model, batch)
        self.amp.backward(loss)
        return loss.detach()

    def micro_step(self, batch: Any) -> tuple[torch.Tensor, StepResult]:
        """:meth:`forward_backward`, then ``amp.step``: an optimizer step when the micro-step ends
        an accumulation window. Returns the detached loss and the engine's result."""
        loss = self.forward_backward(batch)
        return loss, self.amp.step(self.optimizer)

    def optimizer_step(
        self,
        batches: Callable[[int], Any],
        start: int,
        *,
        count: int = 1,
        split: int = 1,
        index: Optional[Callable[[int], int]] = None,
        on_batch: Optional[Callable[[int, Any], None]] = None,
    ) -> StepOutcome:
        """One optimizer step from ``count`` batches, ``batches(index(start))`` onwards (``index``
        maps a data position to a batch index; default the position itself), each cut into
        ``split`` micro-batches. ``amp``'s accumulation must be ``count * split`` for the window to
        end on the last one. ``on_batch(k, batch)`` sees the ``k``-th batch before its forward."""
        losses = []
        result = None
        for k in range(count):
            position = start + k
            batch = batches(index(position) if index is not None else position)
            if on_batch is not None:
                on_batch(k, batch)
            for piece in split_batch(batch, split):
                loss, result = self.micro_step(piece)
                losses.append(loss)
        return StepOutcome(result, tuple(losses))

    def eval_loss(
        self, batches: Callable[[int], Any], count: int, context: Callable[[], Any]
    ) -> torch.Tensor:
        """The mean loss of ``batches(0 .. count-1)`` under ``context()`` (e.g. ``amp.autocast``),
        in eval mode and without gradients (the model's mode is restored). A device tensor, not read."""
        was_training = self.model.training
        self.model.eval()
        losses = []
        try:
            with torch.no_grad():
                for i in range(count):
                    with context():
                        losses.append(self.loss_fn(self.model, batches(i)).detach().float())
        finally:
            self.model.train(was_training)
        return torch.stack(losses).mean()

    def run(
        self, batches: Callable[[int], Any], steps: int, *, start: int = 0, count: int = 1
    ) -> tuple[list[torch.Tensor], int]:
        """``steps`` optimizer steps of ``count`` batches each, from ``batches(start)`` on. Returns
        each step's mean loss (:meth:`StepOutcome.mean_loss`, device tensors) and the next batch index."""
        means = []
        for _ in range(steps):
            means.append(self.optimizer_step(batches, start, count=count).mean_loss())
            start += count
        return means, start
