"""The live bytes of a training step on fake tensors, after every operation: what the memory
estimate measures (:class:`ampkit.plan.session.Session`).

PyTorch's ``MemTracker`` (``torch/distributed/_tools/mem_tracker.py``) counts the same bytes -- every
storage an operation returns, plus the parameters, buffers, gradients, optimizer state and masters
registered before the step, each until its storage is freed (a weak reference's callback) -- and
this tracker keeps its accounting rules: a storage is counted once however many views share it, a
storage that grew is counted at its new size, a CUDA storage is rounded up to the allocator's
512 bytes. It keeps nothing else: MemTracker also copies a per-category snapshot at every
module's entry and exit in the forward and the backward, and installs a gradient hook per
parameter, which doubled the cost of a measured step (GPT large, one block: 173 ms with MemTracker,
86 ms without tracking; the figures in docs/benchmarks.md).

Two totals are kept, as the estimate needs them: all live bytes (the timeline, its peak) and the
bytes made by the forward -- an operation before the step's loss, or a checkpointed block's
recomputation during the backward -- still alive at the peak (MemTracker's ``ACT`` category, what
the estimate reports as fp8's activations)."""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

__all__ = ["StepTracker"]

_CUDA_BLOCK = (
    512  # the CUDA caching allocator's smallest block (MemTracker's _PYTORCH_MIN_ALLOCATE)
)


def _storages(t: torch.Tensor) -> list[Any]:
    """The storages behind ``t``: its own, or its inner tensors' for a wrapper subclass (fp8)."""
    if not is_traceable_wrapper_subclass(t):
        return [t.untyped_storage()]
    out = []
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            out.extend(_storages(inner))
    return out


class StepTracker(TorchDispatchMode):
    """``with StepTracker() as t: <step>``: ``t.timeline`` (live bytes after each operation),
    ``t.peak`` and ``t.peak_forward_bytes``. Register what exists before the step with
    :meth:`track_external`; call :meth:`backward` when the forward's loss is computed and
    :meth:`optimizer` before the optimizer step (the forward bytes' bounds). ``block``: the bytes an
    allocator takes for a storage of ``n`` bytes (a plan for another device,
    :meth:`ampkit.plan.devices.GPU.block_bytes`); by default a storage's own bytes, CUDA's
    rounded to 512."""

    def __init__(self, block: Optional[Callable[[int], int]] = None) -> None:
        super().__init__()
        self._block = block
        self.timeline: list[int] = []
        self.total = self.forward_total = self.peak = self.peak_forward_bytes = 0
        self._live: dict[
            int, list[Any]
        ] = {}  # id(storage) -> [weakref, bytes, made by the forward, made at]
        self.grad_timeline: list[
            int
        ] = []  # the gradients' bytes after each operation (mark_gradients)
        self._grads: set[int] = set()
        self.grad_total = 0
        self._marked = False
        self._phase = "forward"
        self._in_module = (
            0  # modules being run (a checkpointed block's recomputation in the backward)
        )
        self._hooks: list[Any] = []

    # what is registered or made -------------------------------------------------------------
    def _add(self, t: torch.Tensor, forward: bool) -> None:
        cuda = t.device.type == "cuda"
        for st in _storages(t):
            n = st.nbytes()
            if self._block is not None:
                n = self._block(n)
            elif cuda:
                n = -(-n // _CUDA_BLOCK) * _CUDA_BLOCK
            entry = self._live.get(id(st))
            if entry is not None:
                if entry[1] != n:  # resized in place
                    self.total += n - entry[1]
                    if entry[2]:
                        self.forward_total += n - entry[1]
                    entry[1] = n
                continue
            key = id(st)
            self._live[key] = [
                weakref.ref(st, functools.partial(self._freed, key)),
                n,
                forward,
                len(self.timeline),
            ]
            self.total += n
            if forward:
                self.forward_total += n

    def _freed(self, key: int, _ref: Any) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.total -= entry[1]
            if entry[2]:
                self.forward_total -= entry[1]
            if key in self._grads:
                self._grads.discard(key)
                self.grad_total -= entry[1]

    def track_external(self, *objs: Any) -> None:
        """Count tensors made before the step: a module's parameters, buffers and gradients, an
        optimizer's state, or tensors."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    self._add(p, False)
                    if p.grad is not None:
                        self._add(p.grad, False)
                for b in obj.buffers():
                    self._add(b, False)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            self._add(v, False)
            elif isinstance(obj, torch.Tensor):
                self._add(obj, False)

    def mark_gradients(self, tensors: Any) -> None:
        """Count ``tensors`` (the step's gradients, all made since the step began) apart: from now
        on :attr:`grad_timeline` follows their live bytes after every operation, and its past is
        filled in from when each was made (what a plan of the optimizer in backward subtracts)."""
        self._marked = True
        made = [0] * (len(self.timeline) + 1)
        for t in tensors:
            for st in _storages(t):
                entry = self._live.get(id(st))
                if entry is None or id(st) in self._grads:
                    continue
                self._grads.add(id(st))
                self.grad_total += entry[1]
                made[max(0, entry[3])] += entry[1]
        held, self.grad_timeline = 0, []
        for n in made[: len(self.timeline)]:
            held += n
            self.grad_timeline.append(held)

    # the phases ----------------------------------------------------------------------------
    def backward(self) -> None:
        self._phase = "backward"

    def optimizer(self) -> None:
        self._phase = "optimizer"

    def _made_by_forward(self) -> bool:
        return self._phase == "forward" or (self._phase == "backward" and self._in_module > 0)

    def _enter_module(self, *_: Any) -> None:
        self._in_module += 1

    def _exit_module(self, *_: Any) -> None:
        self._in_module -= 1

    def __enter__(self) -> StepTracker:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        self._hooks = [
            register_module_forward_pre_hook(self._enter_module),
            register_module_forward_hook(self._exit_module, always_call=True),
        ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if (
            getattr(func, "namespace", "") == "prim"
        ):  # metadata queries (prim.device): nothing allocated
            return out
        forward = self._made_by_forward()
        if isinstance(out, torch.Tensor):
            self._add(out, forward)
        elif isinstance(out, (tuple, list)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._add(o, forward)
                elif isinstance(o, (tuple, list)):
                    for t in o:
                        if isinstance(t, torch.Tensor):
                            self._add(t, forward)
        self.timeline.append(self.total)
        if self._marked:
            self.grad_timeline.append(self.grad_total)
        if self.total > self.peak:
            self.peak, self.peak_forward_bytes = self.total, self.forward_total
        return out
