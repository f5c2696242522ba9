"""The ladder's gradients: a whole one-micro-step window's bf16 gradients kept as they are.

With fp32 masters (:class:`~.masters.MasterWeights`) each half gradient becomes an fp32 copy on its
master after every backward: 4 bytes per parameter, the fp32 sum an accumulation window needs.
The ladder's rungs (``split``, ``kahan``, ``stochastic``) keep no fp32 values between steps, so
that copy would be the largest thing a step adds: 14 instead of 12 bytes per parameter for
``stochastic`` with AdamW, 10 instead of 8 with bf16 states. When a backward makes a whole window
on its own (``accumulation_steps=1``, the micro-step closed, no optimizer in backward) nothing will
be summed into its gradients, so each bf16 gradient moves as it is onto its stand-in -- which is
made bf16 for the time (a parameter's gradient has its dtype): 2 bytes per parameter. A stand-in
that still has a gradient then (``zero_grad=False``, another optimizer's step left it, a parameter
no optimizer holds) has the new one summed into it in fp32, as ever; the others stay bf16.

At the boundary the engine says whether the step is **lean**: it only checks and clips the
gradients (no unscaling of a real scale, no flush of a short window, no data-parallel averaging,
``zero_grad`` on). A lean step checks the bf16 gradients directly (finite exactly when their fp32
upcasts are) and the ladder's step widens them call by call into the fp32 the optimizer reads --
the exact upcast, so every rung and optimizer steps **bitwise** as with fp32 gradients
(tests/step/test_ladder_grads.py). Clipping (:meth:`KeptGrads.clip`) is ``clip_grad_norm_``'s
arithmetic on those upcasts: each tensor's norm from its upcast (one tensor widened at a time, in
the order and grouping torch uses), the total and the clamped coefficient as torch computes them;
the coefficient multiplies each upcast of a clipped stand-in when the step widens it (the same one
rounding as torch's in-place multiply of an fp32 gradient; another optimizer's gradients, which
torch would not clip, are not multiplied). Any other step, and anything reading them for itself
(``stepped_params``: the integrations' clipping and logging; an optimizer's ``load_state_dict``,
which casts states to the stand-ins' dtype), first turns them into their fp32 upcasts, today's
gradients. After the boundary's ``zero_grad`` the stand-ins are fp32 again.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Optional

import torch
from torch.utils._foreach_utils import _has_foreach_support

__all__ = ["HALF_GRADS", "KeptGrads", "fp32"]

#: keep a whole one-micro-step window's bf16 gradients for a lean step (module doc); False: always
#: the fp32 upcast (the reference the tests compare against)
HALF_GRADS = True


class KeptGrads:
    """Which stand-ins hold a kept bf16 gradient, and the data each has between calls."""

    def __init__(
        self,
        halves: Sequence[torch.Tensor],
        masters: Sequence[torch.Tensor],
        dummy: torch.Tensor,
    ) -> None:
        self.halves, self.masters = halves, masters
        self._dummy = {torch.float32: dummy, torch.bfloat16: dummy.to(torch.bfloat16)}
        self.held: set[int] = set()
        # each kept gradient (its stand-in's index, the tensor) and its version then
        self._versions: list[tuple[int, torch.Tensor, int]] = []
        self._warned = False
        # a lean clip's clamped coefficient, not yet applied, and the stand-ins it clipped (only
        # those: torch clips the parameters it is given, another optimizer's gradients stay)
        self.coef: Optional[torch.Tensor] = None
        self.clipped: set[int] = set()
        self._index = {id(m): i for i, m in enumerate(masters)}

    def between(self, i: int) -> torch.Tensor:
        """Stand-in ``i``'s data between calls: the shared scalar expanded to its shape, bf16 while
        it holds a kept gradient."""
        dtype = torch.bfloat16 if i in self.held else torch.float32
        return self._dummy[dtype].expand(self.halves[i].shape)

    def keep(self) -> bool:
        """Move each bf16 half gradient whose stand-in has none onto it as it is; False (nothing
        moved) where one is sparse. A stand-in that still has a gradient (``zero_grad=False``,
        another optimizer's, a parameter no optimizer holds) keeps it, and an fp32 half gradient
        (``param.grad_dtype``) stays: the caller sums them into fp32 ones."""
        gs = [h.grad for h in self.halves]
        if not HALF_GRADS or any(g is not None and g.layout != torch.strided for g in gs):
            return False  # (fake gradients too: a plan)
        self.settle(False)  # (kept past a step that failed: their fp32 upcasts, as clipped)
        for i, (h, m, g) in enumerate(zip(self.halves, self.masters, gs)):
            if g is not None and m.grad is None and g.dtype == torch.bfloat16:
                self.held.add(i)
                m.data = self.between(i)
                m.grad, h.grad = g, None
                self._versions.append((i, g, g._version))
        return True

    def settle(self, lean: bool) -> None:
        """Kept gradients stay for a ``lean`` step; else each becomes its fp32 upcast (exact) on
        an fp32 stand-in. Either way a clip's coefficient is spent (a lean step's comes later: a
        clip that found no kept gradient leaves none for the next step to apply). No sync."""
        if self._versions:
            self._check_unchanged()
        for i in [] if lean else sorted(self.held):
            m = self.masters[i]
            g, m.grad = m.grad, None
            self.held.discard(i)
            m.data = self.between(i)
            if g is not None:  # as MasterWeights.absorb_grads makes it (clipped: as clipped)
                m.grad = self.widen(g, i)
        self.coef, self.clipped = None, set()

    def before_load(self, opt: torch.optim.Optimizer, state: dict) -> None:
        """An optimizer's ``load_state_dict`` pre-hook: torch casts the loaded states to their
        parameters' dtype, so the stand-ins are made fp32 first (their kept gradients too)."""
        self.settle(False)

    def widen(self, g: torch.Tensor, i: int) -> torch.Tensor:
        """Stand-in ``i``'s gradient (or a piece of it) as an fp32 stand-in takes it: a kept bf16
        one widened (exact), times a lean clip's coefficient where that clip read it; an fp32 one
        as it is."""
        if g.dtype == torch.float32:
            return g
        w = g.float()
        return w if self.coef is None or i not in self.clipped else w.mul_(self.coef.to(w.device))

    def clip(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (2-norm) with the kept gradients read
        as their fp32 upcasts (module doc): returns the total norm; the other gradients are
        multiplied in place, the kept ones when the step widens them."""
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return torch.tensor(0.0)
        kept = {id(self.masters[i].grad) for i in self.held}  # multiplied later, when widened
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:  # grouped as torch groups the fp32 upcasts
            key = (g.device, torch.float32 if id(g) in kept else g.dtype)
            groups.setdefault(key, []).append(g)
        norms: list[torch.Tensor] = []
        for (device, _), gs in groups.items():
            if _has_foreach_support(gs, device):
                norms += [torch._foreach_norm([fp32(g)], 2.0)[0] for g in gs]
            else:
                norms += [torch.linalg.vector_norm(fp32(g), 2.0) for g in gs]
        first = grads[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
        clamped = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for (device, _), gs in groups.items():
            plain = [g for g in gs if id(g) not in kept]
            coef = clamped.to(device)
            if plain and _has_foreach_support(plain, device):
                torch._foreach_mul_(plain, coef)
            else:
                for g in plain:
                    g.mul_(coef)
        self.coef = clamped
        self.clipped = {self._index[id(p)] for p in params if id(p) in self._index}
        return total

    def _check_unchanged(self) -> None:
        """Warn (once) where a kept bf16 gradient was changed in place, or replaced by another bf16
        one, between backward and the step: code that clips or scales the optimizer's gradients by
        hand did it in bf16 there."""
        now = [(self.masters[i].grad, g, v) for i, g, v in self._versions]
        changed = any(g._version != v or (m is not None and m is not g) for m, g, v in now)
        self._versions = []
        if changed and not self._warned:
            self._warned = True
            warnings.warn(
                "ampkit: a gradient of the memory ladder's stand-ins was changed in place (or "
                "replaced) between backward() and step(); the ladder keeps them in bf16 there (2 "
                "bytes per parameter), "
                "so that change was made in bf16. Clip with clip_grad_norm=... (exact), or read "
                "and change them through ampkit.integrations.common.stepped_params(amp, model), "
                "which hands out their fp32 upcasts",
                stacklevel=3,
            )


def fp32(g: torch.Tensor) -> torch.Tensor:
    """A gradient as an fp32 stand-in takes it: a kept bf16 gradient widened (exact), else itself."""
    return g if g.dtype == torch.float32 else g.float()
