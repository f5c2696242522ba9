"""What happens at an accumulation boundary, in the order a hand-written torch.amp loop does it::

    (flush: x size/k) -> unscale_ (only if clipping) -> clip_grad_norm_ over the model's
    parameters in model order -> step, skipped on device if non-finite -> update the scale

Clipping runs over the set-up model's parameters in ``model.parameters()`` order (then any
optimizer parameter the model does not hold), as nanoGPT and timm clip ``model.parameters()``:
the total norm is a floating-point sum, so another order (e.g. the optimizer's decay/no-decay
groups) differs in the last bits and runs drift apart.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .gradcheck import cpu_norm_finite
from .profiling import phase
from .scaler import LossScaler

__all__ = ["ClipOrder", "PendingUpdate", "clip_norm", "lean_step", "optimizer_step"]


class ClipOrder:
    """Parameters to clip for a set of optimizers, in model order; cached until the groups change."""

    def __init__(
        self,
        model: torch.nn.Module,
        stepped: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        self._model = model
        self._stepped = stepped  # pure precisions: the optimizer steps (and clips) the fp32 masters
        self._cache: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def params(self, opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
        key = []  # (plain loops: this runs every step)
        for o in opts:
            key.append(id(o))
            for g in o.param_groups:
                key.append(len(g["params"]))
        cached = self._cache.get(tuple(key))
        if cached is None:
            stepped = {id(p): p for o in opts for g in o.param_groups for p in g["params"]}
            stepped_of = self._stepped
            ordered = (
                self._model.parameters()
                if stepped_of is None
                else map(stepped_of, self._model.parameters())
            )
            cached = [p for p in ordered if id(p) in stepped]
            seen = {id(p) for p in cached}
            cached += [p for i, p in stepped.items() if i not in seen]
            self._cache[tuple(key)] = cached
        return cached


class PendingUpdate:
    """Optimizers stepped with ``step(..., update_scale=False)`` since the last scale update.

    A loop that steps its optimizers at different times but updates the scale once per
    iteration -- a GAN: ``scaler.step(optD)``; G's forward through the updated D and its
    backward; ``scaler.step(optG)``; ``scaler.update()`` -- ports as ``amp.step(optD,
    update_scale=False)`` ... ``amp.step(optG)``: the second step's update folds in both
    optimizers' ``found_inf`` (``GradScaler.update``'s rule). The first step's result has its own
    optimizers' ``found_inf`` (``skipped`` when they were); the updating step's covers the
    iteration, which counts as one optimizer step. Stepping an optimizer again before the update
    raises, before anything changes.
    """

    def __init__(self) -> None:
        self._ids: set[int] = set()

    def check(self, opts: list[torch.optim.Optimizer], update: bool, in_backward: bool) -> None:
        if not update and in_backward:
            raise ValueError(
                "step(update_scale=False) with optimizer_in_backward: each parameter is stepped "
                "in backward, so there is no separate optimizer step to leave the update after"
            )
        again = [i for i, o in enumerate(opts) if id(o) in self._ids]
        if again:
            raise RuntimeError(
                f"step() of optimizer(s) {again} (of those passed) again before the loss scale "
                "was updated: step(..., update_scale=False) stepped them this iteration; end "
                "the iteration with a step() of the other optimizer(s) (update_scale=True)"
            )

    def done(self, opts: list[torch.optim.Optimizer], update: bool, scaling: bool) -> None:
        if update:
            self._ids.clear()
        elif scaling:  # (a disabled scaler has no update to wait for)
            self._ids.update(id(o) for o in opts)


def lean_step(scaler: LossScaler, flush_factor: Optional[float], zero_grad: bool) -> bool:
    """Whether this boundary only checks (and clips) the gradients before the optimizer reads them:
    no flush of a short window, no scale to unscale, and ``zero_grad`` after (gradients a policy
    keeps in bf16 may then stay so: :mod:`ampkit.step.policies.pure.grads`)."""
    unit = not scaler.is_enabled() or scaler.is_unit
    return flush_factor is None and zero_grad and unit


def optimizer_step(
    scaler: LossScaler,
    opts: list[torch.optim.Optimizer],
    params: list[torch.Tensor],
    clip: Optional[float],
    flush_factor: Optional[float],
    clip_fn: Optional[Callable[[list[torch.Tensor], float], torch.Tensor]] = None,
    update: bool = True,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Unscale, clip, check, step (or skip) and update; returns ``(grad_norm, scale, found_inf)``.
    ``clip_fn``: the policy's clipping (kept bf16 gradients, a lean step), else :func:`clip_norm`.
    ``update=False`` leaves the scale update to a later call, which folds in every optimizer
    stepped since the last update -- ``GradScaler.update``'s rule; ``found_inf`` is then these
    optimizers' own verdict, the updating call's the iteration's.

    ``scale`` is the scale this step's gradients carried (None without a scaler), ``found_inf``
    None when non-finite checking is off. No host sync with fused optimizers.
    """
    if flush_factor is not None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, flush_factor)
    grad_norm = None
    if not scaler.is_enabled():
        if clip is not None:
            grad_norm = clip_norm(params, clip, clip_fn)
        with phase("ampkit.optimizer_step"):
            for opt in opts:
                opt.step()
        return grad_norm, None, None
    unit = scaler.is_unit
    live = scaler.scale_tensor
    scale = live if unit or live is None else live.clone()
    if clip is not None and unit:
        # Nothing to unscale: the clipped total norm is non-finite exactly when some gradient
        # is, so it doubles as the finite check (saves a pass over the gradients).
        grad_norm = clip_norm(params, clip, clip_fn)
        finite = cpu_norm_finite(grad_norm) if scaler.found_inf_hook is None else None
        if finite is not None:
            # On the CPU reading the norm costs no sync: decide here and call each optimizer
            # exactly as a plain loop does (no found_inf for a fused one to read and correct for).
            with phase("ampkit.optimizer_step"):
                for opt in opts:
                    scaler.step_decided(opt, finite)
                if update:
                    scaler.update()
            return grad_norm, scale, scaler.found_inf if update else scaler.found_inf_of(opts)
        found = torch.zeros((), dtype=torch.float32, device=grad_norm.device)
        # One fused op sets found=1.0 iff the norm is inf/NaN (and multiplies it by 1).
        torch._amp_foreach_non_finite_check_and_unscale_([grad_norm], found, scaler.one)
        for opt in opts:
            scaler.set_found_inf(opt, found)
    elif clip is not None:
        with phase("ampkit.unscale_check"):
            for opt in opts:
                scaler.unscale_(opt)
        grad_norm = clip_norm(params, clip)
    with phase(
        "ampkit.optimizer_step"
    ):  # (without clipping, the unscale and check happen in scaler.step)
        for opt in opts:
            scaler.step(opt)
        if update:
            scaler.update()
    return grad_norm, scale, scaler.found_inf if update else scaler.found_inf_of(opts)


def clip_norm(
    params: list[torch.Tensor],
    clip: float,
    clip_fn: Optional[Callable[[list[torch.Tensor], float], torch.Tensor]] = None,
) -> torch.Tensor:
    """``clip_grad_norm_`` (or ``clip_fn``) returning a plain tensor: under FSDP2 the gradients are
    DTensor shards and the total norm comes back as a replicated DTensor, the same on every rank."""
    with phase("ampkit.clip"):
        norm = (clip_fn or torch.nn.utils.clip_grad_norm_)(params, clip)
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
