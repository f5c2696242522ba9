"""FSDP2 (``fully_shard``): the precision becomes a ``MixedPrecisionPolicy``; accumulation syncs once.

Under FSDP2 each rank holds fp32 *shards* of the parameters. A forward all-gathers them in the
policy's ``param_dtype`` and a backward reduce-scatters gradients in its ``reduce_dtype`` into
fp32 sharded gradients, so for a pure precision the fp32 shards already are the master weights:
the engine keeps no second copy. The mapping (:func:`policy_for`):

============  ===============  ================  ==========================================
precision     param_dtype      reduce_dtype      compute
============  ===============  ================  ==========================================
fp32, tf32    fp32             fp32              fp32
bf16, fp8     bf16             fp32              autocast bf16 (fp32-listed ops stay fp32)
fp16          fp16             fp32              autocast fp16 + dynamic loss scaling
bf16-pure     bf16             bf16              bf16; fp32 shards are the masters
fp16-pure     fp16             fp16              fp16 + loss scaling; fp32 shards are masters
============  ===============  ================  ==========================================

Mixed forms all-gather in the half dtype (half the traffic; the matmuls would cast to it anyway)
and reduce gradients in fp32 (the sum over ranks stays exact to fp32); pure forms communicate in
the half dtype both ways.

:class:`FSDPParallel` turns gradient reduce-scatter off on the micro-steps that do not end an
accumulation window (``set_requires_gradient_sync(False)``; FSDP2 then accumulates unsharded
gradients locally) and on again for the last, so there is one reduction per optimizer step.
The finite check needs no extra collective: on DTensor gradients PyTorch's
``_amp_foreach_non_finite_check_and_unscale_`` reduces ``found_inf`` over the mesh with ``max``,
so every rank skips the same steps and backs the scale off together. Clipping runs on the
DTensor gradients and returns the global total norm on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..step.hardware import device_info
from ..step.parallel import Parallel
from ..step.precision import Precision, parse_precision, resolve_precision
from .env import max_reducer

__all__ = ["FSDPParallel", "fsdp_modules", "policy_for", "shard"]

_HALF = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16,
         "bf16-pure": torch.bfloat16, "fp16-pure": torch.float16}


def policy_for(precision: Union[str, Precision]) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` that runs ``precision`` under FSDP2 (module doc's table)."""
    name = precision.name if isinstance(precision, Precision) else parse_precision(precision)
    if name == "auto":
        raise ValueError("policy_for('auto'): resolve the precision for a device first "
                         "(ampkit.resolve_precision('auto', ampkit.device_info(device)))")
    half = _HALF.get(name)
    if half is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=half if name.endswith("-pure") else torch.float32)


def _default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every element of every ``nn.ModuleList`` (transformer blocks, as torchtitan shards them)."""
    return [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst
            if any(True for _ in m.parameters())]


def shard(model: torch.nn.Module, precision: Union[str, Precision] = "auto", *,
          mesh: Any = None, blocks: Union[Sequence[torch.nn.Module], Callable[[torch.nn.Module], bool], None] = None,
          reshard_after_forward: bool = True, device: Union[str, torch.device, None] = None) -> torch.nn.Module:
    """Apply ``fully_shard`` to ``model``'s blocks and then to ``model``, with ``precision``'s policy.

    Args:
        precision: a name, alias or :class:`Precision`; ``"auto"`` is resolved for ``device``.
        mesh: a ``DeviceMesh`` (default: every rank of the default group, on the model's device type).
        blocks: the modules that get their own FSDP group (one all-gather / reduce-scatter each):
            a list, or a predicate over ``model.modules()``; default: the elements of every
            ``nn.ModuleList`` (transformer blocks). The root gets the rest.
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3; ``False`` is ZeRO-2).

    The process group must exist (:func:`ampkit.distributed.init`). Returns ``model`` (sharded in place).
    """
    if isinstance(precision, str) and parse_precision(precision) == "auto":
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        precision = resolve_precision("auto", device_info(dev))
    policy = policy_for(precision)
    if blocks is None:
        chosen = _default_blocks(model)
    elif callable(blocks):
        chosen = [m for m in model.modules() if m is not model and blocks(m)]
    else:
        chosen = list(blocks)
    for m in chosen:
        if m is model:
            raise ValueError("blocks= must not contain the model itself: the root is sharded last anyway")
        fully_shard(m, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` was applied to (the root first, if sharded)."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class FSDPParallel(Parallel):
    """The engine's adapter for a model with ``fully_shard`` applied (module doc)."""

    name = "fsdp"
    shards_params = True

    def __init__(self, modules: Iterable[FSDPModule]) -> None:
        self._modules = list(modules)
        self._sync = True
        self._unsynced = False
        mesh = getattr(next(iter(self._modules[0].parameters())), "device_mesh", None)
        self._world = mesh.size() if mesh is not None else 1
        self._group = mesh.get_group() if mesh is not None and mesh.ndim == 1 else None

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
                "its first backward() instead, so its last micro-step reduces the gradients")

    def retarget(self, precision: Any) -> None:
        """After a fallback, all-gather and reduce in the new precision's dtypes.

        FSDP2 has no public setter for the policy after ``fully_shard``; this sets the same
        attributes ``fully_shard`` initialises (between steps, when nothing is gathered).
        """
        policy = policy_for(precision)
        for m in self._modules:
            state = m._get_fsdp_state()
            state._mp_policy = policy
            for group in state._fsdp_param_groups:
                group.mp_policy = policy
                for p in group.fsdp_params:
                    p.mp_policy = policy
                    p.init_dtype_attrs(policy)


def adapter(model: torch.nn.Module) -> Optional[FSDPParallel]:
    """An :class:`FSDPParallel` when ``fully_shard`` was applied anywhere in ``model``, else None."""
    modules = fsdp_modules(model)
    return FSDPParallel(modules) if modules else None
