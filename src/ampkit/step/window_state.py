"""An accumulation window in an engine's state: a state saved inside a window resumes it exactly.

The Trainer and ``ampkit train`` checkpoint at step boundaries, but Lightning, a Slurm requeue or a
time-based checkpoint can save inside a window. The window is then part of the run's state: the
micro-steps done, the divisor, the losses' kind (``normalized``) and the gradients summed so far
(of each parameter the optimizers step -- the model's, or a pure precision's fp32 masters -- by its
place in their groups, as backward left them: scaled under fp16, with the scale the state also
holds). Restored, the window's next backward adds to them exactly as the uninterrupted run's
does. Where the gradients cannot be put back exactly -- another model's names or shapes, several
processes (each rank's gradients differ until the window's all-reduce), a sharded parameter --
the resumed run starts a new window and says so: a step on part of a window's gradients would be
a silently different one.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from .accumulate import Window

__all__ = ["restore_window", "window_state"]


def window_state(engine: Any) -> Optional[dict[str, Any]]:
    """The open window of ``engine`` (a :class:`~ampkit.step.engine.MixedPrecision`), or None
    between windows. Its gradients are left out where they could not come back exactly."""
    window = engine._window
    if not window.micro:
        return None
    grads: Optional[dict[str, torch.Tensor]] = {}
    model = engine._model
    several = torch.distributed.is_available() and torch.distributed.is_initialized()
    several = several and torch.distributed.get_world_size() > 1
    for name, p in _stepped(engine).items() if model is not None and not several else ():
        g = p.grad
        if g is not None:
            if type(g) is not torch.Tensor or g.is_sparse:
                grads = None
                break
            grads[name] = g.detach().clone()
    loss = engine._window_loss
    return {
        "micro": window.micro,
        "size": window.current_size,
        "normalized": engine._normalized,
        "grads": grads if model is not None and not several else None,
        "loss": None if loss is None else loss.detach().clone(),
    }


def restore_window(engine: Any, state: dict[str, Any], size: int) -> None:
    """Give ``engine`` the window of ``state`` (``accumulation_steps`` = ``size``): the saved one with
    its gradients, or a new one (warned) where they cannot be restored exactly."""
    engine._window, engine._open_micro = Window(size), False
    engine._normalized, engine._window_loss = False, None
    saved, micro = state.get("window"), int(state.get("micro_steps", 0))
    if not micro:
        return
    why = _why_not(engine, saved, micro, size)
    if why is not None:
        warnings.warn(
            f"the state was saved inside an accumulation window (micro-step {micro} of {size}) and "
            f"{why}: the resumed run starts a new window (its first optimizer step sums "
            f"{size} new micro-steps; the {micro} before the save are not in it)",
            stacklevel=3,
        )
        for p in _stepped(engine).values():
            p.grad = None
        return
    assert saved is not None
    if saved["size"] != size:
        engine._window.set_size(int(saved["size"]))
    engine._window.micro = micro
    engine._normalized = bool(saved["normalized"])
    loss = saved.get("loss")
    engine._window_loss = None if loss is None else loss.to(engine.device)
    for name, p in _stepped(engine).items():
        g = saved["grads"].get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()


def _why_not(engine: Any, saved: Any, micro: int, size: int) -> Optional[str]:
    """Why the saved window cannot be restored exactly, or None."""
    if not isinstance(saved, dict) or saved.get("grads") is None:
        return "its gradients were not saved (an older state, or several processes)"
    if engine._model is None:
        return "the engine has no model yet (call setup() first)"
    if not 1 <= int(saved.get("size", 0)) <= size or micro >= int(saved["size"]):
        return f"its window of {saved.get('size')} does not fit accumulation_steps={size}"
    params = _stepped(engine)
    for name, g in saved["grads"].items():
        p = params.get(name)
        if p is None or tuple(p.shape) != tuple(g.shape) or type(p.data) is not torch.Tensor:
            return (
                f"its gradient {name!r} (optimizer.group.index) has no place here (another layout)"
            )
    return None


def _stepped(engine: Any) -> dict[str, torch.Tensor]:
    """The parameters the engine's optimizers step, named ``optimizer.group.index``."""
    return {
        f"{i}.{k}.{j}": p
        for i, opt in enumerate(engine._optimizers or ())
        for k, group in enumerate(opt.param_groups)
        for j, p in enumerate(group["params"])
    }
