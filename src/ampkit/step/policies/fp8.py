"""fp8 training through torchao's float8 (``torchao.float8.convert_to_float8_training``).

Eligible ``nn.Linear`` modules become torchao ``Float8Linear``s (fp8 casts with dynamic scaling
and fp8 matmuls in forward and backward); everything else runs under bf16 autocast. The module
filter is ampkit's own, and every decision is reported (:func:`plan`):

* both dimensions must be multiples of 16 (fp8 tensor-core GEMM shapes);
* the first and the last Linear are skipped by default (embedding-adjacent projections and the
  output head are where fp8's 3-4 significant bits hurt most; torchtitan skips the head too);
* modules kept in fp32 (``keep_fp32``) are never converted.

Recipes (``fp8_recipe``): ``tensorwise`` (one scale per tensor, fastest), ``rowwise`` (a scale per
row, more accurate), ``rowwise_with_gw_hp`` (rowwise, weight gradient in high precision). A
precision row may fix its recipe (``fp8-rowwise``: ``rowwise``); :attr:`Fp8Policy.recipe`
says which.
``Float8Linear`` keeps its parameters' names, so state dicts keep the unconverted model's keys
and hold plain tensors (``weights_only=True`` loads them). :func:`revert` swaps the modules back
to ``nn.Linear`` (sharing the same parameters) for a fallback to bf16.

:class:`Fp8Policy` is the family's policy: ``prepare`` converts (after the modules kept in fp32
are known), the forward runs under bf16 autocast, ``release`` reverts the modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..hardware import device_info
from .base import PrecisionPolicy

__all__ = ["Fp8Decision", "Fp8Policy", "convert", "plan", "revert"]


@dataclass(frozen=True)
class Fp8Decision:
    """One Linear: converted to fp8 or skipped, and why."""

    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def plan(
    model: torch.nn.Module, keep: Iterable[str] = (), skip_first_last: bool = True
) -> list[Fp8Decision]:
    """Which Linears to convert, with a reason for each (nothing is changed)."""
    kept = set(keep)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    out = []
    for i, (name, m) in enumerate(linears):
        inside_kept = any(name == k or name.startswith(k + ".") for k in kept)
        if inside_kept:
            ok, why = False, "kept in fp32 (keep_fp32)"
        elif m.in_features % 16 or m.out_features % 16:
            ok, why = False, f"shape {m.out_features}x{m.in_features} is not a multiple of 16"
        elif skip_first_last and i == 0:
            ok, why = False, "the first Linear is kept in bf16 (skip_first_last)"
        elif skip_first_last and i == len(linears) - 1:
            ok, why = False, "the last Linear (the output head) is kept in bf16 (skip_first_last)"
        else:
            ok, why = True, "converted to Float8Linear"
        out.append(Fp8Decision(name, m.in_features, m.out_features, ok, why))
    return out


def convert(
    model: torch.nn.Module, recipe: str, *, emulate: bool, keep: Iterable[str] = ()
) -> list[Fp8Decision]:
    """Convert ``model``'s eligible Linears in place; returns the decisions. Needs torchao."""
    Float8LinearConfig, convert_to_float8_training = _torchao_float8()
    decisions = plan(model, keep)
    chosen = {d.name for d in decisions if d.converted}
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen)
    for name in chosen:
        model.get_submodule(name).register_forward_pre_hook(_to_autocast_dtype)
    return decisions


def _torchao_float8() -> tuple[Any, Any]:
    """torchao's float8 API, its import-time log lines kept off the terminal (:func:`..logs.quiet_imports`)."""
    from ..logs import quiet_imports

    try:
        with quiet_imports():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError('precision fp8 needs torchao: pip install "ampkit[fp8]"') from e
    return Float8LinearConfig, convert_to_float8_training


def _to_autocast_dtype(module: torch.nn.Module, args: tuple) -> tuple:
    """Cast a Float8Linear's input to the autocast dtype of its device. torchao does this only for
    CUDA autocast; on CPU an fp32 input would meet a bf16 gradient in the high-precision
    weight-gradient matmul (``rowwise_with_gw_hp``) and fail."""
    x = args[0] if args else None
    if (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and torch.is_autocast_enabled(x.device.type)
    ):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype:
            return (x.to(dtype), *args[1:])
    return args


def revert(model: torch.nn.Module) -> int:
    """Swap every ``Float8Linear`` back to ``nn.Linear`` sharing its parameters; returns how many."""
    count = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ != "Float8Linear":
            continue
        plain = torch.nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        plain.weight = module.weight
        plain.bias = module.bias
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, plain)
        count += 1
    return count


class Fp8Policy(PrecisionPolicy):
    """Eligible Linears as torchao ``Float8Linear`` (module doc), the rest under bf16 autocast."""

    _model: Any = None
    _decisions: list[Fp8Decision] = []

    def prepare(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        emulate = self.config.fp8_emulate and not device_info(self.device).fp8
        self._decisions = convert(model, self.recipe, emulate=emulate, keep=self.kept_names(model))
        self._model = model

    @property
    def recipe(self) -> str:
        """The torchao recipe: the precision row's own (``fp8-rowwise``), else ``fp8_recipe``."""
        return self.precision.row.fp8_recipe or self.config.fp8_recipe

    def release(self) -> None:
        if self._model is not None:
            revert(self._model)  # plain Linears on the same parameters
            self._model, self._decisions = None, []

    def forward_context(self) -> torch.autocast:
        return torch.autocast(
            self.device.type,
            dtype=self.precision.compute_dtype,
            cache_enabled=self.config.autocast_cache,
        )

    def describe(self) -> dict[str, Any]:
        """Adds ``recipe`` and ``modules``: each Linear, converted or skipped, with the reason."""
        return {
            **super().describe(),
            "compute": "float8 matmuls (torchao) in converted Linears, bfloat16 elsewhere",
            "recipe": self.recipe,
            "modules": [d.to_dict() for d in self._decisions],
        }
