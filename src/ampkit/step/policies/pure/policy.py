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
are the masters already (``MixedPrecisionPolicy(param_dtype=...)``): no second copy exists; the
ladder's rungs there (``state_dtype='bf16'``, ``masters='stochastic'``) are :mod:`.sharded`'s.

:class:`PurePolicy` is the family's policy: ``prepare`` builds the :class:`MasterWeights`, the
forward runs under autocast to the half dtype (inputs and the ops autocast keeps in fp32 follow
it), ``after_backward`` absorbs the half gradients, ``after_step`` rounds the masters into the
model (both set by ``prepare``), ``release`` puts the masters' values back as fp32 parameters. A
switch between the two pure forms is a release then a prepare: the model is recast from the
masters, the optimizer state follows its parameter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ...rung import Rung
from ..base import PrecisionPolicy
from .ladder import CastOnly, LadderWeights
from .masters import MasterWeights, kept_tensors
from .sharded import SHARDED_MASTERS, ShardedStates

__all__ = ["PurePolicy"]


class PurePolicy(PrecisionPolicy):
    """Half weights in the model, fp32 masters in the optimizers (module doc)."""

    _masters: Optional[MasterWeights] = None

    _cast: Any = None  # masters='none': the bf16 model stepped directly (ladder.CastOnly)

    _states: Optional[ShardedStates] = None  # FSDP2 with state_dtype='bf16' (.sharded)

    @property
    def rung(self) -> Rung:
        """The memory-ladder rung (:mod:`ampkit.step.rung`); a precision without the ladder (fp16-pure,
        reached by a switch: the engine refuses one asked for) keeps fp32 masters and states only."""
        rung = Rung.of(self.config)
        if not rung.plain and not self.precision.row.has_ladder:
            raise ValueError(
                f"masters={rung.masters!r}, state_dtype={rung.state_dtype!r}: the memory ladder is "
                f"not {self.precision.name}'s; it keeps fp32 masters and states (masters='fp32', "
                "state_dtype='fp32')"
            )
        return rung

    def prepare(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        rung = self.rung
        if self.shards_params:  # FSDP2: the fp32 shards are the masters; the all-gathers cast
            if rung.masters not in SHARDED_MASTERS or (
                rung.masters == "stochastic" and self.kept_names(model)
            ):
                why = (
                    "keep_fp32 modules need fp32 shards (FSDP2 gathers one dtype per group)"
                    if rung.masters in SHARDED_MASTERS
                    else "the fp32 shards are the masters there, and with no bf16 model copy "
                    "kept between steps to share, a bf16 + 16-bit pair costs what they do "
                    "(4 bytes per element)"
                )
                raise ValueError(
                    f"masters={rung.masters!r} under FSDP2: {why}; supported under FSDP2: "
                    "masters='fp32' or 'stochastic' (without keep_fp32), each with "
                    "state_dtype='fp32' or state_dtype='bf16'"
                )
            if not rung.plain:
                scratch = self.config.ladder_scratch_mib << 20
                self._states = ShardedStates(
                    model, optimizers, rung.masters, rung.state_dtype, scratch_bytes=scratch
                )
            return
        dtype, keep = self.precision.param_dtype, self.kept_names(model)
        if rung.stalls:
            self._cast = CastOnly(model, optimizers, dtype, keep)
            return
        if rung.plain:
            self._masters = MasterWeights(model, optimizers, dtype, keep)
        else:
            _refuse_strided(model, keep, rung)
            self._masters = LadderWeights(
                model,
                optimizers,
                dtype,
                keep,
                rung.masters,
                rung.state_dtype,
                scratch_bytes=self.config.ladder_scratch_mib << 20,
            )
        self.after_backward = (
            self._masters.absorb_grads
        )  # half gradients summed into the fp32 masters' gradients
        self.after_step = (
            self._masters.copy_to_model
        )  # unconditional: after a skipped step the masters did not move
        if isinstance(self._masters, LadderWeights):  # bf16 gradients kept for a lean step (.grads)
            self.before_step = self._masters.grads.settle
            self.clip_grad_norm = self._masters.grads.clip
            self.end_step = functools.partial(self._masters.grads.settle, False)

    def release(self) -> None:
        if self._states is not None:
            self._states.release()
            self._states = None
        if self._cast is not None:
            self._cast.release()
            self._cast = None
        if self._masters is not None:
            self._masters.release()
            self._masters = self.after_backward = self.after_step = None
            self.before_step = self.end_step = self.clip_grad_norm = None

    def master_storage(self) -> list[torch.Tensor]:
        """The ladder rung's own tensors (16-bit remainders, bf16 compensations), for memory accounting."""
        return list(getattr(self._masters, "storage", list)())

    def scratch_storage(self) -> list[torch.Tensor]:
        """The ladder's bounded scratch kept between steps, for memory accounting."""
        return list(getattr(self._masters or self._states, "scratch", list)())

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
        return torch.autocast(
            self.device.type,
            dtype=self.precision.compute_dtype,
            cache_enabled=self.config.autocast_cache,
        )

    def state_dict(self) -> dict[str, Any]:
        """The fp32 masters by parameter name (under FSDP2, where the shards are the masters: the bf16
        states' rounding generator, else empty)."""
        owner = self._masters or self._states
        return {} if owner is None else owner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        owner = self._masters or self._states
        if owner is not None and state:
            owner.load_state_dict(state)

    def describe(self) -> dict[str, Any]:
        where = "the fp32 shards (FSDP2)" if self.shards_params else "fp32 copies in the optimizer"
        rung = self.rung
        if rung.stalls:
            return {**super().describe(), "masters": rung.what, "optimizer_steps": "bfloat16"}
        out = {"masters": where if rung.masters == "fp32" else rung.what}
        return {
            **super().describe(),
            "grads": "bfloat16, widened in the step (float32 with accumulation or data parallel)"
            if rung.half_grads
            else "float32 (half gradients summed into the masters')",
            **out,
            "optimizer_state": "bfloat16 (stochastic rounding)"
            if rung.state_dtype == "bf16"
            else "float32",
        }


def _refuse_strided(model: torch.nn.Module, keep: Sequence[str], rung: Rung) -> None:
    """The ladder steps each weight as flat memory: a weight that is not contiguous (a
    channels_last conv weight) is refused before anything changes."""
    kept = kept_tensors(model, keep)
    odd = [
        n
        for n, p in model.named_parameters()
        if id(p) not in kept and p.is_floating_point() and not p.is_contiguous()
    ]
    if odd:
        raise ValueError(
            f"masters={rung.masters!r}, state_dtype={rung.state_dtype!r}: the memory ladder steps "
            f"each weight as flat memory, and {odd[:5]} are not contiguous (channels_last?); "
            "make them contiguous (model.to(memory_format=torch.contiguous_format)), keep their "
            "modules in fp32 (keep_fp32), or use masters='fp32' with state_dtype='fp32'"
        )
