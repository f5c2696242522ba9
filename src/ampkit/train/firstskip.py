"""The first skipped step of a run, diagnosed once per run.

The trainer learns about skipped steps from the monitor's batched reads (:class:`SkipWatch`, a
sink), so spotting the first one adds no per-step sync; it then re-runs that step's batch with
``MixedPrecision.diagnose``, which records a ``diagnosis`` event in the engine's state. A resumed
run takes the diagnosis back from the checkpoint's events (:func:`saved_diagnosis`) instead of
diagnosing again: one per run, however often it is resumed.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["RecentBatches", "SkipWatch", "saved_diagnosis"]


class SkipWatch:
    """A monitor sink that remembers the first skipped step (and its scale) it is shown."""

    def __init__(self) -> None:
        self.first: Optional[tuple[int, Optional[float]]] = None

    def write(self, records: list[dict[str, Any]]) -> None:
        if self.first is None:
            for r in records:
                if r["type"] == "step" and r.get("skipped"):
                    self.first = (r["step"], r.get("scale"))
                    return

    def close(self) -> None:
        pass


class RecentBatches:
    """The first micro-batch of each of the last ``keep`` optimizer steps: what a diagnosis re-runs
    (the monitor learns of a skip at its next read, within ``log_every`` steps)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.batches: dict[int, Any] = {}

    def remember(self, step: int, batch: Any) -> None:
        self.batches[step] = batch
        self.batches.pop(step - self.keep, None)

    def diagnose(
        self,
        step: int,
        scale: Optional[float],
        amp: Any,
        model: torch.nn.Module,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    ) -> Any:
        """Re-run ``step``'s batch with ``amp.diagnose`` (at the loss scale it had); False when the
        batch is no longer kept. Forgets every kept batch: one diagnosis per run."""
        batch = self.batches.get(step)
        self.batches.clear()
        if batch is None:
            return False

        def closure() -> torch.Tensor:
            with amp.autocast():
                return loss_fn(model, batch)

        was_training = model.training
        try:
            return amp.diagnose(closure, scale=scale)
        finally:
            model.train(was_training)


def saved_diagnosis(events: list[dict[str, Any]]) -> Any:
    """The run's first-skip diagnosis from its saved events (a resumed run does not diagnose again)."""
    import dataclasses

    from ..step.localize import NonFiniteReport

    known = {f.name for f in dataclasses.fields(NonFiniteReport)}
    for e in events:
        if isinstance(e, dict) and e.get("kind") == "diagnosis":
            try:
                return NonFiniteReport(**{k: v for k, v in e.items() if k in known})
            except TypeError:
                return None
    return None
