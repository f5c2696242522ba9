"""``bf16`` and ``fp16``: fp32 weights, the forward under ``torch.autocast`` to the half dtype.

Nothing is cast ahead of time: autocast casts weights per op (cached within a forward unless
``autocast_cache=False``) and keeps its fp32-listed ops (softmax, norms, losses) in fp32. The
gradients and the optimizer step are fp32. fp16 needs loss scaling, which the engine's
:class:`~ampkit.step.scaler.LossScaler` does for every family that asks for it
(``Precision.needs_scaler``).
"""

from __future__ import annotations

import torch

from .base import PrecisionPolicy

__all__ = ["AutocastPolicy"]


class AutocastPolicy(PrecisionPolicy):
    """The forward under ``torch.autocast(device, dtype=compute_dtype)``: what a hand-written loop pays."""

    def forward_context(self) -> torch.autocast:
        return torch.autocast(
            self.device.type,
            dtype=self.precision.compute_dtype,
            cache_enabled=self.config.autocast_cache,
        )
