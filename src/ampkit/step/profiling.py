"""``torch.profiler`` ranges for ampkit's phases, so that a profile shows where a step's time goes.

The ranges (``record_function`` names) are:

- ``ampkit.forward``: the forward under :meth:`MixedPrecision.autocast` (autocast, or fp32 matmuls)
- ``ampkit.backward``: :meth:`MixedPrecision.backward` (the scaled loss's backward)
- ``ampkit.unscale_check``: unscaling the gradients and the non-finite check
- ``ampkit.clip``: clipping the total gradient norm
- ``ampkit.optimizer_step``: the optimizer step (or its skip) and the scale update

They cost nothing when no profiler runs: ``record_function`` is entered only while one is active
(one C call per phase decides), otherwise a shared ``nullcontext`` (or the phase's own context)
is used as is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.autograd.profiler import record_function

__all__ = ["PHASES", "phase", "ranged"]

PHASES = (
    "ampkit.forward",
    "ampkit.backward",
    "ampkit.unscale_check",
    "ampkit.clip",
    "ampkit.optimizer_step",
)

_NULL = contextlib.nullcontext()
_profiling = (
    torch._C._autograd._profiler_enabled
)  # True while torch.profiler / autograd.profiler records


def phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """A ``record_function(name)`` range while a profiler records; a no-op context otherwise."""
    return record_function(name) if _profiling() else _NULL


def ranged(
    name: str, context: Optional[contextlib.AbstractContextManager[Any]]
) -> contextlib.AbstractContextManager[Any]:
    """``context`` (None: nothing) inside a ``name`` range while a profiler records; else ``context`` itself."""
    if not _profiling():
        return context if context is not None else _NULL
    return _both(name, context if context is not None else _NULL)


@contextlib.contextmanager
def _both(name: str, context: contextlib.AbstractContextManager[Any]) -> Iterator[None]:
    with record_function(name), context:
        yield
