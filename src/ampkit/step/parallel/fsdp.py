"""FSDP2 (``fully_shard``): the engine's adapter, and the ``MixedPrecisionPolicy`` of a precision.

Under FSDP2 each rank holds fp32 *shards* of the parameters; a forward all-gathers them in the
policy's ``param_dtype``, a backward reduce-scatters gradients in its ``reduce_dtype``. For a pure
precision the fp32 shards already are the master weights, so the engine keeps no second copy
(``shards_params``). :func:`mixed_precision_policy` maps a precision to its policy (the table in
:mod:`ampkit.distributed.fsdp`, which shards models with it).

:class:`FSDPParallel` turns gradient reduce-scatter off on the micro-steps that do not end an
accumulation window (``set_requires_gradient_sync(False)``; FSDP2 then accumulates unsharded
gradients locally) and on again for the last, so there is one reduction per optimizer step.
The finite check needs no extra collective: on DTensor gradients PyTorch's
``_amp_foreach_non_finite_check_and_unscale_`` reduces ``found_inf`` over the mesh with ``max``,
so every rank skips the same steps and backs the scale off together. Clipping runs on the
DTensor gradients and returns the global total norm on every rank.

Importing this module imports ``torch.distributed.fsdp`` (about a second): the engine does so
only for a model that can be sharded (:func:`ampkit.step.parallel.adapter_for`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable, Optional

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from ..precision import Precision
from .base import Parallel, max_reducer

__all__ = ["FSDPParallel", "mixed_precision_policy", "refresh_dtypes"]


def mixed_precision_policy(
    param_dtype: torch.dtype, compute_dtype: torch.dtype
) -> MixedPrecisionPolicy:
    """The FSDP2 policy for a precision's ``(param_dtype, compute_dtype)``.

    Mixed forms all-gather in the compute dtype (half the traffic; the matmuls would cast to it
    anyway) and reduce gradients in fp32; pure forms communicate in the half dtype both ways;
    fp32 and tf32 leave everything in fp32.
    """
    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=param_dtype)


def refresh_dtypes(modules: Iterable[torch.nn.Module]) -> None:
    """After the shards' dtype or the policy changed, between steps: each FSDP group's dtypes
    derived again, and the buffers of an earlier all-gather dropped (FSDP2 keeps them, in the old
    dtype, and makes them again at the next all-gather once dropped)."""
    for m in modules:
        state = m._get_fsdp_state() if isinstance(m, FSDPModule) else None
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            group._init_mp_dtypes()
            for p in group.fsdp_params:
                p.all_gather_outputs = []
                if hasattr(p, "_unsharded_param"):
                    del p._unsharded_param


class FSDPParallel(Parallel):
    """The engine's adapter for a model with ``fully_shard`` applied (module doc)."""

    name = "fsdp"
    shards_params = True

    def __init__(self, modules: list[FSDPModule]) -> None:
        self._modules = modules
        self._sync = True
        self._unsynced = False
        mesh = getattr(next(iter(self._modules[0].parameters())), "device_mesh", None)
        self._world = mesh.size() if mesh is not None else 1
        self._group = mesh.get_group() if mesh is not None and mesh.ndim == 1 else None

    @classmethod
    def of(cls, model: torch.nn.Module) -> Optional[FSDPParallel]:
        """The adapter when ``fully_shard`` was applied anywhere in ``model``, else None."""
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        return cls(modules) if modules else None

    @property
    def world_size(self) -> int:
        return self._world

    def before_backward(self, last_micro: bool) -> None:
        if last_micro != self._sync:
            for m in self._modules:
                m.set_requires_gradient_sync(last_micro, recurse=False)
            self._sync = last_micro
        self._unsynced = not last_micro

    def found_inf_reducer(self) -> Optional[Callable[[torch.Tensor], None]]:
        # DTensor gradients already reduce found_inf (max over the mesh); this also covers
        # optimizer parameters outside the sharded model. 4 bytes per step.
        return max_reducer(self._group)

    def before_step(self, params: list[torch.Tensor]) -> None:
        if self._unsynced:
            raise RuntimeError(
                "step(flush=True) under FSDP2 right after a micro-step whose gradients were not reduce-scattered "
                "(they sit unsharded on each rank): end the epoch's short window with amp.set_window(k) before "
                "its first backward() instead, so its last micro-step reduces the gradients"
            )

    def retarget(self, precision: Precision) -> None:
        """After a fallback, all-gather and reduce in the new precision's dtypes.

        FSDP2 has no public setter for the policy after ``fully_shard``; this sets the same
        attributes ``fully_shard`` initialises (between steps, when nothing is gathered).
        """
        policy = mixed_precision_policy(precision.param_dtype, precision.compute_dtype)
        for m in self._modules:
            state = m._get_fsdp_state()
            state._mp_policy = policy
            for group in state._fsdp_param_groups:
                group.mp_policy = policy
                for p in group.fsdp_params:
                    p.mp_policy = policy
        refresh_dtypes(self._modules)
