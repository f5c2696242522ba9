"""What :meth:`MixedPrecision.setup` does to a model before its precision's policy: refuse
``nn.DataParallel``, and apply ``memory_efficient``'s activation checkpointing.

``nn.DataParallel`` is refused rather than supported: its replicas run the forward in worker
threads, and autocast's state is thread-local, so on CUDA a replica re-enters autocast with
DataParallel's own settings instead of ampkit's dtype (a bf16 run's replicas would compute in
fp16 without a loss scaler). DistributedDataParallel (one process per GPU) has none of this and
is faster; ampkit's DDP adapter handles it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["before_setup", "memory_levers", "refuse_data_parallel"]


def refuse_data_parallel(model: torch.nn.Module) -> None:
    """Raise ``TypeError`` if ``model`` is, or holds, a ``torch.nn.DataParallel``."""
    wrapped = [
        name or "the model"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.DataParallel)
    ]
    if wrapped:
        raise TypeError(
            f"torch.nn.DataParallel is not supported ({', '.join(wrapped[:3])}): its replica threads do not "
            "inherit ampkit's autocast dtype (thread-local state), so they would compute in another precision. "
            "Use DistributedDataParallel, one process per GPU: `ampkit train --nproc_per_node N`, or "
            "torchrun with `model = DistributedDataParallel(model)` before amp.setup(model, optimizer) "
            "(docs/guides/distributed.md). To train on one GPU, pass the unwrapped module (model.module)."
        )


def memory_levers(model: torch.nn.Module, config: Any) -> list[str]:
    """Turn on ``config.memory_efficient``'s levers that need the model; returns what each did.

    The levers keep the numerics (the same values, computed again or cast again): activation
    checkpointing of the repeated blocks (the elements of every ``nn.ModuleList``; recomputed in
    backward instead of stored), and the autocast cache off (set by the config itself). Nothing
    when ``memory_efficient`` is off.
    """
    if not getattr(config, "memory_efficient", False):
        return []
    from .activation_checkpointing import apply_activation_checkpointing

    lists = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    levers = []
    if lists:
        done = apply_activation_checkpointing(model, [f"{n}.*" if n else "*" for n in lists])
        levers.append(
            f"activation checkpointing of {len(done)} block(s) ({', '.join(done[:4])}"
            f"{', ...' if len(done) > 4 else ''})"
        )
    else:
        levers.append(
            "activation checkpointing: not applied, the model has no repeated blocks (nn.ModuleList); "
            "choose modules with "
            "ampkit.step.activation_checkpointing.apply_activation_checkpointing(model, targets)"
        )
    levers.append(
        "autocast cache off (casts of the weights are redone in each use instead of kept)"
    )
    return levers


def before_setup(model: torch.nn.Module, config: Any) -> list[str]:
    """:func:`refuse_data_parallel`, then :func:`memory_levers`; returns the levers' notes."""
    refuse_data_parallel(model)
    return memory_levers(model, config)
