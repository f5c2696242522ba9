"""Model and optimizer state in a form that survives a change of wrapper.

A plain module's state is ``model.state_dict()`` and ``optimizer.state_dict()`` (parameters
numbered), as it always was. A DDP or FSDP2 model's state is PyTorch's own
``torch.distributed.checkpoint.state_dict.get_state_dict``: keys without DDP's ``module.``
prefix, DTensor shards under FSDP2, and optimizer state keyed by parameter *name* (FQN), so a
checkpoint written by 2 FSDP ranks loads into 1 DDP rank or into a plain module, and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from .fsdp import fsdp_modules

__all__ = ["capture", "fqn_keyed", "id_keyed", "is_wrapped", "restore"]


def is_wrapped(model: torch.nn.Module) -> bool:
    """True for a DDP model or one with ``fully_shard`` applied."""
    return isinstance(model, DistributedDataParallel) or bool(fsdp_modules(model))


def capture(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state, optimizer_state)`` (module doc). Under FSDP2 a collective: call on every rank."""
    if not is_wrapped(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)


def restore(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
) -> None:
    """Load what :func:`capture` returned (either form) into ``model`` and ``optimizer``."""
    if not is_wrapped(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(id_keyed(optimizer_state, model, optimizer))
        return
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=fqn_keyed(optimizer_state, model, optimizer),
    )


def _names(model: torch.nn.Module) -> dict[int, str]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {id(p): n for n, p in inner.named_parameters(remove_duplicate=False)}


def _is_fqn_keyed(state: dict[str, Any]) -> bool:
    groups = state.get("param_groups") or []
    return any(isinstance(p, str) for g in groups for p in g.get("params", ()))


def id_keyed(
    state: dict[str, Any],
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """An optimizer state keyed by parameter number, as ``optimizer.load_state_dict`` wants.

    Numbers follow ``optimizer``'s groups (its parameters named through ``model``), or, without
    them, the order the names appear in ``state``'s own groups -- the numbering a plain
    ``optimizer.state_dict()`` of the same model and groups has.
    """
    if not _is_fqn_keyed(state):
        return state
    if optimizer is not None and model is not None:
        names = _names(model)
        order = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    else:
        order = [list(g["params"]) for g in state["param_groups"]]
    number = {}
    for group in order:
        for name in group:
            number.setdefault(name, len(number))
    groups = [
        {**g, "params": [number[n] for n in names]}
        for g, names in zip(state["param_groups"], order)
    ]
    return {
        "state": {number[k]: v for k, v in state["state"].items() if k in number},
        "param_groups": groups,
    }


def fqn_keyed(
    state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (what ``set_state_dict`` wants), from either form."""
    if _is_fqn_keyed(state):
        return state
    names = _names(model)
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    groups = []
    for g in state["param_groups"]:
        groups.append({**g, "params": [order[i] for i in g["params"]]})
    return {"state": {order[k]: v for k, v in state["state"].items()}, "param_groups": groups}
