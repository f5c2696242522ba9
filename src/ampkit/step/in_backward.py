"""The optimizer steps in backward (``optimizer_in_backward=True``): each parameter is stepped as
soon as its gradient is final, and the gradient is freed, so no full set of gradients is held.

How: a ``register_post_accumulate_grad_hook`` on every trained parameter of the model (PyTorch's
recipe, "How to save memory by fusing the optimizer step into the backward pass"). The hook runs
once per backward, after the parameter's gradient is fully accumulated (a weight used twice, e.g. a
tied embedding, included), and steps **the user's own optimizer** with its groups narrowed, for
that call, to the parameter's group holding that one parameter. Not one optimizer per parameter
(the recipe's ``{p: Adam([p])}``, or ``torch.distributed.optim._apply_optimizer_in_backward``): one
optimizer keeps the one ``state_dict`` (checkpoints resume as before), the learning-rate scheduler
writes the groups the step reads, optimizer hooks and the memory ladder's wrapped ``step`` run as
they do in an ordinary step. For the pure precisions the hook first moves the half gradient into
the master's fp32 gradient (the exact upcast the policy's ``after_backward`` makes), and the
engine's ``step()`` still runs the policy's ``after_step`` (the masters rounded into the model).

**Exact where the update of a parameter depends only on its own gradient and state** (SGD with or
without momentum, Adam, AdamW, Adagrad, RMSprop; per-tensor norms such as Adafactor's): the same
kernels on the same values, bitwise the ordinary step (tests/step/test_in_backward.py), for fp32,
bf16 autocast and bf16-pure with masters ``fp32``, ``split``, ``kahan`` and ``none``. With
``stochastic`` masters or ``state_dtype="bf16"`` each rounding is a stochastic rounding of the same
fp32 value, but the random bits are drawn in the order gradients become final (backward order)
instead of model order: within one bf16 spacing of the ordinary step, not bitwise. Refused where it
cannot be exact: accumulation over micro-steps, clipping by the global norm (both need every
gradient first) and fp16's loss scaling by the config (:mod:`.in_backward_rules`); optimizers that
need a closure, a precision ``auto`` resolved to fp16, DDP/FSDP at ``setup`` (:func:`refusal`).

**Non-finite gradients never reach the weights** (``skip_nonfinite``, the default). Each gradient
is checked before its parameter's update, and a non-finite loss is checked before the backward
starts; the first failure sets a flag that skips every update after it in this step, and the step
is reported skipped (``found_inf``, the scaler's skip count, the fallback's patience) as an ordinary
skipped step. The parameters stepped before the first non-finite gradient keep their finite update:
an undo would need a snapshot of the weights and states (4-12 B/param, more than the gradients this
saves) or a second backward (LOMO's two passes: ~1.6x the step measured on the CPU), so the step is
*partial*, never poisoned (docs/guides/will-it-fit.md, "The optimizer steps in backward"). With
fp16 overflowing is routine (the
dynamic scale probes upward), so partial steps would be too: refused there. On the CPU the decision
is read on the host (free); on a GPU a fused optimizer (``fused=True``) skips on the device from
``found_inf`` (no sync), another needs one sync per parameter.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from .config import ConfigError
from .gradcheck import check_and_unscale, cpu_all_finite
from .policies.base import PrecisionPolicy
from .precision import Precision
from .scaler import LossScaler

__all__ = ["InBackward", "refusal"]


def refusal(
    precision: Precision, optimizers: Sequence[torch.optim.Optimizer], parallel: str
) -> Optional[str]:
    """Why the optimizer cannot step in backward here (a sentence naming the value, the reason and
    what is valid), or None. The config refuses what it alone shows (accumulation, clipping)."""
    if precision.needs_scaler:
        return (
            f"optimizer_in_backward with precision {precision.name!r} (dynamic loss scaling) is refused: an "
            "overflowing step is routine there and cannot be undone once parameters were stepped in "
            "backward; use bf16, bf16-pure (any masters), fp32 or tf32, or optimizer_in_backward=False"
        )
    if parallel != "none":
        return (
            f"optimizer_in_backward under {parallel.upper()} is refused: the gradients are reduced across "
            "ranks after their hooks run, so a parameter would be stepped on its local gradient; "
            "use optimizer_in_backward=False"
        )
    for i, opt in enumerate(optimizers):
        closure = inspect.signature(type(opt).step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            return (
                f"optimizer_in_backward with optimizer {i} ({type(opt).__name__}) is refused: its step "
                "needs a closure (it re-evaluates the loss), which cannot run inside a backward; use an "
                "optimizer without a closure (SGD, Adam, AdamW, ...) or optimizer_in_backward=False"
            )
    return None


class InBackward:
    """Steps ``optimizers`` parameter by parameter inside the backward (module doc).

    :meth:`attach` after the policy prepared the model (setup, a switch); :meth:`start` before each
    backward; :meth:`finish` at the engine's ``step()``, in place of the ordinary optimizer step.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stepped: Callable[[torch.Tensor], torch.Tensor] = lambda p: p
        self._where: dict[
            int, tuple[torch.optim.Optimizer, dict[str, Any]]
        ] = {}  # id(stepped) -> its group
        self._check = True
        self._found: Optional[torch.Tensor] = (
            None  # 1.0 once a non-finite loss or gradient was seen this step
        )
        self._one: Optional[torch.Tensor] = None
        self._armed = (
            False  # inside the engine's backward: other backward passes (diagnose) step nothing
        )
        self._queued = False

    def attach(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        precision: Precision,
        policy: PrecisionPolicy,
        parallel: str,
        scaler: LossScaler,
    ) -> None:
        """Hook every parameter of ``model`` that requires grad, once the policy prepared it (its
        ``stepped`` names the tensor the optimizer steps); ``parallel`` is the adapter's name; the
        finite check runs where ``scaler`` is enabled (``skip_nonfinite``). Raises
        :class:`ConfigError` where the step cannot be exact, before any hook is placed."""
        why = refusal(precision, optimizers, parallel)
        if why is not None:
            raise ConfigError(why)
        self.detach()
        self._optimizers, self._stepped, self._check = (
            list(optimizers),
            policy.stepped,
            scaler.is_enabled(),
        )
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def detach(self) -> None:
        """Remove the hooks (the next backward accumulates gradients as usual)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def start(self, loss: torch.Tensor, micro_step_done: bool) -> None:
        """Before the engine's backward: arms the hooks for it, finds each parameter's optimizer group
        (``add_param_group`` or ``load_state_dict`` may have changed them since the last step; a
        scheduler's learning rate is read from the group at each call), checks the loss. No sync."""
        if not micro_step_done:
            raise ValueError(
                "backward(micro_step_done=False) with optimizer_in_backward: a parameter is stepped "
                "by the first backward that reaches it, so gradients of several backward passes "
                "cannot be summed first; sum the losses and call backward once"
            )
        where = {}
        for opt in self._optimizers:
            for group in opt.param_groups:
                for q in group["params"]:
                    where[id(q)] = (opt, group)
        self._where, self._armed, self._queued, self._found = where, True, False, None
        if self._check and not is_fake(
            loss
        ):  # (fake tensors: memory estimates, no values to check)
            self._found = torch.logical_not(torch.isfinite(loss.detach())).float()
            if self._one is None or self._one.device != loss.device:
                self._one = torch.ones((), dtype=torch.float32, device=loss.device)

    def finish(
        self, scaler: LossScaler, optimizers: Sequence[torch.optim.Optimizer], clip: Optional[float]
    ) -> tuple[None, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The engine's ``step()`` for a step taken in backward: records the step's finite check in
        the (unit) scaler as an ordinary step does; returns ``(grad_norm, scale, found_inf)``. No sync."""
        if clip is not None:
            raise ConfigError(
                f"clip_grad_norm={clip!r} with optimizer_in_backward is refused: the global norm needs "
                "every gradient before the first update, and each parameter was stepped in backward; "
                "clip with optimizer_in_backward=False, or train without clipping"
            )
        found, self._found, self._armed = self._found, None, False
        if not scaler.is_enabled() or found is None:
            return None, None, None
        for opt in optimizers:
            scaler.set_found_inf(opt, found)
        scaler.update()
        return None, scaler.scale_tensor, scaler.found_inf

    # ------------------------------------------------------------------ the hook
    def _hook(self, param: torch.Tensor) -> None:
        if not self._armed:
            return  # a backward other than the engine's (amp.diagnose, a user's own): gradients as usual
        if (
            not self._queued
        ):  # disarmed when this backward ends (torch's DDP ends its backward the same way)
            torch.autograd.Variable._execution_engine.queue_callback(self._disarm)
            self._queued = True
        stepped = self._stepped(param)
        entry = self._where.get(id(stepped))
        if entry is None or param.grad is None:
            return  # not stepped by a set-up optimizer: its gradient stays, as in an ordinary step
        opt, group = entry
        if (
            stepped is not param
        ):  # a pure precision: the half gradient into the fp32 master's (exact upcast)
            stepped.grad, param.grad = param.grad.to(stepped.dtype), None
        groups, params = opt.param_groups, group["params"]
        opt.param_groups, group["params"] = [group], [stepped]
        try:
            self._step(opt)
        finally:
            opt.param_groups, group["params"] = groups, params
            stepped.grad = None

    def _disarm(self) -> None:
        self._armed = False

    def _step(self, opt: torch.optim.Optimizer) -> None:
        """Step ``opt`` (narrowed to one parameter) unless this step saw a non-finite loss or gradient."""
        found = self._found
        if found is None:  # skip_nonfinite off: stepped as an ordinary step would
            opt.step()
            return
        finite = cpu_all_finite(opt, allow_fp16=True)  # CPU: decided on the host, read-only
        if finite is not None:
            if not finite:
                found.fill_(1.0)
            if not found.item():
                opt.step()
            return
        assert self._one is not None
        for f in check_and_unscale(opt, self._one, True).values():  # a unit scale: a check only
            torch.maximum(found, f.to(found.device), out=found)
        if getattr(
            opt, "_step_supports_amp_scaling", False
        ):  # fused: skipped on the device, no sync
            opt.grad_scale, opt.found_inf = None, found  # type: ignore[attr-defined]
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]
        elif not found.item():  # the one sync a non-fused optimizer needs, per parameter
            opt.step()
