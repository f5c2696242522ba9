"""Predict a training step's memory per precision *before* running it, allocating nothing.

The whole step -- forward, backward, optimizer step, with ampkit's engine in the given precision
-- runs on fake tensors (``torch._subclasses.FakeTensorMode``): shapes, dtypes and storages exist,
data does not. Two steps run: the first creates the optimizer state (and master gradients), the
second is measured. The parts come from the same accounting as the measurements of a real run,
applied to the fake tensors, so they agree with :func:`ampkit.observe.memory.breakdown` and
:func:`ampkit.observe.memory.activations` exactly:

* parameters, gradients, master weights, optimizer state: :func:`breakdown` after the measured
  backward (gradients held, as at the step's peak);
* activations: :func:`activations` (tensors saved for backward, each storage once);
* the peak: the live bytes after every operation of the measured step
  (:class:`ampkit.plan.tracker.StepTracker`: PyTorch's ``MemTracker`` accounting, byte for byte,
  without its per-module snapshots);
  ``temporaries`` is what the peak holds beyond the parts above (workspaces, gradients of
  activations in flight, the optimizer's intermediates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

import torch

# PLAN_PRECISIONS, the rows of a plan (``ampkit plan``, the service's planner): the registry rows
# marked ``planned`` -- fp32, bf16, fp16 and their pure forms. Not tf32 (fp32's memory); fp8 only
# where torchao is installed (the CLI adds it). Re-exported here, its historical home.
from ..loop.steps import batch_loss
from ..step.precision import PLAN_PRECISIONS
from .session import PARTS, Measure, Session, fit  # noqa: F401  (PARTS: re-exported)

__all__ = [
    "PLAN_PRECISIONS",
    "MemoryEstimate",
    "estimate",
    "largest_batch",
    "parse_bytes",
    "size_text",
]


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted memory of one training step: ``peak_bytes`` and its parts (bytes)."""

    precision: str
    device: str
    peak_bytes: int
    parts: dict[str, int]
    by_dtype: dict[str, int]
    batch_shapes: list[list[int]]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(
    model_or_factory: Union[torch.nn.Module, Callable[[], torch.nn.Module]],
    batch: Any,
    optimizer: Union[str, Callable[..., torch.optim.Optimizer]] = "adamw",
    precision: str = "fp32",
    device: Union[str, torch.device, None] = "cpu",
    activation_checkpointing: Union[bool, Sequence[str]] = False,
    *,
    loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
) -> MemoryEstimate:
    """Predict the peak memory of one training step of ``model`` on ``batch`` in ``precision``.

    ``model_or_factory``: a zero-argument factory (called under fake tensors: nothing of the
    model's size is allocated) or a module (copied as fake tensors). ``batch``: the tensors
    ``model(*batch)`` takes (it returns the loss), ``batch_fn`` with ``batch_fn(0)``, or a
    ``DataLoader`` (any iterable of batches that is not itself a tensor, tuple, list or dict) with
    its first batch; they are read only for their shapes. ``optimizer``: ``"adamw"`` (fused, as ``ampkit train``),
    ``"adam"``, ``"sgd"`` or a callable. ``activation_checkpointing``: True (every module of a
    ``ModuleList``) or module name globs / types. ``loss_fn``: the Trainer's ``loss_fn(model,
    batch) -> scalar loss`` (default ``model(*batch)`` is the loss), for a model that returns
    outputs. Never syncs; allocates only fake tensors.
    Estimates run one at a time per process (a lock): the tracker installs global module hooks and
    the fake mode is per thread, so two at once in threads would see each other's modules.
    """
    real_batch = _one_batch(batch)
    with Session(
        model_or_factory,
        optimizer,
        precision,
        device,
        activation_checkpointing,
        loss_fn=loss_fn or batch_loss,
    ) as session:
        m = session.measure(real_batch)
    return _from_measure(m, session.dev, real_batch)


def _one_batch(batch: Any) -> Any:
    """The batch an estimate measures: ``batch(0)`` of an index function, the first batch of a
    ``DataLoader`` or another iterable of batches, else ``batch`` itself (a tensor, or the tuple,
    list or dict of them that ``model(*batch)`` takes)."""
    if callable(batch):
        return batch(0)
    if isinstance(batch, (torch.Tensor, tuple, list, dict, str, bytes)) or not hasattr(
        batch, "__iter__"
    ):
        return batch
    try:
        return next(iter(batch))
    except StopIteration:
        raise ValueError(
            f"batch: {type(batch).__name__} gave no batch (it is empty); pass one batch, a "
            "function of the batch index, or a DataLoader with at least one batch"
        ) from None


def _from_measure(m: Measure, dev: torch.device, batch: Any) -> MemoryEstimate:
    shapes = [
        list(t.shape)
        for t in (batch if isinstance(batch, (tuple, list)) else [batch])
        if isinstance(t, torch.Tensor)
    ]
    return MemoryEstimate(
        precision=m.precision,
        device=str(dev),
        peak_bytes=m.peak_bytes,
        parts=dict(m.parts),
        by_dtype=dict(m.by_dtype),
        batch_shapes=shapes,
    )


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def parse_bytes(text: Union[str, int, float]) -> int:
    """``"8GiB"``, ``"512 MiB"``, ``"16GB"``, ``"1.5g"`` or a byte count -> bytes. ``ValueError``
    for text that is no size, and for a size that is not > 0 (``"-1GiB"`` says so)."""
    import re

    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(
                f"memory size {text!r} is not understood; write a number with a unit, e.g. 8GiB, "
                "512MiB, 16GB (units: B, KB/KiB, MB/MiB, GB/GiB, TB/TiB)"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    if not value > 0:
        raise ValueError(f"memory size {text!r} must be > 0")
    return int(value * _UNITS[unit])


def size_text(n: Optional[int]) -> str:
    """Bytes as a plan shows them: ``"1.50 GiB"``, ``"512.0 MiB"`` (``"—"`` for None)."""
    if n is None:
        return "—"
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def largest_batch(
    model_factory: Callable[[], torch.nn.Module],
    batch_of: Callable[[int], Any],
    budget: int,
    precision: str = "fp32",
    *,
    activation_checkpointing: Union[bool, Sequence[str]] = False,
    optimizer: Union[str, Callable[..., torch.optim.Optimizer]] = "adamw",
    limit: int = 1 << 16,
    device: Union[str, torch.device, None] = "cpu",
    loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
) -> tuple[int, Any]:
    """The largest batch ``B`` whose estimated peak fits ``budget``: ``estimate(B) <= budget <
    estimate(B + 1)``. Returns ``(B, estimate at B)``; ``(0, estimate at 1)`` when not even one
    sample fits. The model is built and warmed up once; two measured batch sizes give the affine
    memory model (:class:`ampkit.plan.session.Curve`), whose answer ``B`` and ``B + 1``
    are then measured (a bisection over measures only if the curve missed). ``loss_fn``: as
    :func:`estimate`'s."""
    with Session(
        model_factory,
        optimizer,
        precision,
        device,
        activation_checkpointing,
        loss_fn=loss_fn or batch_loss,
    ) as session:
        b, m, _ = fit(session, batch_of, budget, limit)
    return b, _from_measure(m, session.dev, batch_of(max(b, 1)))
