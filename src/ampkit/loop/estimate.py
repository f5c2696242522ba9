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
* the peak: PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` over the measured step;
  ``temporaries`` is what the peak holds beyond the parts above (workspaces, gradients of
  activations in flight, the optimizer's intermediates).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Callable, Union

import torch

from ..observe.memory import activations, breakdown
from ..step.engine import MixedPrecision
from ..step.policies.ladder import parse_rung
from .steps import Steps

__all__ = ["PLAN_PRECISIONS", "MemoryEstimate", "estimate", "largest_batch", "parse_bytes"]

# The rows of a plan (``ampkit plan``, the service's planner): fp32, the two autocast precisions and
# their pure forms. Not tf32 (fp32's memory); fp8 only where torchao is installed (the CLI adds it).
PLAN_PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure", "fp16-pure")

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


def _fake(obj: Any, mode: Any, dev: torch.device) -> Any:
    """Fake copies of a batch's tensors, on the device the step is estimated for."""
    if isinstance(obj, torch.Tensor):
        t = mode.from_tensor(obj)
        return t if t.device == dev else t.to(dev)  # under the mode: a fake tensor on `dev`
    if isinstance(obj, (tuple, list)):
        return type(obj)(_fake(o, mode, dev) for o in obj)
    if isinstance(obj, dict):
        return {k: _fake(v, mode, dev) for k, v in obj.items()}
    return obj


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
    Estimates run one at a time per process (a lock): MemTracker and the module tracker install
    global hooks, so two at once in threads would see each other's modules.
    """
    with _LOCK:
        return _estimate(model_or_factory, batch, optimizer, precision, device, activation_checkpointing)


_LOCK = threading.RLock()


def _estimate(model_or_factory: Any, batch: Any, optimizer: Any, precision: str, device: Any,
              activation_checkpointing: Any) -> MemoryEstimate:
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
        base, rung = parse_rung(precision)  # "bf16-pure:split": a rung of bf16-pure's memory ladder
        amp = MixedPrecision(base, device=dev, fp8_emulate=True, **rung)
        model, opt = amp.setup(model, opt)
        fake_batch = _fake(real_batch, mode, dev)
        run = Steps(model, opt, amp)
        run.micro_step(fake_batch)  # creates the optimizer state (and masters' gradients)
        tracker = MemTracker()
        tracker.track_external(model, opt, *amp.master_params())
        with tracker:
            run.forward_backward(fake_batch)
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
    label = amp.precision.name + (precision[len(base):] if rung else "")
    return MemoryEstimate(precision=label, device=str(dev), peak_bytes=peak, parts=parts,
                          by_dtype=dict(static.by_dtype), batch_shapes=shapes)


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(text: Union[str, int, float]) -> int:
    """``"8GiB"``, ``"512 MiB"``, ``"16GB"``, ``"1.5g"`` or a byte count -> bytes."""
    import re

    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"memory size {text!r} is not understood; write a number with a unit, e.g. 8GiB, "
                             "512MiB, 16GB (units: B, KB/KiB, MB/MiB, GB/GiB, TB/TiB)")
        value, unit = float(m.group(1)), m.group(2).lower()
    if not value > 0:
        raise ValueError(f"memory size {text!r} must be > 0")
    return int(value * _UNITS[unit])


def largest_batch(model_factory: Callable[[], torch.nn.Module], batch_of: Callable[[int], Any], budget: int,
                  precision: str = "fp32", *, activation_checkpointing: Union[bool, Sequence[str]] = False,
                  optimizer: Union[str, Callable[..., torch.optim.Optimizer]] = "adamw",
                  limit: int = 1 << 16, device: Union[str, torch.device, None] = "cpu") -> tuple[int, Any]:
    """The largest batch ``B`` whose estimated peak fits ``budget``: ``estimate(B) <= budget <
    estimate(B + 1)``. Returns ``(B, estimate at B)``; ``(0, estimate at 1)`` when not even one
    sample fits. Peak memory is close to affine in the batch, so two estimates predict ``B`` and a
    few more confirm it."""
    def at(b: int) -> MemoryEstimate:
        return estimate(model_factory, batch_of(b), optimizer, precision, device=device,
                        activation_checkpointing=activation_checkpointing)

    one = at(1)
    if one.peak_bytes > budget:
        return 0, one
    two = at(2)
    slope = max(1, two.peak_bytes - one.peak_bytes)
    lo, lo_est = 1, one  # fits
    guess = min(limit, max(1, 1 + (budget - one.peak_bytes) // slope))
    hi = None  # smallest known not to fit
    b = guess
    for _ in range(40):
        e = at(b)
        if e.peak_bytes <= budget:
            lo, lo_est = b, e
            if b >= limit:
                return b, e
            # above the prediction: confirm the next size, then grow fast until one does not fit
            b = (b + 1 if b == guess else min(limit, 2 * b)) if hi is None else (b + hi) // 2
        else:
            hi = b
            b = (lo + hi) // 2
        if hi is not None and hi - lo <= 1:
            return lo, lo_est
    return lo, lo_est
