"""What the engine reports and saves: ``stats()``, ``state_dict()``, ``load_state_dict()``.

A mixin of :class:`~ampkit.step.engine.MixedPrecision` (it reads the engine's scaler, counters,
events and master weights); kept apart so the engine file holds the step itself.
"""

from __future__ import annotations

from typing import Any

import torch

from .accumulate import Window
from .config import MixedPrecisionConfig
from .events import Event
from .precision import resolve_precision

__all__ = ["StateMixin"]


class StateMixin:
    """Reading the engine's counters (these **sync**) and saving / restoring all of its state."""

    def stats(self) -> dict[str, Any]:
        """Precision, scale, steps, skipped steps, overflow rate, events. **Syncs** (reads device counters)."""
        overflows = self._scaler.overflow_count
        skipped = int(overflows.item()) if overflows is not None and self._scaler.is_enabled() else 0
        if self._skipped_before is not None:
            skipped += int(self._skipped_before.item())
        return {
            "precision": self.precision.name,
            "device": str(self.device),
            "scale": self._scaler.get_scale() if self.precision.needs_scaler else None,
            "optimizer_steps": self._steps,
            "skipped_steps": skipped,
            "overflow_rate": skipped / self._steps if self._steps else 0.0,
            "accumulation_steps": self.config.accumulation_steps,
            "pending_micro_steps": self._window.micro,
            "parallel": self._parallel.name,  # none / ddp / fsdp
            "world_size": self._parallel.world_size,
            "events": [e.to_dict() for e in self._stream.kept],
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: precision (after switches), config, scaler, counters, events. **Syncs**.

        Call between optimizer steps (not inside an accumulation window).
        """
        return {
            "precision": self.precision.name,
            "config": self.config.to_dict(),
            "scaler": self._scaler.state_dict(),
            "optimizer_steps": self._steps,
            "micro_steps": self._window.micro,
            "skipped_before": int(self._skipped_before.item()) if self._skipped_before is not None else 0,
            "events": [e.to_dict() for e in self._stream.kept],
            "masters": self._masters.state_dict() if self._masters is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Validates everything before changing anything."""
        if not isinstance(state, dict) or "precision" not in state or "config" not in state:
            raise ValueError("not a MixedPrecision state dict: expected keys 'precision', 'config', 'scaler', ...")
        cfg = MixedPrecisionConfig.from_dict(state["config"])
        new = resolve_precision(state["precision"], self.device_info, emulate_fp8=cfg.fp8_emulate)
        old_config, self.config = self.config, cfg
        try:
            scaler = self._make_scaler(new)
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
        except Exception:
            self.config = old_config
            raise
        self.precision, self._scaler = new, scaler
        self._steps = int(state.get("optimizer_steps", 0))
        before = int(state.get("skipped_before", 0))
        self._skipped_before = torch.tensor(float(before), device=self.device) if before else None
        self._window = Window(cfg.accumulation_steps)
        self._window.micro = int(state.get("micro_steps", 0))
        self._stream.kept = [Event(kind=e["kind"], step=e["step"],
                              data={k: v for k, v in e.items() if k not in ("kind", "step")})
                        for e in state.get("events", [])]
        self._fallback = self._make_fallback()
        self._build_contexts()
        if self._model is not None:
            self._retarget_weights()
            if self._masters is not None and state.get("masters"):
                self._masters.load_state_dict(state["masters"])

