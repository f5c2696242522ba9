"""Stepping the ladder's weights through a bounded scratch, whatever the largest tensor.

The optimizer steps fp32 stand-ins whose values are rebuilt into a scratch buffer of at most
``budget`` elements per call (:func:`plan`). Small weights share a call; a weight larger than the
budget is cut into segments, one call each, when the optimizer is element-wise (:data:`ELEMENTWISE`:
each element's update depends only on that element, its gradient, its states and per-parameter
scalars such as AdamW's ``step``): the stand-in views the segment, its gradient and its
parameter-shaped states are the segment's slices (:class:`CutState`), and the per-parameter scalars
are put back before each later segment so every segment sees the values one whole step would.
Other optimizers (per-tensor norms: LAMB, Adafactor, Muon-style) see each weight whole, through a
transient buffer that lives only inside the optimizer's step.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

import torch

__all__ = [
    "ALIGN",
    "ELEMENTWISE",
    "Arena",
    "CutState",
    "Segment",
    "StepHooks",
    "WrappedSteps",
    "plan",
    "same",
]

#: optimizers whose update is element-wise given per-parameter scalars (exact types: a subclass may not be)
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
)
#: segment boundaries are multiples of this many elements (whole SIMD vectors and cache lines)
ALIGN = 4096


class Segment(NamedTuple):
    """Elements ``[start, stop)`` of weight ``i`` (flat); ``whole`` when that is all of it."""

    i: int
    start: int
    stop: int
    whole: bool


def plan(
    numels: Sequence[int], ids: Sequence[int], budget: int, cut: bool, ends_only: bool = False
) -> list[list[Segment]]:
    """The optimizer calls, each a list of segments of at most ``budget`` elements in all:
    consecutive whole weights share a call; a weight over the budget is cut into segments of a
    multiple of :data:`ALIGN` elements, one call each (``cut``), or is a call alone.

    ``ends_only``: of a cut weight, only its first and last segments -- for fake tensors (an
    estimate or a plan), where the values are not computed and every segment holds the same
    scratch: the step's memory is the same, and a 128k-vocabulary embedding costs 2 calls, not 500."""
    step = max(budget // ALIGN * ALIGN, ALIGN)
    calls: list[list[Segment]] = []
    size = budget
    for i in ids:
        n = numels[i]
        if n > budget:
            starts = range(0, n, step)
            if ends_only and len(starts) > 2:
                starts = [starts[0], starts[-1]]
            calls += (
                [[Segment(i, a, min(a + step, n), False)] for a in starts]
                if cut
                else [[Segment(i, 0, n, True)]]
            )
            size = budget
            continue
        if not calls or size + n > budget:  # (a first weight of no elements opens one too)
            calls.append([])
            size = 0
        calls[-1].append(Segment(i, 0, n, True))
        size += n
    return calls


class CutState:
    """One weight's optimizer state while its segments are stepped: the parameter-shaped tensors kept
    whole (``full``; bf16 with ``state_dtype='bf16'``), the other entries as they were before the
    step (``before``), and what the last segment left (``after``)."""

    def __init__(
        self,
        state: Optional[dict[str, Any]],
        shape: torch.Size,
        round_into: Optional[Callable[[list[torch.Tensor], list[torch.Tensor]], None]],
        widen: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.float,
    ) -> None:
        self.shape, self.round_into = (
            shape,
            round_into,
        )  # round_into(fp32 scratches, bf16 outs): bf16 states, one call
        self.widen = widen  # bf16 piece -> a new fp32 tensor of its values
        self.fresh = not state  # never stepped: the optimizer makes each segment's state itself
        self.open = True  # until the last piece has left
        self.full: dict[str, torch.Tensor] = {}
        self.before: dict[str, Any] = {}
        for k, v in (state or {}).items():
            if isinstance(v, torch.Tensor) and v.shape == shape and v.dim() > 0:
                self.full[k] = v.view(-1)
            else:
                self.before[k] = v.clone() if isinstance(v, torch.Tensor) else v

    def enter(self, seg: Segment) -> dict[str, Any]:
        """The state the optimizer sees for ``seg``: slices of the full tensors (fp32 copies of bf16
        ones), the per-parameter scalars as before the step; empty for a fresh weight."""
        if self.fresh:
            return {}
        out: dict[str, Any] = {}
        for k, v in self.full.items():
            piece = v[seg.start : seg.stop]
            out[k] = (
                self.widen(piece)
                if self.round_into is not None and v.is_floating_point()
                else piece
            )
        for k, v in self.before.items():
            out[k] = v.clone() if isinstance(v, torch.Tensor) else v
        return {k: out[k] for k in [*self.full, *self.before]}  # (the optimizer's key order kept)

    def leave(self, seg: Segment, state: dict[str, Any], numel: int) -> Optional[dict[str, Any]]:
        """Take ``seg``'s stepped state back into the full tensors; after the last segment, the
        weight's whole state (else None)."""
        n = seg.stop - seg.start
        after: dict[str, Any] = {}
        xs: list[torch.Tensor] = []  # bf16 states: rounded in one call, in the state's key order
        outs: list[torch.Tensor] = []
        for k, v in state.items():
            if (
                isinstance(v, torch.Tensor)
                and v.dim() == 1
                and v.shape[0] == n
                and (k in self.full or self.fresh)
            ):
                full = self.full.get(k)
                bf16 = self.round_into is not None and v.is_floating_point()
                if (
                    full is None
                ):  # a fresh weight's first segment made this state: the whole one, once
                    full = self.full[k] = torch.empty(
                        numel, dtype=torch.bfloat16 if bf16 else v.dtype, device=v.device
                    )
                piece = full[seg.start : seg.stop]
                if bf16:
                    xs.append(v.reshape(-1))
                    outs.append(piece)
                elif not same(piece, v):
                    piece.copy_(v)
                after[k] = None
            else:
                after[k] = v
        if xs:
            assert self.round_into is not None
            self.round_into(xs, outs)
        if seg.stop < numel:
            return None
        self.open = False
        return {k: (self.full[k].view(self.shape) if v is None else v) for k, v in after.items()}

    def whole(self) -> dict[str, Any]:
        """The weight's whole state as it stands (after an error between its pieces): the full
        tensors (the pieces stepped so far updated) and the other entries as before the step; a
        fresh weight's none (its full tensors hold only the stepped pieces: the rest uninitialized)."""
        if self.fresh:
            return {}
        return {**{k: v.view(self.shape) for k, v in self.full.items()}, **self.before}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` is the same memory, shape and layout as ``b`` (False for a fake tensor: no memory)."""
    return (
        type(a) is torch.Tensor
        and type(b) is torch.Tensor
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class Arena:
    """fp32 room for one optimizer call's bf16 states, kept between steps (``cap`` elements at most;
    ``size`` from the start, grown to what a call needed): :meth:`widen` copies a state into the
    next free slice (one pass, no allocation), or into a new tensor where the call's states
    outgrow the room."""

    def __init__(self, cap: int, device: torch.device, size: int = 0) -> None:
        self.cap, self.device = cap, device
        self.buf = torch.empty(
            min(size, cap), dtype=torch.float32, device=device
        )  # (``size``: made now, so counted)
        self.off = self.want = 0

    def reset(self) -> None:
        """A new call: the room is free again (grown first to the most a call asked for)."""
        if self.buf.numel() < min(self.want, self.cap):
            self.buf = torch.empty(
                0, dtype=torch.float32, device=self.device
            )  # (the old one freed first)
            self.buf = torch.empty(
                min(self.want, self.cap), dtype=torch.float32, device=self.device
            )
        self.off = 0

    def widen(self, v: torch.Tensor) -> torch.Tensor:
        """``v`` (bf16) as a new fp32 tensor of its shape, in the room while there is some."""
        n = v.numel()
        if type(v) is not torch.Tensor:  # a fake tensor (``ampkit plan``): no room kept for it
            return v.float()
        self.want = max(self.want, self.off + n)
        if self.off + n > self.buf.numel():
            return v.float()
        out = self.buf[self.off : self.off + n].view(v.shape)
        self.off += n
        return out.copy_(v)


class WrappedSteps:
    """Optimizers whose ``step`` the ladder wraps (one process, or FSDP2 shards): after
    ``wrap(opt, fn)``, ``opt.step(*args, **kwargs)`` is ``fn(opt, inner, args, kwargs)`` with
    ``inner`` the step it replaced, a bound method as LR schedulers expect (they re-wrap
    ``opt.step.__func__``); :meth:`restore` gives every optimizer its own ``step`` back."""

    def __init__(self) -> None:
        self._orig: list[tuple[torch.optim.Optimizer, Any]] = []

    def wrap(self, opt: torch.optim.Optimizer, fn: Callable[..., Any]) -> None:
        inner = opt.step  # the bound method (or an LR scheduler's wrapper of it)

        def step(owner: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return fn(owner, inner, args, kwargs)

        self._orig.append((opt, opt.__dict__.get("step")))
        opt.step = types.MethodType(step, opt)  # type: ignore[method-assign]

    def restore(self) -> None:
        for opt, orig in self._orig:
            if orig is None:
                opt.__dict__.pop("step", None)
            else:
                opt.step = orig  # type: ignore[method-assign]
        self._orig = []


class StepHooks:
    """An optimizer's step hooks (its own and the global ones, ``register_step_pre_hook`` /
    ``register_optimizer_step_post_hook``) run once around a step the ladder makes of several
    calls of the optimizer's ``step``, one per piece, as around one ``step()``: the pre-hooks when
    made (a warmup's lr is stepped with by every piece; ``args``/``kwargs`` are what they return),
    the hooks then left out of the pieces' calls until :meth:`restore`, and the post-hooks by
    :meth:`after`, once the stepped weights are written back. (Torch runs them inside each call.)
    """

    def __init__(self, opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        from torch.optim import optimizer as module

        self.opt, self._global = opt, module
        own = (opt._optimizer_step_pre_hooks, opt._optimizer_step_post_hooks)
        every = (module._global_optimizer_pre_hooks, module._global_optimizer_post_hooks)
        self._saved = [(d, dict(d)) for d in (*own, *every)]
        full = (opt, *args)
        for hook in (*every[0].values(), *own[0].values()):
            result = hook(opt, full, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"{hook} must return None or a tuple of (new_args, new_kwargs), "
                        f"but got {result}."
                    )
                full, kwargs = result
        self.args, self.kwargs, self._full = tuple(full[1:]), kwargs, full
        for d, _ in self._saved:
            d.clear()

    def restore(self) -> None:
        """Every hook back in place (in its order), after the pieces' calls or an error."""
        for d, kept in self._saved:
            d.clear()
            d.update(kept)

    def after(self) -> None:
        """The post-hooks, once, after the step (call :meth:`restore` first)."""
        own = self.opt._optimizer_step_post_hooks
        for hook in (*own.values(), *self._global._global_optimizer_post_hooks.values()):
            hook(self.opt, self._full, self.kwargs)
