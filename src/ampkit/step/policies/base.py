"""The verbs every precision policy implements (Lightning Fabric's ``plugins/precision/`` is the model).

A policy is what one precision family does to the weights, the forward and the step. The engine
calls, in order:

* ``prepare(model, optimizers)`` at ``setup()`` or after a switch: casts, fp32 masters, fp8
  modules. ``release()`` undoes it (before a switch: the old policy releases, the new prepares).
* ``forward_context()`` for every forward (autocast, the fp32 matmul policy): returns a context.
* ``backward_context()``, asked once after ``prepare``: a reusable context entered around every
  ``loss.backward()`` (None: nothing to enter).
* ``after_backward(whole_window)`` after every backward (``whole_window``: that backward made a
  whole one-micro-step window, the step comes next), ``before_step(lean)`` at an accumulation
  boundary before anything reads the gradients (``lean``: the step only checks them -- no
  clipping, unscaling, flushing or data-parallel averaging), ``after_step`` after every optimizer
  step (skipped ones included) and ``end_step`` after the boundary's ``zero_grad``: callables, or
  None when the family has nothing to do there, so the engine pays nothing per step for them. All
  run on the hot path: no host sync.
* ``stepped(param)``: the tensor the optimizer steps for a model parameter (its master, or itself).
* ``state_dict()`` / ``load_state_dict()``: what a resume needs beyond the model and optimizer.
* ``describe()``: what it does to weights, compute and gradients (for the precision manifest).

The base is the plain fp32 behaviour: nothing to cast, no context to enter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from ..config import MixedPrecisionConfig
from ..overrides import match_modules
from ..precision import Precision

__all__ = ["PrecisionPolicy", "dtype_name"]


class PrecisionPolicy:
    """A precision family's verbs (module doc). Construction is cheap; ``prepare`` changes the model."""

    def __init__(
        self,
        precision: Precision,
        config: MixedPrecisionConfig,
        device: torch.device,
        *,
        shards_params: bool = False,
    ) -> None:
        self.precision = precision
        self.config = config
        self.device = device
        #: the parameters are fp32 shards (FSDP2): a pure precision keeps no second copy
        self.shards_params = shards_params

    # ------------------------------------------------------------------ the weights' form
    def prepare(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Give ``model`` (and ``optimizers``) the form this precision trains in. Between steps only."""

    def release(self) -> None:
        """Undo :meth:`prepare`: fp32 weights in the model and the optimizers, plain modules."""

    @property
    def keeps_masters(self) -> bool:
        """True when the optimizers step fp32 masters the model does not hold (DDP averages them itself)."""
        return False

    def stepped(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for the model parameter ``param``."""
        return param

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master weights (empty without masters)."""
        return []

    def full_precision_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's state dict in fp32 (the model's own here: its weights are fp32)."""
        return dict(model.state_dict())

    # ------------------------------------------------------------------ the step
    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """The context of a forward pass. No sync."""
        return contextlib.nullcontext()

    def backward_context(self) -> Optional[contextlib.AbstractContextManager[Any]]:
        """A reusable context for every ``loss.backward()``, or None. No sync."""
        return None

    #: Called after each backward with ``whole_window`` (e.g. half gradients into the masters'), or
    #: None. No sync.
    after_backward: Optional[Callable[[bool], None]] = None
    #: Called at a boundary before the gradients are read, with ``lean`` (the step only checks them:
    #: gradients a policy kept in the half dtype may stay so), or None. No sync.
    before_step: Optional[Callable[[bool], None]] = None
    #: A lean step's clipping, ``(params, max_norm) -> total norm`` as ``clip_grad_norm_`` (the
    #: ladder's kept bf16 gradients read as their fp32 upcasts), or None: torch's. No sync.
    clip_grad_norm: Optional[Callable[[list[torch.Tensor], float], torch.Tensor]] = None
    #: Called after each optimizer step, taken or skipped (e.g. the masters into the model), or None. No sync.
    after_step: Optional[Callable[[], None]] = None
    #: Called at the end of a boundary, after its ``zero_grad`` (or when a window is discarded), or
    #: None. No sync.
    end_step: Optional[Callable[[], None]] = None

    # ------------------------------------------------------------------ state and description
    def state_dict(self) -> dict[str, Any]:
        """What resuming needs beyond the model and optimizer state (empty: nothing)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after :meth:`prepare`)."""

    def describe(self) -> dict[str, Any]:
        """What this precision does to weights, compute and gradients (for the manifest)."""
        p = self.precision
        return {
            "precision": p.name,
            "family": p.family,
            "weights": dtype_name(p.param_dtype),
            "compute": dtype_name(p.compute_dtype),
            "grads": dtype_name(p.param_dtype),
            "optimizer_steps": "float32",
            "loss_scaling": p.needs_scaler,
        }

    # ------------------------------------------------------------------ helpers for the families
    def kept_names(self, model: torch.nn.Module) -> list[str]:
        """Qualified names of the modules ``keep_fp32`` keeps in fp32 (sorted)."""
        if not self.config.keep_fp32:
            return []
        return sorted(
            {n for names in match_modules(model, self.config.keep_fp32).values() for n in names}
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision.name!r})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
