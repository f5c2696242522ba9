"""What ``optimizer_in_backward=True`` refuses in a config, where the step could not be exact
(:mod:`ampkit.step.in_backward` for the feature; a leaf, so that the config can ask it)."""

from __future__ import annotations

from typing import Any

from .precision import REGISTRY

__all__ = ["config_rule"]

_WHY = " with optimizer_in_backward=True (or set optimizer_in_backward=False): "


def config_rule(cfg: Any) -> tuple[bool, str, Any, str]:
    """``(ok, field, value, allowed)`` for the config's ``_require``: accumulation over micro-steps,
    clipping by the global norm and loss scaling are refused with the optimizer in backward."""
    if not cfg.optimizer_in_backward:
        return True, "optimizer_in_backward", False, ""
    if cfg.accumulation_steps != 1:
        return (
            False,
            "accumulation_steps",
            cfg.accumulation_steps,
            "1" + _WHY + "a parameter is stepped when its "
            "gradient is final, so gradients cannot be summed over micro-steps",
        )
    if cfg.clip_grad_norm is not None:
        return (
            False,
            "clip_grad_norm",
            cfg.clip_grad_norm,
            "None" + _WHY + "the global norm needs every gradient before the first update",
        )
    row = REGISTRY.get(
        cfg.precision
    )  # (auto and O2 resolve later: the engine refuses what they become)
    if row is not None and row.needs_scaler:
        return (
            False,
            "precision",
            cfg.precision,
            "a precision without loss scaling (bf16, bf16-pure, fp32, tf32)"
            + _WHY
            + "an fp16 overflow cannot be undone once parameters were stepped in backward",
        )
    return True, "optimizer_in_backward", True, ""
