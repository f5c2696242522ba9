"""FSDP2 (``fully_shard``): the precision becomes a ``MixedPrecisionPolicy``; accumulation syncs once.

Under FSDP2 each rank holds fp32 *shards* of the parameters. A forward all-gathers them in the
policy's ``param_dtype`` and a backward reduce-scatters gradients in its ``reduce_dtype`` into
fp32 sharded gradients, so for a pure precision the fp32 shards already are the master weights:
the engine keeps no second copy. The mapping (:func:`fsdp_policy`):

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

The engine cooperates with a sharded model through its own adapter
(:class:`ampkit.step.parallel.fsdp.FSDPParallel`, picked from the model at ``amp.setup``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Union

import torch

from ..step.hardware import device_info
from ..step.precision import Precision, parse_precision, precision_dtypes, resolve_precision
from ..step.rung import split_spec

if TYPE_CHECKING:  # torch.distributed.fsdp takes about a second to import: only where used
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

__all__ = ["fsdp_modules", "fsdp_policy", "policy_for", "shard"]


def fsdp_policy(precision: Union[str, Precision]) -> MixedPrecisionPolicy:
    """The FSDP2 ``MixedPrecisionPolicy`` that runs ``precision`` (module doc's table): what to
    pass as ``fully_shard(..., mp_policy=...)``. (The engine's own per-family policy object is
    :func:`ampkit.step.policies.policy_for`'s, a different thing.)"""
    if isinstance(precision, str):  # a rung ("bf16-pure:stochastic+bf16") communicates alike
        precision = split_spec(precision)[0]
    name = precision.name if isinstance(precision, Precision) else parse_precision(precision)
    if name == "auto":
        raise ValueError(
            "fsdp_policy('auto'): resolve the precision for a device first "
            "(ampkit.resolve_precision('auto', ampkit.device_info(device)))"
        )
    from ..step.parallel.fsdp import mixed_precision_policy

    return mixed_precision_policy(*precision_dtypes(name))


#: The name of earlier releases, kept working: :func:`fsdp_policy`.
policy_for = fsdp_policy


def _default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every element of every ``nn.ModuleList`` (transformer blocks, as torchtitan shards them)."""
    return [
        m
        for lst in model.modules()
        if isinstance(lst, torch.nn.ModuleList)
        for m in lst
        if any(True for _ in m.parameters())
    ]


def shard(
    model: torch.nn.Module,
    precision: Union[str, Precision] = "auto",
    *,
    mesh: Any = None,
    blocks: Union[Sequence[torch.nn.Module], Callable[[torch.nn.Module], bool], None] = None,
    reshard_after_forward: bool = True,
    device: Union[str, torch.device, None] = None,
) -> torch.nn.Module:
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
    if isinstance(precision, str):  # a rung ("bf16-pure:stochastic") shards alike
        precision = split_spec(precision)[0]
    if isinstance(precision, str) and parse_precision(precision) == "auto":
        dev = torch.device(device) if device is not None else next(model.parameters()).device
        precision = resolve_precision("auto", device_info(dev))
    from torch.distributed.fsdp import fully_shard

    policy = fsdp_policy(precision)
    if blocks is None:
        chosen = _default_blocks(model)
    elif callable(blocks):
        chosen = [m for m in model.modules() if m is not model and blocks(m)]
    else:
        chosen = list(blocks)
    for m in chosen:
        if m is model:
            raise ValueError(
                "blocks= must not contain the model itself: the root is sharded last anyway"
            )
        fully_shard(m, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` was applied to (the root first, if sharded)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []  # fully_shard cannot have been applied: nothing to import
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]
