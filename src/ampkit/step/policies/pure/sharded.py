"""The memory ladder under FSDP2: bf16 optimizer states, and ``stochastic`` masters.

Under FSDP2 the fp32 shards are the masters (FSDP2's ``MixedPrecisionPolicy`` all-gathers them in
bf16). ``masters='stochastic'`` stores the shards themselves in bf16 (the model is cast after
``fully_shard``; FSDP2 re-points its parameters at the new shards, the all-gather then casts
nothing) and rounds each step's fp32 update stochastically into them: inside the wrapped ``step``
each bf16 shard parameter is swapped (``torch.utils.swap_tensors``: the same object, so the
optimizer's state and the checkpoint's names still find it) for its fp32 widening in the arena,
stepped, rounded back into the bf16 shard's own storage and swapped back.

``state_dtype='bf16'`` (with either): each rank's
optimizer states are DTensors whose local tensors are bf16 and hold the rank's shard only
(2 + 2 bytes per element of AdamW state instead of 4 + 4). The user's optimizer steps the shards
as always; its ``step`` is wrapped: before it, each bf16 state's local tensor is widened to fp32
in the kept arena (:class:`.pieces.Arena`, ``ladder_scratch_mib``; a new tensor past it), after it
the stepped fp32 states are rounded back stochastically into the same bf16 tensors, all of a
step's in one call (:func:`.rounding.stochastic_many`) -- what :class:`.ladder.LadderWeights` does
for one process, with the same random stream.

Every rank seeds the generator alike and draws the same key each step, so the generator state in a
checkpoint (one copy, whichever rank wrote it) is every rank's; the key is salted with the rank's
shard index (its coordinates on the mesh's sharded dimensions: HSDP replicas of one shard round
alike), so the ranks' shards round with their own bits. Through ``torch.distributed.checkpoint``
the states are saved as they are (bf16 DTensors); ``optimizer.load_state_dict`` casts the loaded
states to the parameters' fp32, and a post-load hook casts them back, exactly.

``split``/``kahan`` (a remainder beside each shard) and ``none`` stay refused under FSDP2, and so
do ``keep_fp32`` modules with ``stochastic`` (FSDP2 gathers one dtype per group)
(:meth:`.policy.PurePolicy.prepare`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch.utils import swap_tensors

from .pieces import Arena, WrappedSteps
from .rounding import STREAM, shared_seed, stochastic_many, warn_other_stream

__all__ = ["SHARDED_MASTERS", "ShardedStates", "cast_shards", "shard_salt"]

#: the ``masters`` a rung may have under FSDP2 (with ``state_dtype`` 'fp32' or 'bf16')
SHARDED_MASTERS = ("fp32", "stochastic")

_Kept = dict[tuple[int, str], torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(local: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor like ``t``: a DTensor with ``t``'s mesh and placements, or itself."""
    if not hasattr(t, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def shard_salt(params: Sequence[torch.Tensor]) -> int:
    """The key's salt for this rank: its shard index on the sharded mesh dimensions, shifted past the
    counter's range (0 for plain tensors: one process)."""
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        coord = None if mesh is None else mesh.get_coordinate()
        if coord is None:
            continue
        index = 0
        for dim, placement in enumerate(p.placements):
            if placement.is_shard():
                index = index * mesh.size(dim) + coord[dim]
        return index << 40
    return 0


def cast_shards(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model``'s FSDP2 shards (and buffers) to ``dtype``, between steps: ``FSDPModule._apply``
    re-pads and re-points each FSDP parameter at its new shard; the groups' dtypes follow
    (:func:`ampkit.step.parallel.fsdp.refresh_dtypes`: an all-gather in the shards' own dtype casts
    nothing, the gradients come back in it)."""
    from ...parallel.fsdp import refresh_dtypes  # (torch.distributed.fsdp: only when sharded)

    model.to(dtype)
    refresh_dtypes(model.modules())


class ShardedStates:
    """The bf16 states of ``optimizers`` over FSDP2's fp32 shards (module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        masters: str = "fp32",
        state_dtype: str = "bf16",
        scratch_bytes: int = 16 << 20,
    ) -> None:
        self.model, self.optimizers = model, list(optimizers)
        self.masters, self.state_dtype = masters, state_dtype
        if masters == "stochastic":
            cast_shards(model, torch.bfloat16)
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        dev = _local(params[0]).device if params else torch.device("cpu")
        self.gen = torch.Generator(device=dev)
        self.gen.manual_seed(shared_seed(model, spans_ranks=True))
        self.salt = shard_salt(params)
        self.arena = Arena(scratch_bytes // 4, dev)
        self._steps = WrappedSteps()
        self._hooks = [opt.register_load_state_dict_post_hook(self._loaded) for opt in optimizers]
        self._hooks += [opt.register_load_state_dict_pre_hook(self._loading) for opt in optimizers]
        self._wide: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # (param, bf16 holder, grad)
        for opt in self.optimizers:
            self._steps.wrap(opt, self._step)
            self._narrow(opt)  # states made before ``setup``: bf16 now (rounded to nearest)

    def _keys(self, opt: torch.optim.Optimizer, p: torch.Tensor) -> list[str]:
        """The keys of ``p``'s parameter-shaped floating states (bf16 between steps)."""
        state = (opt.state.get(p) or {}) if self.state_dtype == "bf16" else {}
        return [
            k
            for k, v in state.items()
            if isinstance(v, torch.Tensor)
            and v.is_floating_point()
            and v.dim() > 0
            and v.shape == p.shape
        ]

    def _step(
        self, opt: torch.optim.Optimizer, inner: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        params = [p for g in opt.param_groups for p in g["params"]]
        kept: _Kept = {}
        self.arena.reset()
        try:
            with torch.no_grad():
                if self.masters == "stochastic":
                    self._widen([p for p in params if p.grad is not None], self.arena.widen)
                for p in params:
                    for k in self._keys(opt, p):
                        v = opt.state[p][k]
                        if v.dtype == torch.bfloat16:
                            kept[(id(p), k)] = v
                            opt.state[p][k] = _like(self.arena.widen(_local(v)), v)
            ret = inner(*args, **kwargs)
        except BaseException:
            for p in params:  # the states as before the step (the widened ones view the arena)
                for k in self._keys(opt, p):
                    if (id(p), k) in kept:
                        opt.state[p][k] = kept[(id(p), k)]
            self._unwiden()  # the shards unchanged
            raise
        with torch.no_grad():
            if self._wide:  # the stepped weights rounded into the bf16 shards, one call
                xs = [_local(p).reshape(-1) for p, _, _ in self._wide]
                outs = [_local(h).view(-1) for _, h, _ in self._wide]
                stochastic_many(xs, outs, self.gen, salt=self.salt)
            self._unwiden()
            self._down(opt, params, kept)
        return ret

    def _widen(self, params: list[torch.Tensor], widen: Callable[..., torch.Tensor]) -> None:
        """Each bf16 shard parameter swapped for its fp32 values (``widen``), its gradient fp32."""
        for p in params:
            if p.dtype != torch.bfloat16:
                continue
            g = p.grad
            wide = torch.nn.Parameter(_like(widen(_local(p)), p), requires_grad=p.requires_grad)
            swap_tensors(p, wide)  # ``p`` (the same object) now the fp32 values; ``wide`` the shard
            self._wide.append((p, wide, g))
            p.grad = None if g is None else g.float()

    def _unwiden(self) -> None:
        """The bf16 shards (and their gradients) back in their parameters."""
        for p, shard, g in reversed(self._wide):
            p.grad = None
            swap_tensors(p, shard)
            p.grad = g
        self._wide = []

    def _down(self, opt: torch.optim.Optimizer, params: list[torch.Tensor], kept: _Kept) -> None:
        """The stepped fp32 states rounded stochastically into bf16 in one call (the key salted
        with the shard index), into the tensors the step widened (new ones for new states)."""
        xs, outs = [], []
        for p in params:
            for k in self._keys(opt, p):
                v = opt.state[p][k]
                if v.dtype == torch.bfloat16:
                    continue
                out = kept.get((id(p), k))
                if out is None or out.shape != v.shape or not _local(out).is_contiguous():
                    out = _like(torch.empty_like(_local(v), dtype=torch.bfloat16), v)
                xs.append(_local(v).reshape(-1))
                outs.append(_local(out).view(-1))
                opt.state[p][k] = out
        if xs:
            stochastic_many(xs, outs, self.gen, salt=self.salt)

    def _narrow(self, opt: torch.optim.Optimizer) -> None:
        """Every parameter-shaped floating state to bf16 (exact for values that are bf16 numbers)."""
        with torch.no_grad():
            for p in [p for g in opt.param_groups for p in g["params"]]:
                for k in self._keys(opt, p):
                    opt.state[p][k] = opt.state[p][k].to(torch.bfloat16)

    def _loading(self, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Before ``opt.load_state_dict`` (torch casts the loaded states to their parameters'
        dtype): bf16 shards widened to fp32 for the while, so fp32 states load exactly."""
        if self.masters == "stochastic":
            with torch.no_grad():
                self._widen([p for g in opt.param_groups for p in g["params"]], torch.Tensor.float)

    def _loaded(self, opt: torch.optim.Optimizer) -> None:
        """After ``opt.load_state_dict``: the shards bf16 again (unchanged), bf16 states bf16 again."""
        self._unwiden()
        self._narrow(opt)

    def release(self) -> None:
        """The optimizers' own ``step`` back, their states and the shards fp32 for good (exact)."""
        self._steps.restore()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        with torch.no_grad():
            for opt in self.optimizers:
                for p in [p for g in opt.param_groups for p in g["params"]]:
                    for k in self._keys(opt, p):
                        opt.state[p][k] = opt.state[p][k].float()
            if self.masters == "stochastic":
                cast_shards(self.model, torch.float32)

    def state_dict(self) -> dict[str, Any]:
        """The rounding generator's state (every rank's: they draw alike) and its stream."""
        return {
            "rung": self.masters,
            "state_dtype": self.state_dtype,
            "generator": self.gen.get_state(),
            "stream": STREAM,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        found = (state.get("rung", "fp32"), state.get("state_dtype", "fp32"))
        if found != (self.masters, self.state_dtype) or "generator" not in state:
            raise ValueError(
                f"this checkpoint's rung is masters={found[0]!r}, state_dtype={found[1]!r} but the "
                f"engine runs masters={self.masters!r}, state_dtype={self.state_dtype!r} under "
                "FSDP2; resume with the rung it was written with"
            )
        self.gen.set_state(state["generator"])
        if state.get("stream") != STREAM:
            warn_other_stream(state.get("stream"))

    def scratch(self) -> list[torch.Tensor]:
        """The arena kept between steps, for memory accounting."""
        return [self.arena.buf] if self.arena.buf.numel() else []
