"""Exact memory accounting: bytes by category and dtype, activations saved for backward, peak memory.

Everything counts *storages*, each once: a tensor that views another's storage (tied weights, a
saved tensor that is a view of a parameter) adds nothing. Byte counts are ``storage.nbytes()``,
i.e. exactly what the allocator was asked for, not an estimate from shapes.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from ..step.precision import Precision, PrecisionError, resolve_precision
from .monitor.core import peak_memory_bytes

__all__ = [
    "ActivationReport",
    "MemoryBreakdown",
    "activations",
    "breakdown",
    "peak",
]  # + estimate (lazy)

CATEGORIES = ("parameters", "gradients", "optimizer_state", "master_weights", "scaler", "scratch")


def _key(t: torch.Tensor) -> tuple[str, int]:
    # The storage's identity (its StorageImpl), not its data pointer: fake tensors (memory
    # estimates) have no data, and empty storages can share a null pointer.
    return (str(t.device), t.untyped_storage()._cdata)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes by category and dtype. ``cells[(category, dtype)]`` is exact; the rest are sums."""

    cells: dict[tuple[str, str], int]

    @property
    def by_category(self) -> dict[str, int]:
        out = dict.fromkeys(CATEGORIES, 0)
        for (cat, _), n in self.cells.items():
            out[cat] += n
        return out

    @property
    def by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_, dt), n in self.cells.items():
            out[dt] += n
        return dict(out)

    @property
    def total(self) -> int:
        return sum(self.cells.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_category": self.by_category,
            "by_dtype": self.by_dtype,
            "cells": [
                {"category": c, "dtype": d, "bytes": n} for (c, d), n in sorted(self.cells.items())
            ],
        }

    def table(self, title: str = "memory by category and dtype") -> Any:
        from rich.table import Table

        dtypes = sorted(self.by_dtype)
        t = Table(title=title)
        t.add_column("category")
        for d in dtypes:
            t.add_column(d, justify="right")
        t.add_column("total", justify="right")
        for cat in CATEGORIES:
            row = [_mib(self.cells.get((cat, d), 0)) for d in dtypes]
            t.add_row(cat, *row, _mib(self.by_category[cat]))
        t.add_row(
            "total", *[_mib(self.by_dtype[d]) for d in dtypes], _mib(self.total), style="bold"
        )
        return t


def _mib(n: int) -> str:
    return f"{n / 2**20:,.3f} MiB" if n else "—"


def breakdown(
    model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, amp: Any = None
) -> MemoryBreakdown:
    """Bytes of parameters, gradients, optimizer state, master weights, scaler state and the
    memory ladder's kept scratch, by dtype.

    Each storage is counted once, in the first category that holds it (in the order above).
    ``amp`` (a :class:`ampkit.MixedPrecision`) contributes its scaler tensors and, for the pure
    precisions, its fp32 master weights. No device sync.
    """
    seen: set[tuple[str, int]] = set()
    cells: dict[tuple[str, str], int] = defaultdict(int)

    def add(category: str, t: Optional[torch.Tensor]) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        k = _key(t)
        if k in seen:
            return
        seen.add(k)
        cells[(category, _dtype_name(t.dtype))] += t.untyped_storage().nbytes()

    params = list(model.parameters())
    for p in params:
        add("parameters", p)
    for p in params:
        add("gradients", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add("optimizer_state", v)
    masters = list(getattr(amp, "master_params", lambda: [])()) if amp is not None else []
    for m in masters:
        add(
            "gradients", m.grad
        )  # pure precisions: on the masters (bf16 where the ladder keeps them)
    if amp is not None:
        for t in masters:
            add("master_weights", t)
        # bf16-pure's memory ladder: 16-bit remainders / bf16 compensations stand in for fp32 masters
        for t in getattr(getattr(amp, "policy", None), "master_storage", list)():
            add("master_weights", t)
        scaler = getattr(amp, "scaler", None)
        if scaler is not None:
            for t in scaler.device_tensors():
                add("scaler", t)
        # the ladder's bounded scratch (ladder_scratch_mib), kept between steps
        for t in getattr(getattr(amp, "policy", None), "scratch_storage", list)():
            add("scratch", t)
    return MemoryBreakdown(cells=dict(cells))


@dataclass(frozen=True)
class ActivationReport:
    """Bytes saved for backward during one forward (+ loss) under one precision."""

    precision: str
    total: int
    by_dtype: dict[str, int]
    by_module: dict[str, int]
    tensors: int
    excluded_parameter_bytes: int = 0
    details: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "total": self.total,
            "by_dtype": self.by_dtype,
            "by_module": self.by_module,
            "tensors": self.tensors,
            "excluded_parameter_bytes": self.excluded_parameter_bytes,
        }


def activations(
    model: torch.nn.Module,
    example_inputs: Any,
    precision: Union[str, Precision, torch.dtype] = "fp32",
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
) -> ActivationReport:
    """Measure the tensors autograd saves for backward in one forward under ``precision``.

    Uses ``torch.autograd.graph.saved_tensors_hooks``: every saved tensor is seen as it is packed,
    each storage counted once, attributed to the top-level child module running at the time
    (``"(top)"`` outside them, e.g. the loss). Parameters and buffers saved as-is are excluded
    (they are not activations; their bytes are reported separately); weight *casts* made by
    autocast are included, since they live until backward. ``example_inputs`` is a tensor, a
    tuple of positional inputs, or a dict of keyword inputs. The model is not modified (pure
    precisions run on a cast copy). ``loss_fn(output)`` is included if given. No backward runs.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    p = precision if isinstance(precision, Precision) else resolve_precision(precision, device)
    if not p.row.measures_activations:
        raise PrecisionError(
            f"activations() does not measure {p.name} yet (torchao's fp8 casts "
            "are not followed); choose fp32, tf32, bf16, fp16 or a pure form"
        )
    # A model set up for a pure precision already holds half weights; others run on a cast copy.
    cast = p.is_pure and not any(q.dtype == p.param_dtype for q in model.parameters())
    run_model = copy.deepcopy(model).to(p.param_dtype) if cast else model
    args, kwargs = (
        (example_inputs, {}) if not isinstance(example_inputs, dict) else ((), example_inputs)
    )
    if isinstance(args, torch.Tensor):
        args = (args,)
    if p.is_pure:
        args = tuple(
            a.to(p.param_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        )
    with (
        torch.autocast(device.type, dtype=p.compute_dtype, enabled=p.autocast_enabled),
        saved_activations(run_model, by_module=True) as saved,
    ):
        out = run_model(*args, **kwargs)
        if loss_fn is not None:
            saved.current[:] = ["(loss)"]
            out = loss_fn(out)
    del out
    return ActivationReport(
        precision=p.name,
        total=saved.total,
        by_dtype=dict(saved.by_dtype),
        by_module=dict(saved.by_module),
        tensors=len(saved.details),
        excluded_parameter_bytes=saved.excluded,
        details=saved.details,
    )


class SavedActivations:
    """What :func:`saved_activations` counted: bytes by dtype and by module, each saved storage
    once; parameters and buffers saved as they are in ``excluded``."""

    def __init__(self, own: set[tuple[str, int]], details: bool) -> None:
        self.own, self.keep_details = own, details
        self.seen: set[tuple[str, int]] = set()
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.by_module: dict[str, int] = defaultdict(int)
        self.details: list[dict[str, Any]] = []
        self.excluded = 0
        self.current = ["(top)"]

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k in self.seen:
            return t
        self.seen.add(k)
        n = t.untyped_storage().nbytes()
        if k in self.own:
            self.excluded += n
            return t
        self.by_dtype[_dtype_name(t.dtype)] += n
        self.by_module[self.current[-1]] += n
        if self.keep_details:
            self.details.append(
                {
                    "module": self.current[-1],
                    "dtype": _dtype_name(t.dtype),
                    "shape": list(t.shape),
                    "bytes": n,
                }
            )
        return t


@contextlib.contextmanager
def saved_activations(
    model: torch.nn.Module, *, by_module: bool = False
) -> Iterator[SavedActivations]:
    """Count the tensors autograd saves for backward while the block runs (``saved_tensors_hooks``):
    :func:`activations` on a forward it runs itself, the memory estimate on the forward of the step
    it measures (one forward instead of two). ``by_module``: attribute each to the top-level child
    running at the time (forward hooks) and keep a line per tensor."""
    saved = SavedActivations(
        {_key(t) for t in list(model.parameters()) + list(model.buffers())}, by_module
    )
    handles = []
    if by_module:
        for name, child in _units(model):
            handles.append(
                child.register_forward_pre_hook(lambda m, a, _n=name: saved.current.append(_n))
            )
            handles.append(
                child.register_forward_hook(lambda m, a, o: saved.current.pop() and None)
            )
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            yield saved
    finally:
        for h in handles:
            h.remove()


def _units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Top-level children; containers that are never called (ModuleList/Dict) are opened up."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            out.append((name, child))
    return out


def peak(device: Union[str, torch.device, None] = None) -> int:
    """Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, peak RSS of this process on CPU."""
    from ..step.hardware import normalize_device

    return peak_memory_bytes(normalize_device(device))
