"""What ``torch.amp.GradScaler.step`` hands an optimizer that does its own AMP bookkeeping
(``_step_supports_amp_scaling``: fused Adam/AdamW/SGD, or a custom one), as
:class:`~ampkit.step.scaler.LossScaler` hands it the same.

Two protocols, as torch: an optimizer whose ``step`` takes a ``grad_scaler`` argument is handed
the scaler itself (deprecated in torch, with a ``FutureWarning``) and does its own unscaling and
checking; any other gets ``grad_scale`` and ``found_inf`` attributes for the step, a
``grad_scale`` already set on it multiplied by the loss scale.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Optional

import torch

__all__ = ["grad_scale_for", "takes_grad_scaler"]


@functools.cache
def _step_takes_grad_scaler(optimizer_type: type) -> bool:
    try:
        return "grad_scaler" in inspect.signature(optimizer_type.step).parameters
    except (TypeError, ValueError):  # no signature to read (a C function)
        return False


def takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes ``grad_scaler`` (asked once per type); if so, warns as
    GradScaler does: the scaler is then passed as that argument."""
    if not _step_takes_grad_scaler(type(optimizer)):
        return False
    warnings.warn(
        f"{type(optimizer).__name__}.step takes a grad_scaler argument: the scaler is passed as "
        "it (GradScaler's deprecated protocol); read the grad_scale and found_inf attributes instead",
        FutureWarning,
        stacklevel=3,
    )
    return True


def grad_scale_for(
    optimizer: torch.optim.Optimizer, scale: torch.Tensor, *, unit: bool, unscaled: bool
) -> Optional[torch.Tensor]:
    """The ``grad_scale`` to set on ``optimizer`` for its step: the loss ``scale`` times a
    ``grad_scale`` the caller already set there; only the latter once the gradients were unscaled
    (or for a unit scale, where there is nothing to unscale); None when neither applies."""
    preset = getattr(optimizer, "grad_scale", None)
    if unscaled or unit:
        return preset
    return scale if preset is None else scale * preset
