"""What the engine tells the world: the result of a step and notable events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["KINDS", "Event", "EventStream", "StepResult"]

#: Notable event kinds recorded by ampkit itself, and who records them (docs/reference/jsonl-schema.md
#: lists their fields). Users may record any other kind with ``amp.record_event``.
KINDS: dict[str, str] = {
    "precision_switch": "amp.switch()",
    "fallback": "the engine's fallback chain",
    "fallback_exhausted": "the engine, at the end of the chain (before NumericsError)",
    "scale_exhausted": "the engine with the fallback off (before NumericsError)",
    "diagnosis": "amp.diagnose()",
    "manifest_violation": "the precision manifest's check (ampkit.step.manifest_check): a silent downgrade",
    "spike": "a SpikeGuard's rollback (ampkit.train.rollback): the step, its batches and the cause",
}


@dataclass(frozen=True)
class StepResult:
    """What :meth:`MixedPrecision.step` did. Reading the tensors does not sync; ``skipped`` does.

    Attributes:
        boundary: True when this call ended an accumulation window (an optimizer step was attempted).
        grad_norm: total norm of the unscaled gradients before clipping (0-d tensor), or None
            when not clipping or not a boundary.
        scale: the loss scale that this step's gradients were multiplied by (0-d tensor), or
            None when not a boundary.
        found_inf: 0-d tensor, > 0 when the gradients were non-finite and the step was skipped
            (None when not a boundary, or when non-finite checking is off).
    """

    boundary: bool
    grad_norm: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    found_inf: Optional[torch.Tensor] = None

    @property
    def skipped(self) -> bool:
        """True when the optimizer step was skipped for non-finite gradients. **Syncs** with the device."""
        return bool(self.found_inf is not None and self.found_inf.item() > 0)


@dataclass(frozen=True)
class Event:
    """A notable moment: ``kind`` (e.g. ``precision_switch``), the optimizer step, and details."""

    kind: str
    step: int
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, **self.data}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        """The inverse of :meth:`to_dict` (events restored from a state dict)."""
        return cls(
            kind=d["kind"],
            step=d["step"],
            data={k: v for k, v in d.items() if k not in ("kind", "step")},
        )


class EventStream:
    """Subscribers and the kept (notable) events. Per-step events reach subscribers only."""

    def __init__(self) -> None:
        self.kept: list[Event] = []
        self.subscribers: list[Callable[[Event], None]] = []

    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        self.subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self.subscribers:
                self.subscribers.remove(callback)

        return unsubscribe

    def emit(self, event: Event, record: bool = True) -> Event:
        if record:
            self.kept.append(event)
        for cb in list(self.subscribers):
            cb(event)
        return event
