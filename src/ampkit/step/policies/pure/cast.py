"""The bottom rung of bf16-pure's memory ladder (:mod:`.ladder`): ``masters='none'``, the model cast to
bf16 in place and stepped directly -- small updates round away (refused unless forced)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from .masters import cast_buffers, kept_tensors

__all__ = ["STALL_WARNING", "CastOnly"]

STALL_WARNING = (
    "bf16-pure with masters='none' keeps no fp32 masters: an update smaller than half the bf16 "
    "spacing of its weight rounds away, so weights stall (AdamW lr 1e-3 never moves a weight of "
    "1.0; norm weights freeze). Use masters='split' (exact, 12 B/param) or 'stochastic' (10)"
)


class CastOnly:
    """``masters='none'`` (forced): the model cast to bf16 in place, the optimizer steps it directly."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        dtype: torch.dtype,
        keep: Sequence[str] = (),
    ) -> None:
        warnings.warn(STALL_WARNING, UserWarning, stacklevel=4)
        self.model, self.optimizers = model, list(optimizers)
        kept = kept_tensors(model, keep)
        self.params = [p for p in model.parameters() if id(p) not in kept and p.is_floating_point()]
        self._cast(dtype)
        cast_buffers(model, dtype, lambda b: id(b) not in kept)

    def _cast(self, dtype: torch.dtype) -> None:
        """Parameters and their optimizer states (e.g. Adagrad's sums, made at construction) to ``dtype``."""
        with torch.no_grad():
            for p in self.params:
                p.grad = None
                p.data = p.data.to(dtype)
                for opt in self.optimizers:
                    state = opt.state.get(p, {})
                    for k, v in state.items():
                        if (
                            isinstance(v, torch.Tensor)
                            and v.is_floating_point()
                            and v.shape == p.shape
                            and v.dim() > 0  # (not a 0-d parameter's step count)
                        ):
                            state[k] = v.to(dtype)

    def release(self) -> None:
        self._cast(torch.float32)
        cast_buffers(self.model, torch.float32, lambda b: b.dtype != torch.float32)
