"""fp32 master weights for the pure precisions (``bf16-pure``, ``fp16-pure``): the model's
parameters swapped to the half dtype, an fp32 copy of each -- its master -- in the user's
optimizers (module doc of :mod:`.policy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["MasterWeights", "cast_buffers", "kept_tensors"]


class MasterWeights:
    """Swap a model's floating parameters to ``dtype`` with fp32 masters in ``optimizers``.

    Args:
        model: the model (its parameters are cast in place, ``p.data = p.data.to(dtype)``).
        optimizers: the user's optimizers; their groups get the masters in place of the params.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        keep: qualified names of modules whose parameters and buffers stay fp32 (no master).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        dtype: torch.dtype,
        keep: Iterable[str] = (),
    ) -> None:
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise ValueError(
                "this model's parameters are sharded (DTensor, e.g. FSDP2 fully_shard): pure "
                "precisions keep no extra masters there -- the fp32 shards are the masters; use "
                "fully_shard with MixedPrecisionPolicy(param_dtype=torch.bfloat16) and precision 'bf16'"
            )
        self.dtype = dtype
        self.model = model
        kept = kept_tensors(model, keep)
        self.names: list[str] = []
        self.halves: list[torch.nn.Parameter] = []
        self.masters: list[torch.nn.Parameter] = []
        for (
            name,
            p,
        ) in model.named_parameters():  # named_parameters() yields a shared parameter once
            if id(p) in kept or not p.is_floating_point():
                continue
            master = torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
            self.names.append(name)
            self.halves.append(p)
            self.masters.append(master)
        self._by_half = {id(h): m for h, m in zip(self.halves, self.masters)}
        self._swap(optimizers, self._by_half)
        self.optimizers = list(optimizers)
        with torch.no_grad():
            for p in self.halves:
                p.data = p.data.to(dtype)
            cast_buffers(model, dtype, lambda b: id(b) not in kept)

    # ------------------------------------------------------------------ the per-step work
    def absorb_grads(self, whole_window: bool = False) -> None:
        """Add the half gradients into the masters' fp32 gradients and drop them (``whole_window``:
        the engine's hint that the step comes next, unused here). No sync."""
        acc_m, acc_h = [], []
        for h, m in zip(self.halves, self.masters):
            g = h.grad
            if g is None:
                continue
            if m.grad is None:
                m.grad = g.float()  # exact upcast; a fresh fp32 tensor
            else:
                acc_m.append(m.grad)
                acc_h.append(g)
            h.grad = None
        if acc_m:
            torch._foreach_add_(acc_m, acc_h)  # fp32 += upcast(half), in one fused call

    def copy_to_model(self) -> None:
        """Round the masters into the model's half parameters (after every optimizer step). No sync."""
        if self.halves:
            with torch.no_grad():
                torch._foreach_copy_(self.halves, self.masters)

    def stepped(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor the optimizer steps for a model parameter (its master, or itself)."""
        return self._by_half.get(id(param), param)

    def release(self) -> None:
        """Undo: fp32 parameters (the masters' values) back in the model and in the optimizers."""
        with torch.no_grad():
            for h, m in zip(self.halves, self.masters):
                h.grad = None
                h.data = m.detach().clone()
            cast_buffers(self.model, torch.float32, _half)
        self._swap(self.optimizers, {id(m): h for h, m in zip(self.halves, self.masters)})

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The masters by parameter name (fp32). Reading them does not sync."""
        return {n: m.detach() for n, m in zip(self.names, self.masters)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the masters (checked first: the same names and shapes) and copy them into the model."""
        missing = [n for n in self.names if n not in state]
        shapes = [
            n
            for n, m in zip(self.names, self.masters)
            if n in state and tuple(state[n].shape) != tuple(m.shape)
        ]
        if missing or shapes:
            raise ValueError(
                f"master weights do not fit this model (missing: {missing[:5]}, shape mismatch: "
                f"{shapes[:5]}); nothing was loaded"
            )
        with torch.no_grad():
            for n, m in zip(self.names, self.masters):
                m.copy_(state[n])
        self.copy_to_model()

    def full_precision_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every mastered parameter in fp32 (its master's value)."""
        out = dict(self.model.state_dict())
        for n, m in zip(self.names, self.masters):
            out[n] = m.detach().clone()
        return {
            k: (v.float() if v.is_floating_point() and v.dtype != torch.float32 else v)
            for k, v in out.items()
        }

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _swap(
        optimizers: Sequence[torch.optim.Optimizer], mapping: dict[int, torch.Tensor]
    ) -> None:
        """Replace parameters in the optimizers' groups (and move their state) by ``mapping``."""
        for opt in optimizers:
            for group in opt.param_groups:
                new = []
                for p in group["params"]:
                    q = mapping.get(id(p), p)
                    if q is not p and p in opt.state:
                        opt.state[q] = opt.state.pop(p)
                    new.append(q)
                group["params"] = new


def _half(buf: torch.Tensor) -> bool:
    return buf.dtype != torch.float32  # buffers kept in fp32 (keep_fp32 modules) stay as they are


def cast_buffers(
    model: torch.nn.Module, dtype: torch.dtype, select: Callable[[torch.Tensor], bool]
) -> None:
    """Cast the floating buffers that ``select`` picks to ``dtype``, in place in their modules."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_floating_point() and select(buf):
                module._buffers[name] = buf.to(dtype)


def kept_tensors(model: torch.nn.Module, keep: Iterable[str]) -> set[int]:
    """ids of the parameters and buffers of the modules named in ``keep`` (and their children)."""
    out: set[int] = set()
    modules = dict(model.named_modules())
    for name in keep:
        mod = modules.get(name)
        if mod is None:
            continue
        out.update(id(t) for t in mod.parameters())
        out.update(id(t) for t in mod.buffers())
    return out
