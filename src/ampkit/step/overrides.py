"""Per-module precision overrides: keep chosen modules in fp32 inside an autocast region.

Patterns are qualified-name globs (``"lm_head"``, ``"*.norm*"``, ``"blocks.*.attn"``) or module
types (``torch.nn.LayerNorm``, or the class name / dotted path as a string, so they fit in a TOML
config). A type matches subclasses too.

An overridden module runs with autocast disabled, its floating-point inputs cast to fp32, so its
outputs are fp32. This is done with forward pre-/post-hooks (the module object, its parameters
and its ``state_dict`` keys are untouched); :meth:`Fp32Overrides.remove` undoes it.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable
from typing import Any

import torch

from .config import Pattern, normalize_patterns

__all__ = ["Fp32Overrides", "apply_fp32_overrides", "match_modules"]


def _type_names(module: torch.nn.Module) -> set[str]:
    names = set()
    for cls in type(module).__mro__:
        if cls is object:
            break
        names.add(cls.__name__)
        names.add(f"{cls.__module__}.{cls.__qualname__}")
    # torch.nn.LayerNorm lives in torch.nn.modules.normalization: accept the public path too.
    if type(module).__module__.startswith("torch.nn.modules."):
        names.add(f"torch.nn.{type(module).__name__}")
    return names


def match_modules(model: torch.nn.Module, patterns: Iterable[Pattern]) -> dict[str, list[str]]:
    """``{pattern: [qualified names it matches]}``. Raises ``ValueError`` for a pattern that
    matches nothing, listing close module names and types."""
    pats = normalize_patterns(patterns)
    named = [(n, m) for n, m in model.named_modules() if n]  # the root itself is never overridden
    out: dict[str, list[str]] = {}
    for pat in pats:
        hits = [n for n, m in named if fnmatch.fnmatchcase(n, pat) or pat in _type_names(m)]
        if not hits:
            candidates = sorted({n for n, _ in named} | {type(m).__name__ for _, m in named})
            close = difflib.get_close_matches(pat, candidates, n=5, cutoff=0.4) or candidates[:5]
            raise ValueError(
                f"keep_fp32 pattern {pat!r} matches no module of {type(model).__name__}; "
                f"close names: {', '.join(close)} (globs like '*.norm*' and types like "
                "torch.nn.LayerNorm work too)"
            )
        out[pat] = hits
    return out


class Fp32Overrides:
    """The hooks that keep a set of modules in fp32; ``remove()`` takes them off."""

    def __init__(self, model: torch.nn.Module, names: list[str], device_type: str) -> None:
        self.names = names
        self.device_type = device_type
        self._handles: list[Any] = []
        modules = dict(model.named_modules())
        # Nested matches: only the outermost needs hooks (its children already run in fp32).
        outer = [n for n in names if not any(n != o and n.startswith(o + ".") for o in names)]
        for n in outer:
            m = modules[n]
            stack: list[bool] = []
            self._handles.append(m.register_forward_pre_hook(self._pre(stack), with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post(stack), always_call=True))
        self.hooked = outer

    def _pre(self, stack: list[bool]) -> Any:
        dev = self.device_type

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            stack.append(torch.is_autocast_enabled(dev))
            torch.set_autocast_enabled(dev, False)
            return to_fp32(args), to_fp32(kwargs)

        return hook

    def _post(self, stack: list[bool]) -> Any:
        dev = self.device_type

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
            if stack:
                torch.set_autocast_enabled(dev, stack.pop())
            return to_fp32(output)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def to_fp32(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.is_floating_point() and obj.dtype != torch.float32 else obj
    if isinstance(obj, tuple):
        return tuple(to_fp32(o) for o in obj)
    if isinstance(obj, list):
        return [to_fp32(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_fp32(v) for k, v in obj.items()}
    return obj


def apply_fp32_overrides(
    model: torch.nn.Module, patterns: Iterable[Pattern], device_type: str
) -> Fp32Overrides:
    """Validate ``patterns`` against ``model`` and hook the matched modules (see module doc)."""
    matched = match_modules(model, patterns)
    names = sorted({n for hits in matched.values() for n in hits})
    return Fp32Overrides(model, names, device_type)
