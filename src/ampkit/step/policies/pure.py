"""``bf16-pure`` and ``fp16-pure`` ("O2"): half-precision weights with fp32 master weights.

The model's parameters live in the half dtype (half the memory, no per-forward weight casts);
an fp32 copy of each -- its *master* -- lives in the user's own optimizer, which is never told:
its parameter groups simply hold the masters instead of the model's parameters, so any torch
optimizer works (SGD with momentum, Adam, AdamW foreach/fused, RMSprop, Adagrad, ...).

Per micro-step, after ``backward`` the half gradients are added into the masters' fp32
gradients (one fused ``_foreach_add_``; the sum over an accumulation window is exact fp32
arithmetic on the upcast values) and the half gradients are dropped. At the boundary the engine
unscales, clips and finite-checks the **fp32 master gradients**, steps the optimizer (or skips),
then copies the masters back into the model (one fused ``_foreach_copy_``, rounding to the half
dtype). After a skipped step the masters are unchanged, so the copy leaves the model unchanged:
``model == masters.to(half)`` holds after every step, with no host sync.

Why masters at all: an update smaller than half the spacing of the weight's bf16 value rounds
away. At 1.0 bf16's spacing is 2**-7, so AdamW with lr 1e-3 never moves a bf16 weight of 1.0
(norm layers' weights freeze); in fp32 the same updates accumulate.

Modules kept in fp32 (``keep_fp32``, e.g. norms) keep their fp32 parameters and buffers; they
need no master and the optimizer updates them directly. Under FSDP2 the sharded fp32 parameters
are the masters already (``MixedPrecisionPolicy(param_dtype=...)``): this class is not used there,
so no second copy exists.

:class:`PurePolicy` is the family's policy: ``prepare`` builds the :class:`MasterWeights`, the
forward runs under autocast to the half dtype (inputs and the ops autocast keeps in fp32 follow
it), ``after_backward`` absorbs the half gradients, ``after_step`` rounds the masters into the
model (both set by ``prepare``), ``release`` puts the masters' values back as fp32 parameters. A
switch between the two pure forms is a release then a prepare: the model is recast from the
masters, the optimizer state follows its parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch

from .base import PrecisionPolicy

__all__ = ["MasterWeights", "PurePolicy", "cast_buffers", "kept_tensors"]


class MasterWeights:
    """Swap a model's floating parameters to ``dtype`` with fp32 masters in ``optimizers``.

    Args:
        model: the model (its parameters are cast in place, ``p.data = p.data.to(dtype)``).
        optimizers: the user's optimizers; their groups get the masters in place of the params.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        keep: qualified names of modules whose parameters and buffers stay fp32 (no master).
    """

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], dtype: torch.dtype,
                 keep: Iterable[str] = ()) -> None:
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise ValueError("this model's parameters are sharded (DTensor, e.g. FSDP2 fully_shard): pure "
                             "precisions keep no extra masters there -- the fp32 shards are the masters; use "
                             "fully_shard with MixedPrecisionPolicy(param_dtype=torch.bfloat16) and precision 'bf16'")
        self.dtype = dtype
        self.model = model
        kept = kept_tensors(model, keep)
        self.names: list[str] = []
        self.halves: list[torch.nn.Parameter] = []
        self.masters: list[torch.nn.Parameter] = []
        for name, p in model.named_parameters():  # named_parameters() yields a shared parameter once
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
    def absorb_grads(self) -> None:
        """Add the half gradients into the masters' fp32 gradients and drop them. No sync."""
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
        shapes = [n for n, m in zip(self.names, self.masters)
                  if n in state and tuple(state[n].shape) != tuple(m.shape)]
        if missing or shapes:
            raise ValueError(f"master weights do not fit this model (missing: {missing[:5]}, shape mismatch: "
                             f"{shapes[:5]}); nothing was loaded")
        with torch.no_grad():
            for n, m in zip(self.names, self.masters):
                m.copy_(state[n])
        self.copy_to_model()

    def full_precision_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with every mastered parameter in fp32 (its master's value)."""
        out = dict(self.model.state_dict())
        for n, m in zip(self.names, self.masters):
            out[n] = m.detach().clone()
        return {k: (v.float() if v.is_floating_point() and v.dtype != torch.float32 else v) for k, v in out.items()}

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _swap(optimizers: Sequence[torch.optim.Optimizer], mapping: dict[int, torch.Tensor]) -> None:
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


class PurePolicy(PrecisionPolicy):
    """Half weights in the model, fp32 masters in the optimizers (module doc)."""

    _masters: Optional[MasterWeights] = None

    _cast: Any = None  # masters='none': the bf16 model stepped directly (ladder.CastOnly)

    @property
    def rung(self) -> tuple[str, str]:
        """``(masters, state_dtype)`` of the memory ladder (:mod:`.ladder`); fp16-pure: fp32 masters only."""
        rung = (getattr(self.config, "masters", "fp32"), getattr(self.config, "state_dtype", "fp32"))
        if rung != ("fp32", "fp32") and self.precision.param_dtype != torch.bfloat16:
            raise ValueError(f"masters={rung[0]!r}, state_dtype={rung[1]!r}: the memory ladder is for bf16-pure "
                             f"(its 16-bit remainders and bf16 states); {self.precision.name} keeps fp32 masters "
                             "and states (masters='fp32', state_dtype='fp32')")
        return rung

    def prepare(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        masters, state_dtype = self.rung
        if self.shards_params:  # FSDP2: the fp32 shards are the masters; the policy casts the all-gathers
            if (masters, state_dtype) != ("fp32", "fp32"):
                raise ValueError(f"masters={masters!r}/state_dtype={state_dtype!r} under FSDP2: the fp32 shards "
                                 "are the masters there; use masters='fp32', state_dtype='fp32'")
            return
        dtype, keep = self.precision.param_dtype, self.kept_names(model)
        if masters == "none":
            from .ladder import CastOnly

            self._cast = CastOnly(model, optimizers, dtype, keep)
            return
        if (masters, state_dtype) == ("fp32", "fp32"):
            self._masters = MasterWeights(model, optimizers, dtype, keep)
        else:
            from .ladder import LadderWeights

            self._masters = LadderWeights(model, optimizers, dtype, keep, masters, state_dtype)
        self.after_backward = self._masters.absorb_grads  # half gradients summed into the fp32 masters' gradients
        self.after_step = self._masters.copy_to_model  # unconditional: after a skipped step the masters did not move

    def release(self) -> None:
        if self._cast is not None:
            self._cast.release()
            self._cast = None
        if self._masters is not None:
            self._masters.release()
            self._masters = self.after_backward = self.after_step = None

    def master_storage(self) -> list[torch.Tensor]:
        """The ladder rung's own tensors (16-bit remainders, bf16 compensations), for memory accounting."""
        return list(getattr(self._masters, "storage", list)())

    @property
    def keeps_masters(self) -> bool:
        return self._masters is not None

    def stepped(self, param: torch.Tensor) -> torch.Tensor:
        return param if self._masters is None else self._masters.stepped(param)

    def master_params(self) -> list[torch.Tensor]:
        return [] if self._masters is None else list(self._masters.masters)

    def full_precision_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if self._masters is None:
            return super().full_precision_state_dict(model)
        return self._masters.full_precision_state_dict()

    def forward_context(self) -> torch.autocast:
        # Inputs and the ops autocast keeps in fp32 follow the half dtype of the weights.
        return torch.autocast(self.device.type, dtype=self.precision.compute_dtype,
                              cache_enabled=self.config.autocast_cache)

    def state_dict(self) -> dict[str, Any]:
        """The fp32 masters by parameter name (empty under FSDP2, where the shards are the masters)."""
        return {} if self._masters is None else self._masters.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._masters is not None and state:
            self._masters.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        where = "the fp32 shards (FSDP2)" if self.shards_params else "fp32 copies in the optimizer"
        masters, state_dtype = self.rung
        if self.shards_params or masters == "fp32":
            out = {"masters": where}
        elif masters == "none":
            return {**super().describe(), "masters": "none (updates below half a bf16 spacing round away)",
                    "optimizer_steps": "bfloat16"}
        else:
            out = {"masters": {"split": "bf16 weight + int16 remainder (exact fp32)",
                               "kahan": "bf16 weight + bf16 compensation",
                               "stochastic": "none: updates rounded stochastically into bf16"}[masters]}
        return {**super().describe(), "grads": "float32 (half gradients summed into the masters')", **out,
                "optimizer_state": "bfloat16 (stochastic rounding)" if state_dtype == "bf16" else "float32"}


def _half(buf: torch.Tensor) -> bool:
    return buf.dtype != torch.float32  # buffers kept in fp32 (keep_fp32 modules) stay as they are


def cast_buffers(model: torch.nn.Module, dtype: torch.dtype, select: Callable[[torch.Tensor], bool]) -> None:
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
