"""Activation checkpointing: recompute chosen modules' activations in backward instead of storing them.

``apply_activation_checkpointing(model, targets)`` makes every module matching ``targets``
(qualified-name globs or module types, as for ``keep_fp32``) run through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. It swaps the module's class for a
subclass whose ``forward`` checkpoints the original one, so parameters, ``state_dict`` keys and
``deepcopy`` are unchanged; ``remove_activation_checkpointing`` swaps it back. Works under
autocast: the non-reentrant implementation replays the forward with the autocast state of the
original call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Union

import torch
from torch.utils.checkpoint import checkpoint

from .overrides import match_modules

__all__ = ["apply_activation_checkpointing", "remove_activation_checkpointing"]

_CACHE: dict[type, type] = {}


def _checkpointed(cls: type) -> type:
    if cls not in _CACHE:

        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return cls.forward(self, *args, **kwargs)  # nothing to save in eval / no_grad
            return checkpoint(cls.forward, self, *args, use_reentrant=False, **kwargs)

        _CACHE[cls] = type(
            f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_ampkit_original": cls}
        )
    return _CACHE[cls]


def apply_activation_checkpointing(
    model: torch.nn.Module, targets: Iterable[Union[str, type]]
) -> list[str]:
    """Checkpoint every module matching ``targets``; returns their qualified names. A target that
    matches nothing raises ``ValueError`` listing close names. Nested matches: the outermost wins."""
    matched = match_modules(model, targets)
    names = sorted({n for hits in matched.values() for n in hits})
    names = [n for n in names if not any(n != o and n.startswith(o + ".") for o in names)]
    modules = dict(model.named_modules())
    for n in names:
        m = modules[n]
        if not hasattr(type(m), "_ampkit_original"):
            m.__class__ = _checkpointed(type(m))
    return names


def remove_activation_checkpointing(model: torch.nn.Module) -> None:
    for m in model.modules():
        original = getattr(type(m), "_ampkit_original", None)
        if original is not None:
            m.__class__ = original
