"""ampkit: mixed-precision training for PyTorch that is fast, safe and visible."""

from .config import ConfigError, MixedPrecisionConfig
from .engine import Event, MixedPrecision, StepResult
from .hardware import DeviceInfo, device_info
from .precision import Precision, PrecisionError, resolve_precision
from .scaler import LossScaler

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
    "__version__",
    "device_info",
    "resolve_precision",
]
