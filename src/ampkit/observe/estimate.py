"""Predict a training step's memory per precision *before* running it, allocating nothing.

The whole step -- forward, backward, optimizer step, with ampkit's engine in the given precision
-- runs on fake tensors (``torch._subclasses.FakeTensorMode``): shapes, dtypes and storages exist,
data does not. Two steps run: the first creates the optimizer state (and master gradients), the
second is measured. The parts come from the same accounting as the measurements of a real run,
applied to the fake tensors, so they agree with :func:`ampkit.memory.breakdown` and
:func:`ampkit.memory.activations` exactly:

* parameters, gradients, master weights, optimizer state: :func:`breakdown` after the measured
  backward (gradients held, as at the step's peak);
* activations: :func:`activations` (tensors saved for backward, each storage once);
* the peak: PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` over the measured step;
  ``temporaries`` is what the peak holds beyond the parts above (workspaces, gradients of
  activations in flight, the optimizer's intermediates).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable, Union

import torch

from ..step.engine import MixedPrecision
from .memory import activations, breakdown

__all__ = ["MemoryEstimate", "estimate"]

PARTS = ("parameters", "gradients", "master_weights", "optimizer_state", "activations", "temporaries")


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


def _optimizer(spec: Union[str, Callable[..., torch.optim.Optimizer]], params: Any, fused: bool) -> torch.optim.Optimizer:
    if callable(spec):
        return spec(params)
    name = str(spec).lower()
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=fused)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=fused)
    raise ValueError(f"optimizer={spec!r}; choose 'adamw', 'adam', 'sgd' or pass a callable params -> optimizer")


def _fake(obj: Any, mode: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return mode.from_tensor(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_fake(o, mode) for o in obj)
    if isinstance(obj, dict):
        return {k: _fake(v, mode) for k, v in obj.items()}
    return obj


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def estimate(
    model_or_factory: Union[torch.nn.Module, Callable[[], torch.nn.Module]],
    batch: Any,
    optimizer: Union[str, Callable[..., torch.optim.Optimizer]] = "adamw",
    precision: str = "fp32",
    device: Union[str, torch.device, None] = "cpu",
    activation_checkpointing: Union[bool, Sequence[str]] = False,
) -> MemoryEstimate:
    """Predict the peak memory of one training step of ``model`` on ``batch`` in ``precision``.

    ``model_or_factory``: a zero-argument factory (called under fake tensors: nothing of the
    model's size is allocated) or a module (copied as fake tensors). ``batch``: the tensors
    ``model(*batch)`` takes (it returns the loss), or ``batch_fn`` with ``batch_fn(0)``; they are
    read only for their shapes. ``optimizer``: ``"adamw"`` (fused, as ``ampkit train``),
    ``"adam"``, ``"sgd"`` or a callable. ``activation_checkpointing``: True (every module of a
    ``ModuleList``) or module name globs / types. Never syncs; allocates only fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("estimating for a CUDA device needs a CUDA build of torch with a GPU; use device='cpu' "
                         "here (parameter, gradient, master and optimizer bytes are the same; activations too)")
    real_batch = batch(0) if callable(batch) else batch
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        if isinstance(model_or_factory, torch.nn.Module):
            model = copy.deepcopy(model_or_factory)  # under the mode: fake copies of the parameters
        else:
            model = model_or_factory()
        if activation_checkpointing:
            from ..step.activation_checkpointing import apply_activation_checkpointing

            targets = (list(activation_checkpointing) if not isinstance(activation_checkpointing, bool) else
                       [f"{n}.*" for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)])
            apply_activation_checkpointing(model, targets)
        fused = dev.type in ("cpu", "cuda")
        opt = _optimizer(optimizer, model.parameters(), fused)
        amp = MixedPrecision(precision, device=dev, fp8_emulate=True)
        model, opt = amp.setup(model, opt)
        fake_batch = _fake(real_batch, mode)
        with amp.autocast():
            loss = _loss(model, fake_batch)
        amp.backward(loss)
        amp.step(opt)  # creates the optimizer state (and masters' gradients)
        tracker = MemTracker()
        tracker.track_external(model, opt, *amp.master_params())
        with tracker:
            with amp.autocast():
                loss = _loss(model, fake_batch)
            amp.backward(loss)
            static = breakdown(model, opt, amp)  # gradients held, as at the step's peak
            amp.step(opt)
        snapshot = tracker.get_tracker_snapshot("peak")
        if amp.precision.name == "fp8":  # activations() does not follow torchao's fp8 casts yet
            act_bytes = int(sum(d.get(k, 0) for d in snapshot.values() for k in d if str(k).endswith("ACT")))
        else:
            act_bytes = int(activations(model, fake_batch, amp.precision).total)
    peak = int(sum(d.get("Total", 0) for d in snapshot.values()))
    cats = static.by_category
    parts = {k: int(cats.get(k, 0)) for k in PARTS[:4]}
    parts["activations"] = act_bytes
    peak = max(peak, sum(parts.values()))
    parts["temporaries"] = peak - sum(parts.values())
    shapes = [list(t.shape) for t in (real_batch if isinstance(real_batch, (tuple, list)) else [real_batch])
              if isinstance(t, torch.Tensor)]
    return MemoryEstimate(precision=amp.precision.name, device=str(dev), peak_bytes=peak, parts=parts,
                          by_dtype=dict(static.by_dtype), batch_shapes=shapes)
