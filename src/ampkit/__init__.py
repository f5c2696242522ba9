"""ampkit: mixed-precision training for PyTorch that is fast, safe and visible.

The package is grouped by part (see the README's "Architecture"): ``ampkit.step`` (what one
optimizer step does), ``ampkit.observe`` (watching it), ``ampkit.loop`` (running many steps) and
``ampkit.cli`` (the command line). Arrows point down that list and never back up.

The short module paths documented since 0.1 (``ampkit.monitor``, ``ampkit.memory``,
``ampkit.numerics``, ``ampkit.trainer``, ``ampkit.checkpoint``, ``ampkit.bench``, ...) keep
working: they are the same module objects as their homes in the packages, imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from .distributed import adapter_for as _adapter_for
from .loop.stop import TrainingInterrupted
from .observe.numerics import localize_nonfinite as _localize_nonfinite
from .step.config import ConfigError, MixedPrecisionConfig
from .step.engine import Event, MixedPrecision, StepResult
from .step.hardware import DeviceInfo, device_info
from .step.precision import Precision, PrecisionError, resolve_precision
from .step.scaler import LossScaler

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DeviceInfo",
    "Event",
    "LossScaler",
    "MixedPrecision",
    "MixedPrecisionConfig",
    "Precision",
    "PrecisionError",
    "StepResult",
    "TrainingInterrupted",
    "__version__",
    "device_info",
    "resolve_precision",
]

# The composition root hands the engine its diagnosis tool (the engine never imports observers).
MixedPrecision.default_localizer = staticmethod(_localize_nonfinite)
# ... and the adapter that makes it cooperate with DDP / FSDP2 (the engine never imports distributed).
MixedPrecision.parallel_adapter = staticmethod(_adapter_for)

#: short, documented module path -> its home in the package tree
MODULE_HOMES = {
    "precision": "step.precision", "hardware": "step.hardware", "config": "step.config",
    "scaler": "step.scaler", "engine": "step.engine", "overrides": "step.overrides",
    "fallback": "step.fallback", "memory": "observe.memory", "monitor": "observe.monitor",
    "numerics": "observe.numerics", "trainer": "loop.trainer", "checkpoint": "loop.checkpoint",
    "data": "loop.data", "models": "loop.models", "bench": "loop.bench",
    "activation_checkpointing": "step.activation_checkpointing",
}


class _ShortPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import ampkit.trainer`` returns ``ampkit.loop.trainer`` itself (one module object)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        short = name[len(__name__) + 1:] if name.startswith(__name__ + ".") else None
        if short in MODULE_HOMES:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec: Any) -> Any:
        module = importlib.import_module(f"{__name__}.{MODULE_HOMES[spec.name.rsplit('.', 1)[1]]}")
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        # Already executed under its home name; the import system stamped the alias's spec on
        # it, so the real one is put back.
        module.__spec__ = self._real_spec


if not any(isinstance(f, _ShortPaths) for f in sys.meta_path):
    sys.meta_path.insert(0, _ShortPaths())


def __getattr__(name: str) -> Any:
    if name in MODULE_HOMES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
