"""What the integrations share: building the engine, reading a step's outcome, a skip-aware scheduler."""

from __future__ import annotations

import importlib
from typing import Any, Optional, Union

import torch

from ..step.engine import MixedPrecision, StepResult
from ..step.precision import Precision

__all__ = ["SkipAwareScheduler", "make_engine", "require", "skipped", "stepped_params"]


def require(module: str, extra: str, what: str) -> Any:
    """Import ``module`` or raise an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f'{what} needs the {module.split(".")[0]} package: pip install "ampkit[{extra}]"'
        ) from e


def make_engine(
    precision: Union[str, torch.dtype, Precision, None],
    amp: Optional[MixedPrecision],
    device: Union[str, torch.device, None],
    overrides: dict[str, Any],
) -> MixedPrecision:
    """``amp`` as given, or a new engine for ``precision`` on ``device``; refuses both at once."""
    if amp is not None:
        if not isinstance(amp, MixedPrecision):
            raise TypeError(f"amp must be an ampkit.MixedPrecision, got {type(amp).__name__}")
        if precision is not None or overrides:
            raise ValueError(
                "pass either amp=MixedPrecision(...) or a precision with settings, not both "
                f"(got precision={precision!r} and {sorted(overrides)})"
            )
        return amp
    return MixedPrecision(precision, device=device, **overrides)


def skipped(result: StepResult) -> bool:
    """True when the optimizer step of ``result`` (an accumulation boundary) was skipped for
    non-finite gradients. **Syncs** (reads ``found_inf``), as ``torch.amp.GradScaler.step`` does
    for optimizers that are not fused."""
    return result.boundary and result.skipped


def stepped_params(amp: MixedPrecision, model: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors the optimizer steps for ``model``'s parameters, in model order: the fp32
    masters for the pure precisions (their gradients are the ones to clip), else the parameters."""
    policy = amp.policy
    params = list(model.parameters())
    settle = policy.before_step
    if settle is not None:  # gradients kept in bf16 (the ladder) made fp32: the ones to clip or log
        settle(False)
    return [policy.stepped(p) for p in params] if policy.keeps_masters else params


class SkipAwareScheduler:
    """A learning-rate scheduler whose ``step()`` does nothing right after a skipped optimizer step.

    Everything else (``get_last_lr``, ``state_dict``, ``last_epoch``, ...) is the wrapped
    scheduler's: a skipped step leaves the schedule where it was, as ampkit's own Trainer does.
    ``was_skipped`` is a function returning whether the last optimizer step was skipped.
    """

    def __init__(self, scheduler: Any, was_skipped: Any) -> None:
        self.scheduler = scheduler
        self._was_skipped = was_skipped

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self._was_skipped():
            self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only reached for names this class does not define
        return getattr(self.__dict__["scheduler"], name)
