"""The ladder's step for ``torch.optim.Adam``/``AdamW`` with ``fused=True`` on the CPU: one native
pass per element on the rung's own storage (:mod:`ampkit.step.policies.native_adam`) in place of
widen -> the optimizer's fused step -> round back (:mod:`.ladder`), bitwise the same.

Used only where it is exactly that: the optimizer is exactly ``torch.optim.Adam`` or ``AdamW`` (not
a subclass) and every group holding a ladder weight has ``fused=True``, no ``amsgrad``,
``capturable`` or ``differentiable``, plain-number hyper-parameters (no tensor ``lr`` or betas), no
AMP ``grad_scale``/``found_inf``; every ladder weight of the optimizer has a plain contiguous fp32
CPU gradient and a state made by an earlier step (``step``, ``exp_avg``, ``exp_avg_sq`` of the
rung's state dtype); the kernel passed its probe here, and no group asks for ``maximize``
(:func:`~ampkit.step.policies.native_adam.covers`). Anything else takes
the generic step unchanged -- so the first step (which makes the states), a weight without a
gradient, or ``AMPKIT_NO_NATIVE=1``.

What stays the same: the optimizer's state (``step`` counted up once per weight, the bf16 or fp32
``exp_avg``/``exp_avg_sq`` tensors written in place), the rounding stream (the same calls of the
same budget, each drawing its weight key and then its state key from the rung's generator, the
elements counted in the same order), the scratch (none used). The user's ``step()`` still runs,
once per step instead of once per chunk, with only the ``keep_fp32`` parameters' gradients set:
its hooks and an LR scheduler's bookkeeping see one call, and those parameters are stepped by it.
Its step hooks run once around the whole step (:class:`.pieces.StepHooks`, as on the generic
step): the hyper-parameters are read after its pre-hooks (a warmup hook's lr is stepped with), and
its post-hooks read the stepped weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .. import native, native_adam
from .pieces import Segment, StepHooks
from .rounding import draw_key

if TYPE_CHECKING:  # pragma: no cover
    from .ladder import LadderWeights

__all__ = ["ADAMS", "FusedAdam"]

#: the optimizers stepped natively (exact types: a subclass may step otherwise)
ADAMS = (torch.optim.Adam, torch.optim.AdamW)
_STATE = ("step", "exp_avg", "exp_avg_sq")


def _number(x: Any) -> bool:
    return isinstance(x, (float, int)) and not isinstance(x, bool)


def _hyper(
    opt: torch.optim.Optimizer, group: dict[str, Any], rung: str, state_bf16: bool
) -> Optional[tuple[tuple, int]]:
    """A group's (lr, beta1, beta2, eps, weight_decay) and kernel flags (1: AdamW's decoupled
    decay), or None: not covered."""
    betas = group.get("betas")
    if not (
        group.get("fused") is True
        and not group.get("amsgrad")
        and not group.get("capturable")
        and not group.get("differentiable")
        and isinstance(betas, (tuple, list))
        and len(betas) == 2
        and all(_number(x) for x in (group.get("lr"), *betas, group.get("eps")))
        and _number(group.get("weight_decay"))
        and native_adam.covers(rung, state_bf16, bool(group.get("maximize")))
    ):
        return None
    decoupled = group.get("decoupled_weight_decay", type(opt) is torch.optim.AdamW)
    return (group["lr"], betas[0], betas[1], group["eps"], group["weight_decay"]), int(
        bool(decoupled)
    )


class FusedAdam:
    """One optimizer step of the ladder's weights by the native kernel (:meth:`prepare`, :meth:`run`)."""

    def __init__(
        self, lw: LadderWeights, calls: list[list[Segment]], hyper: dict[int, tuple[tuple, int]]
    ) -> None:
        self.lw, self.calls, self.hyper = lw, calls, hyper

    @classmethod
    def prepare(
        cls,
        lw: LadderWeights,
        opt: torch.optim.Optimizer,
        calls: list[list[Segment]],
        ids: list[int],
        grads: dict[int, Optional[torch.Tensor]],
    ) -> Optional[FusedAdam]:
        """The fused step of ``opt``'s ladder weights ``ids`` (their gradients in ``grads`` by the
        stand-ins' ids) over ``calls``, or None where the generic step must run (module doc)."""
        bf16 = lw.state_dtype == "bf16"
        if (
            type(opt) not in ADAMS
            or native_adam.kind(lw.rung) is None
            or getattr(opt, "grad_scale", None) is not None
            or getattr(opt, "found_inf", None) is not None
        ):
            return None
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        sdt = torch.bfloat16 if bf16 else torch.float32
        hyper: dict[int, tuple[tuple, int]] = {}
        per_group: dict[int, Optional[tuple[tuple, int]]] = {}  # (read once per group)
        for i in ids:
            m = lw.masters[i]
            group = group_of[id(m)]
            if id(group) not in per_group:
                per_group[id(group)] = _hyper(opt, group, lw.rung, bf16)
            got = per_group[id(group)]
            g, state = grads.get(id(m)), opt.state.get(m)
            if got is None or g is None or not state or m.dim() == 0:
                return None
            keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            st = state.get("step")
            if (
                set(state) != set(_STATE)
                or keys != ["exp_avg", "exp_avg_sq"]
                or not isinstance(st, torch.Tensor)
                or not native.plain(st, torch.float32)
                or st.dim() != 0
                or st.requires_grad
                or g.layout != torch.strided
                or not native.plain(g, g.dtype if g.dtype == torch.bfloat16 else torch.float32)
                or g.shape != m.shape
                or any(not native.plain(state[k], sdt) or state[k].shape != m.shape for k in keys)
            ):
                return None
            hyper[i] = got
        return cls(lw, calls, hyper) if hyper else None

    def run(
        self,
        inner: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        others: list[torch.Tensor],
        grads: dict[int, Optional[torch.Tensor]],
        opt: torch.optim.Optimizer,
    ) -> Any:
        """The user's ``step()`` once with only ``others``' gradients set (every other parameter's
        ``.grad`` is None when called; the caller puts them back), then every ladder weight
        stepped natively, call by call, inside the optimizer's step hooks (:class:`.StepHooks`, as
        the generic step): its pre-hooks have run (an lr they set is the one stepped with) and its
        post-hooks read the stepped weights. Returns what the user's step returned."""
        hooks = StepHooks(opt, args, kwargs)
        for p in others:
            p.grad = grads[id(p)]
        try:
            ret = inner(*hooks.args, **hooks.kwargs)
            self._native(opt, grads)
        finally:
            hooks.restore()
            for p in others:
                p.grad = None
        hooks.after()
        return ret

    def _native(self, opt: torch.optim.Optimizer, grads: dict[int, Optional[torch.Tensor]]) -> None:
        """Every ladder weight stepped by the kernel with its group's hyper-parameters as they are
        now (a step pre-hook may have set them)."""
        lw = self.lw
        bf16 = lw.state_dtype == "bf16"
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        per_group: dict[int, Optional[tuple[tuple, int]]] = {}
        for i in self.hyper:
            group = group_of[id(lw.masters[i])]
            if id(group) not in per_group:
                per_group[id(group)] = _hyper(opt, group, lw.rung, bf16)
            got = per_group[id(group)]
            if got is None:
                raise RuntimeError(
                    "ampkit: a step pre-hook changed an optimizer group's options to ones the "
                    "ladder's fused Adam step does not cover (maximize, amsgrad, a tensor lr or "
                    "betas, fused=False, ...) after the step had begun; set them before step()"
                )
            self.hyper[i] = got
        hp: dict[int, tuple[float, ...]] = {}
        for i, (h, _) in self.hyper.items():
            st = opt.state[lw.masters[i]]["step"]
            st.add_(1)  # (torch's fused Adam counts before it steps; no sync: a CPU tensor)
            hp[i] = (*h, st.item())
        for segs in self.calls:
            kw = int(draw_key(lw.gen)) if lw.rung == "stochastic" else 0  # type: ignore[arg-type]
            ks = int(draw_key(lw.gen)) if bf16 else 0  # type: ignore[arg-type]
            t, wofs, sofs, off = native_adam.Tensors(), [], [], 0
            held: list[torch.Tensor] = []  # (alive until the kernel has read them)
            for seg in segs:
                i, a, b = seg.i, seg.start, seg.stop
                m = lw.masters[i]
                state, h = opt.state[m], lw.halves[i].data.view(-1)[a:b]
                extra = lw.extra[i]
                if lw.rung == "fp32":
                    w, wx = lw.full[i].view(-1)[a:b], h
                else:
                    w, wx = h, None if extra is None else extra.view(-1)[a:b]
                g = grads[id(m)]
                assert g is not None
                g = g.view(-1)[a:b]
                if g.dtype != torch.float32:  # a kept bf16 gradient, widened for the call (.grads)
                    g = lw.grads.widen(g, i)
                    held.append(g)
                t.add(
                    w,
                    wx,
                    g,
                    state["exp_avg"].view(-1)[a:b],
                    state["exp_avg_sq"].view(-1)[a:b],
                    hp[i],
                    self.hyper[i][1],
                )
                wofs.append(off)
                sofs.append(2 * off)
                off += b - a
            if not native_adam.step(lw.rung, bf16, t, wofs, sofs, kw, ks):
                raise RuntimeError(  # (checked in prepare: a broken invariant, never a fallback)
                    "ampkit: the fused Adam kernel refused a ladder call it was prepared for"
                )
        for i in {s.i for segs in self.calls for s in segs if not s.whole}:
            # a weight stepped in pieces: its state's keys in the order the generic step leaves
            # them (.pieces.CutState: the parameter-shaped tensors first)
            state = opt.state[lw.masters[i]]
            opt.state[lw.masters[i]] = {k: state[k] for k in ("exp_avg", "exp_avg_sq", "step")}
