"""What :meth:`ampkit.step.engine.MixedPrecision.backward` accepts as a loss, checked before any
gradient is touched, each refusal naming the likely mistake."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_loss"]


def check_loss(loss: Any) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``loss`` is a floating-point scalar tensor that requires grad."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"backward() expects the loss as a torch.Tensor, got {type(loss).__name__}")
    if not loss.is_floating_point():
        raise TypeError(
            f"backward() expects a floating-point loss, got dtype {loss.dtype}; "
            "did you pass labels or a count instead of the loss?"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"backward() expects a scalar loss, got shape {tuple(loss.shape)}; "
            "reduce it first (e.g. loss.mean())"
        )
    if not loss.requires_grad:
        raise ValueError(
            "backward() got a loss that does not require grad: it was computed under "
            "torch.no_grad() or detached, or the model has no trainable parameters"
        )
