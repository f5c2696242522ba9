"""The memory ladder of ``bf16-pure``: what stands in for the fp32 master of each weight.

=============  =======================================================  =========================
``masters``    what is kept besides the model's bf16 weight             B/param with AdamW states
=============  =======================================================  =========================
``fp32``       an fp32 master (:class:`~.pure.MasterWeights`)           2 + 4 + 8 = 14
``split``      a signed 16-bit remainder: bf16 + remainder = the exact  2 + 2 + 8 = 12
               fp32 master (the same numerics as ``fp32``)
``kahan``      a bf16 compensation: bf16 + compensation ~ the master    2 + 2 + 8 = 12
``stochastic`` nothing: the update is rounded stochastically into bf16  2 + 0 + 8 = 10
``none``       nothing (plain ``model.bfloat16()``): small updates      2 + 0 + 4 = 6
               round away, the weights *stall* -- refused unless forced
=============  =======================================================  =========================

Gradients: a one-micro-step window's stay bf16 on the stand-ins for a step that only checks them,
widened call by call (:mod:`.grads`: 2 bytes per parameter, not an fp32 copy's 4; bitwise).

``state_dtype="bf16"`` keeps the optimizer's states in bf16 between steps (rounded
stochastically): ``stochastic`` + bf16 states = 2 + 0 + 4 = 6 B/param. They stay bf16 across
``optimizer.load_state_dict`` too (torch casts loaded states to the fp32 stand-ins' dtype; a
post-load hook casts them back, exactly).

**Any torch optimizer, fast.** The user's optimizer steps fp32 *stand-ins* (parameters with the
right shape and dtype whose storage between steps is one shared fp32 scalar): at the step, chunk
by chunk, each chunk's fp32 values are rebuilt into a reusable buffer, the stand-ins view it, the
optimizer's own ``step()`` runs with only that chunk's gradients set (torch's optimizers skip a
parameter whose ``.grad`` is None), and the result goes back into the compact form. The fused
kernels (AdamW ``fused=True``) do the arithmetic. The chunk buffer is bounded (``ladder_scratch_mib``,
16 MiB by default, kept between steps) whatever the largest tensor: a weight larger than it is
stepped in pieces, one optimizer call each (:mod:`.pieces`: element-wise torch optimizers; any
other sees each weight whole through a buffer that lives only inside its step). With
``state_dtype="bf16"`` one piece's states are fp32 during its call. For ``torch.optim.Adam``/``AdamW``
with ``fused=True`` on CPU, rebuild, step and round back are one native pass (:mod:`.fused`), bitwise.

The split (``split``): with ``u`` the fp32 bits and ``lo``/``hi`` their low/high 16 bits, the
weight is ``hi + (lo >= 0x8000)`` (round to nearest, ties away from zero: the only rounding whose
remainder always fits 16 signed bits) and the remainder is ``lo`` read as a signed int16; the
fp32 bits come back as ``hi_weight - (remainder < 0)`` above ``remainder``. On CPU each direction
(and ``kahan``'s) is one pass of a small C kernel (:mod:`.native`, compiled on first use), one call
per chunk on torch's intra-op threads; the eager torch passes below are the bitwise reference and the
fallback (and the path for a stand-in the optimizer moved to new storage).

Stochastic rounding adds 16 uniform random bits to the fp32 bits and keeps the top 16 (unbiased:
rounds up with probability equal to the dropped fraction). The bits are a counter-based stream
(:func:`.eager.random16`) keyed by one draw per call from a ``torch.Generator`` seeded with
``torch.initial_seed()`` whose state is checkpointed, so a resume draws the same bits; one call
rounds a chunk's weights, another its states (one native pass each on CPU).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from ...rung import Rung, split_spec
from .. import native as _native_kernels
from .cast import STALL_WARNING, CastOnly
from .fused import FusedAdam
from .grads import KeptGrads
from .masters import MasterWeights
from .pieces import (
    ALIGN,
    ELEMENTWISE,
    Arena,
    CutState,
    Segment,
    StepHooks,
    WrappedSteps,
    plan,
    same,
)
from .rounding import (
    STREAM,
    join_split,
    kahan_join,
    kahan_split,
    shared_seed,
    split_fp32,
    stochastic_many,
    stochastic_round,
    warn_other_calls,
    warn_other_stream,
)

__all__ = [
    "CHUNK_NUMEL",
    "SCRATCH_BYTES",
    "STALL_WARNING",
    "CastOnly",
    "LadderWeights",
    "bytes_per_param",
    "join_split",
    "kahan_join",
    "kahan_split",
    "parse_rung",
    "split_fp32",
    "stochastic_round",
]

#: elements per chunk of the transient fp32 view (one chunk of extra memory: 4 MiB). Small enough for a
#: chunk's rebuild, step and re-split to meet in the last-level cache: the ``split`` step on 4 x 1M
#: weights was 1.39-1.44x the fp32-master step with 16 MiB chunks, 1.25-1.34x with these (2 threads)
CHUNK_NUMEL = 1 << 20
#: the scratch the ladder keeps between steps by default (bytes): larger tensors are stepped in pieces
SCRATCH_BYTES = 16 << 20


def bytes_per_param(
    masters: str = "fp32", state_dtype: str = "fp32", optimizer: str = "adamw"
) -> int:
    """Bytes per bf16-pure parameter of a rung between steps (:meth:`ampkit.step.rung.Rung.bytes_per_param`)."""
    return Rung(masters, state_dtype).bytes_per_param(optimizer)  # type: ignore[arg-type]


def parse_rung(spec: Any) -> tuple[Any, dict[str, Any]]:
    """``"bf16-pure:split"`` -> ``("bf16-pure", {"masters": ..., "state_dtype": ..., ...})``; a plain
    name -> ``(name, {})``: :func:`ampkit.step.rung.split_spec` with the rung as config fields."""
    name, rung = split_spec(spec)
    return name, ({} if rung is None else {"allow_stall": False, **rung.fields()})


# ---------------------------------------------------------------------- rungs with stand-ins
class LadderWeights(MasterWeights):
    """``split``, ``kahan``, ``stochastic`` masters (and ``fp32`` masters with bf16 states) (module doc).

    Builds on :class:`MasterWeights`: the optimizer's groups hold fp32 stand-ins, gradients are
    absorbed into them the same way; the stand-ins' values live in the compact form and are
    rebuilt chunk by chunk inside the optimizer's ``step`` (wrapped per optimizer instance).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        dtype: torch.dtype,
        keep: Sequence[str] = (),
        masters: str = "split",
        state_dtype: str = "fp32",
        scratch_bytes: int = SCRATCH_BYTES,
    ) -> None:
        if sys.byteorder != "little":  # pragma: no cover - the int16 pair views assume it
            raise RuntimeError(
                "the bf16-pure ladder rungs need a little-endian machine; use masters='fp32'"
            )
        super().__init__(model, optimizers, dtype, keep)
        self.rung, self.state_dtype = masters, state_dtype
        # remainder (int16) / compensation (bf16) per weight
        self.extra: list[Optional[torch.Tensor]] = []
        self.gen: Optional[torch.Generator] = None
        dev = self.masters[0].device if self.masters else torch.device("cpu")
        if masters == "stochastic" or state_dtype == "bf16":
            self.gen = torch.Generator(device=dev)
            self.gen.manual_seed(shared_seed(model))
        self._dummy = torch.zeros((), dtype=torch.float32, device=dev)
        self.grads = KeptGrads(self.halves, self.masters, self._dummy)  # (.grads)
        # The bounded scratch, kept between steps: one call's fp32 values (+ the bit passes' second
        # buffer for split/kahan; + room for two fp32 states per element with bf16 states: the
        # call's states widened there, :class:`.pieces.Arena`); at most CHUNK_NUMEL elements a call, a
        # multiple of pieces.ALIGN.
        per = 0 if masters == "fp32" else 8 if masters in ("split", "kahan") else 4
        room = per + (8 if state_dtype == "bf16" else 0)
        self.budget = min(CHUNK_NUMEL, max(scratch_bytes // max(room, 4) // ALIGN * ALIGN, ALIGN))
        # never more than the weights need (a small model keeps a small scratch; one call either way)
        need = -(-sum(m.numel() for m in self.masters) // ALIGN) * ALIGN
        self.budget = min(self.budget, max(need, ALIGN))
        self._buf = torch.empty(self.budget if per else 0, dtype=torch.float32, device=dev)
        self._tmp = torch.empty(self.budget if per == 8 else 0, dtype=torch.float32, device=dev)
        left = scratch_bytes // 4 - self._buf.numel() - self._tmp.numel()
        # room for AdamW's two states from the start (so an estimate sees it)
        bf16 = state_dtype == "bf16"
        self._arena = Arena(max(left, 0) if bf16 else 0, dev, 2 * self.budget if bf16 else 0)
        # fp32 masters (bf16 states only): the masters' own storage
        self.full: list[torch.Tensor] = []
        with torch.no_grad():
            for h, m in zip(self.halves, self.masters):
                self.extra.append(self._compact(h, m.detach().contiguous()))
                self.full.append(m.data)
                if masters != "fp32":
                    m.data = self._dummy.expand(m.shape)
        if masters != "fp32":
            self.full = []
        self._steps = WrappedSteps()
        self._hooks: list[Any] = []
        index = {id(m): i for i, m in enumerate(self.masters)}
        for opt in self.optimizers:
            self._steps.wrap(opt, lambda o, inner, a, k: self._step(o, inner, index, a, k))
            self._hooks.append(opt.register_load_state_dict_pre_hook(self.grads.before_load))
            if state_dtype == "bf16":
                self._hooks.append(opt.register_load_state_dict_post_hook(self._loaded))

    # ------------------------------------------------------------------ compact form <-> fp32
    def _compact(
        self, h: torch.Tensor, x: torch.Tensor, extra: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        """Store fp32 ``x`` (scratch: may be overwritten) into ``h`` (+ the returned extra tensor)."""
        rung = self.rung
        if rung == "split":
            extra = (
                torch.empty(h.shape, dtype=torch.int16, device=h.device) if extra is None else extra
            )
            split_fp32(x, h.data, extra)
        elif rung == "kahan":
            extra = (
                torch.empty(h.shape, dtype=torch.bfloat16, device=h.device)
                if extra is None
                else extra
            )
            kahan_split(x, h.data, extra, self._scratch(x))
        elif rung == "stochastic":
            assert self.gen is not None
            stochastic_round(x, h.data, self.gen)
        else:  # fp32 masters (bf16 states only)
            h.data.copy_(x)
        return extra

    def _expand(
        self, i: int, out: torch.Tensor, a: int = 0, b: Optional[int] = None
    ) -> torch.Tensor:
        """The fp32 values of elements ``[a, b)`` of weight ``i`` into flat ``out`` (returned)."""
        h = self.halves[i].data.view(-1)[a:b]
        extra = None if self.extra[i] is None else self.extra[i].view(-1)[a:b]  # type: ignore[union-attr]
        if self.rung == "split":
            assert extra is not None
            return join_split(h, extra, out, self._scratch(out).view(torch.int32))
        if self.rung == "kahan":
            assert extra is not None
            return kahan_join(h, extra, out, self._scratch(out))
        out.copy_(h)
        return out

    def _parts(self, seg: Segment) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The segment's slices of the weight and of its remainder/compensation."""
        i, a, b = seg.i, seg.start, seg.stop
        extra = self.extra[i]
        return self.halves[i].data.view(-1)[a:b], None if extra is None else extra.view(-1)[a:b]

    def _expand_call(self, segs: list[Segment], buf: torch.Tensor) -> list[torch.Tensor]:
        """The fp32 values of ``segs`` back to back in ``buf`` (one native call for ``split``/``kahan``
        where it can), as the views the stand-ins take: a whole weight's shape, a segment flat. With
        ``fp32`` masters the values are the masters' own storage (``self.full``)."""
        views, off = [], 0
        for seg in segs:
            shape = self.halves[seg.i].shape if seg.whole else (seg.stop - seg.start,)
            if self.rung == "fp32":
                views.append(self.full[seg.i].view(-1)[seg.start : seg.stop].view(shape))
                continue
            views.append(buf[off : off + seg.stop - seg.start].view(shape))
            off += seg.stop - seg.start
        if self.rung == "fp32":
            return views
        parts = [self._parts(seg) for seg in segs]
        if not (
            self.rung in ("split", "kahan")
            and _native_kernels.expand(
                self.rung, [h for h, _ in parts], [e for _, e in parts], buf[:off]
            )
        ):
            for seg, v in zip(segs, views):
                self._expand(seg.i, v.view(-1), seg.start, seg.stop)
        return views

    def _compact_call(
        self, segs: list[Segment], views: list[torch.Tensor], buf: torch.Tensor
    ) -> None:
        """The stepped fp32 values back into the compact form. One native call when every stand-in
        still views the buffer where it was put."""
        masters = [self.masters[seg.i] for seg in segs]
        parts = [self._parts(seg) for seg in segs]
        if self.rung == "stochastic":
            # one key, one native call where it can (it takes pointers: any storage)
            assert self.gen is not None
            stochastic_many([m.data.reshape(-1) for m in masters], [h for h, _ in parts], self.gen)
            return
        off = sum(seg.stop - seg.start for seg in segs)
        if not (
            self.rung in ("split", "kahan")
            and all(same(m.data, v) for m, v in zip(masters, views))
            and _native_kernels.compact(
                self.rung, buf[:off], [h for h, _ in parts], [e for _, e in parts]
            )
        ):
            for m, (h, e) in zip(masters, parts):
                self._compact(h, m.data.reshape(-1), e)

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """fp32 scratch of ``like``'s size: the chunk's slice of the second buffer, or a new tensor."""
        n = like.numel()
        if n <= self._tmp.numel():
            return self._tmp[:n]
        return torch.empty(n, dtype=torch.float32, device=like.device)

    def fp32_value(self, i: int) -> torch.Tensor:
        """The fp32 value of weight ``i`` (exact for ``split`` and ``fp32``), a new tensor."""
        if self.rung == "fp32":
            return self.masters[i].detach().clone()
        m = self.masters[i]
        return self._expand(i, torch.empty(m.numel(), dtype=torch.float32, device=m.device)).view(
            m.shape
        )

    # ------------------------------------------------------------------ the chunked step
    def _step(
        self,
        opt: torch.optim.Optimizer,
        inner: Callable[..., Any],
        index: dict[int, int],
        args: tuple,
        kwargs: dict,
    ) -> Any:
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = [p.grad for p in params]
        ids = sorted(index[id(p)] for p in params if id(p) in index)
        # keep_fp32 parameters: stepped with call 0
        others = [p for p in params if id(p) not in index]
        for p in params:
            p.grad = None
        by_id = dict(zip(map(id, params), grads))
        numels = [m.numel() for m in self.masters]
        # an estimate: no values, same memory
        fake = bool(self.masters) and is_fake(self.masters[0])
        calls = plan(numels, ids, self.budget, cut=type(opt) in ELEMENTWISE, ends_only=fake) or [[]]
        fused = None if fake else FusedAdam.prepare(self, opt, calls, ids, by_id)
        if fused is not None:  # torch's fused Adam/AdamW: one native pass per element (.fused)
            try:
                return fused.run(inner, args, kwargs, others, by_id, opt)
            finally:
                for p, g in zip(params, grads):
                    p.grad = g
        cuts: dict[int, CutState] = {}
        kept: dict[tuple[int, str], torch.Tensor] = {}
        ret, hooks = None, StepHooks(opt, args, kwargs)  # the step's hooks once, not per call
        args, kwargs = hooks.args, hooks.kwargs
        try:
            for k, segs in enumerate(calls):
                # > budget: one whole weight, transient buffer
                n = sum(seg.stop - seg.start for seg in segs)
                buf = (
                    self._buf
                    if n <= self._buf.numel() or self.rung == "fp32"
                    else torch.empty(n, dtype=torch.float32, device=self._buf.device)
                )
                live = [self.masters[seg.i] for seg in segs] + (others if k == 0 else [])
                kept.clear()  # the bf16 states widened for this call
                self._arena.reset()
                with torch.no_grad():
                    views = self._expand_call(segs, buf)
                    for seg, v in zip(segs, views):
                        m, g = self.masters[seg.i], by_id[id(self.masters[seg.i])]
                        if g is not None and not seg.whole:
                            g = g.view(-1)[seg.start : seg.stop]
                        m.data, m.grad = v, (None if g is None else self.grads.widen(g, seg.i))
                        if seg.whole:
                            self._states_up(opt, m, kept)
                        else:
                            if seg.start == 0:
                                cuts[seg.i] = CutState(
                                    opt.state.get(m),
                                    self.halves[seg.i].shape,
                                    self._round_state if self.state_dtype == "bf16" else None,
                                    self._arena.widen,
                                )
                            opt.state[m] = cuts[seg.i].enter(seg)
                    for p in others if k == 0 else []:
                        p.grad = by_id[id(p)]
                ret = inner(*args, **kwargs)
                with torch.no_grad():
                    self._compact_call(segs, views, buf)
                    self._states_down(opt, [self.masters[s.i] for s in segs if s.whole], kept)
                    for seg in segs:
                        m = self.masters[seg.i]
                        m.grad = None
                        m.data = self._between(seg.i)
                        if (
                            not seg.whole
                            and (whole := cuts[seg.i].leave(seg, opt.state[m], numels[seg.i]))
                            is not None
                        ):
                            opt.state[m] = whole
                kept.clear()
                for p in live:
                    p.grad = None
        except BaseException:
            # the call's bf16 states as before it (its weights were not written back either): the
            # widened ones view the arena, which the next call overwrites; a weight cut in pieces
            # gets its whole state back (its earlier pieces stepped)
            for (i, key), v in kept.items():
                opt.state[self.masters[index[i]]][key] = v
            for i, cut in cuts.items():
                if cut.open:
                    opt.state[self.masters[i]] = cut.whole()
            raise
        finally:
            for i in ids:  # (after an error too: the stand-ins whole again, then their gradients)
                self.masters[i].grad = None
                self.masters[i].data = self._between(i)
            for p, g in zip(params, grads):
                p.grad = g
            hooks.restore()
        hooks.after()
        return ret

    def _between(self, i: int) -> torch.Tensor:
        """Stand-in ``i``'s data between calls: its fp32 master (``fp32``), else :mod:`.grads`'."""
        return self.full[i] if self.rung == "fp32" else self.grads.between(i)

    def absorb_grads(self, whole_window: bool = False) -> None:
        """After a backward: a whole one-micro-step window's bf16 gradients kept as they are
        (:mod:`.grads`), else summed into fp32 as :class:`MasterWeights` does. No sync."""
        if not (whole_window and self.rung != "fp32" and self.grads.keep()):
            self.grads.settle(False)
        super().absorb_grads()  # (after keep: those whose stand-in still had a gradient)

    def _round_state(self, xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        assert self.gen is not None
        stochastic_many(xs, outs, self.gen)

    def _bf16_states(self, opt: torch.optim.Optimizer, m: torch.Tensor) -> list[str]:
        """The keys of the stand-in's parameter-shaped floating states (bf16 between steps)."""
        state = opt.state.get(m)
        if self.state_dtype != "bf16" or not state:
            return []
        return [  # (not a 0-d parameter's step count, of its shape too)
            k
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.shape == m.shape != ()
        ]

    def _states_up(
        self,
        opt: torch.optim.Optimizer,
        m: torch.Tensor,
        kept: dict[tuple[int, str], torch.Tensor],
        arena: bool = True,
    ) -> None:
        """With ``state_dtype='bf16'``: the stand-in's bf16 states to fp32 for its step (in the arena;
        ``arena=False``: new tensors, for good); the bf16 tensors go into ``kept``, where
        :meth:`_states_down` rounds the stepped values back."""
        for k in self._bf16_states(opt, m):
            v = opt.state[m][k]
            if v.dtype != torch.float32:
                kept[(id(m), k)] = v
                opt.state[m][k] = self._arena.widen(v) if arena else v.float()

    def _states_down(
        self,
        opt: torch.optim.Optimizer,
        ms: list[torch.Tensor],
        kept: dict[tuple[int, str], torch.Tensor],
    ) -> None:
        """The fp32 states of the stand-ins ``ms`` rounded stochastically into bf16 in one call (one
        key, the states in order), into the bf16 tensors :meth:`_states_up` expanded (new ones for
        states the step made)."""
        xs, outs = [], []
        for m in ms:
            for k in self._bf16_states(opt, m):
                v = opt.state[m][k]
                if v.dtype == torch.bfloat16:
                    continue
                out = kept.get((id(m), k))
                if out is None or out.shape != v.shape or not out.is_contiguous():
                    out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
                xs.append(v.reshape(-1))
                outs.append(out)
                opt.state[m][k] = out
        if xs:
            self._round_state(xs, [o.view(-1) for o in outs])

    def _loaded(self, opt: torch.optim.Optimizer) -> None:
        """After ``opt.load_state_dict``: torch cast the loaded states to the fp32 stand-ins' dtype;
        they go back to bf16, as kept between steps. Saved in bf16, their values are bf16 numbers, so
        the cast is exact (no stochastic rounding: the generator's state stays the checkpoint's)."""
        with torch.no_grad():
            for m in self.masters:
                for k in self._bf16_states(opt, m):
                    opt.state[m][k] = opt.state[m][k].to(torch.bfloat16)

    # ------------------------------------------------------------------ MasterWeights' verbs
    def copy_to_model(self) -> None:
        """Nothing: the step already wrote the rounded weights into the model."""

    def release(self) -> None:
        self.grads.settle(False)
        self._steps.restore()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        with torch.no_grad():
            for i, m in enumerate(self.masters):
                m.data = self.fp32_value(i)
                for opt in self.optimizers:
                    self._states_up(opt, m, {}, arena=False)
        super().release()

    def state_dict(self) -> dict[str, Any]:
        """The rung, its per-weight tensors by name (remainders / compensations) and the generator state."""
        out: dict[str, Any] = {
            "rung": self.rung,
            "state_dtype": self.state_dtype,
            "extra": {n: e for n, e in zip(self.names, self.extra) if e is not None},
        }
        if self.rung == "fp32":
            out["masters"] = super().state_dict()
        if self.gen is not None:
            out["generator"] = self.gen.get_state()
            out["stream"], out["per_call"] = STREAM, self.budget  # (the keys: one per call)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("rung") != self.rung:
            raise ValueError(
                f"this checkpoint's masters are {state.get('rung', 'fp32')!r} but the engine runs "
                f"masters={self.rung!r}; resume with the same masters, or switch after loading"
            )
        if self.rung == "fp32":
            super().load_state_dict(state["masters"])
        extra = state.get("extra", {})
        missing = [n for n, e in zip(self.names, self.extra) if e is not None and n not in extra]
        if missing:
            raise ValueError(f"the ladder state lacks {missing[:5]}; nothing was loaded")
        with torch.no_grad():
            for n, e in zip(self.names, self.extra):
                if e is not None:
                    e.copy_(extra[n])
        if self.gen is not None and "generator" in state:
            self.gen.set_state(state["generator"])
            if state.get("stream") != STREAM:
                warn_other_stream(state.get("stream"))
            elif state.get("per_call", self.budget) != self.budget:
                warn_other_calls(state["per_call"], self.budget)

    def full_precision_state_dict(self) -> dict[str, torch.Tensor]:
        out = {
            k: (v.float() if v.is_floating_point() else v)
            for k, v in self.model.state_dict().items()
        }
        for i, n in enumerate(self.names):
            out[n] = self.fp32_value(i)
        return out

    def storage(self) -> list[torch.Tensor]:
        """The rung's own tensors (remainders / compensations), for memory accounting."""
        return [e for e in self.extra if e is not None]

    def scratch(self) -> list[torch.Tensor]:
        """The bounded scratch kept between steps (``ladder_scratch_mib``), for memory accounting."""
        return [t for t in (self._buf, self._tmp, self._arena.buf) if t.numel()]
