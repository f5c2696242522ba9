"""ampkit: mixed-precision training for PyTorch that is fast, safe and visible.

Everything a user needs is importable from here (``from ampkit import MixedPrecision, Trainer``).
The package is grouped by part: ``ampkit.step`` (what one optimizer step does),
``ampkit.observe`` (watching it), ``ampkit.distributed`` (DDP/FSDP2, launching), ``ampkit.models``
(what is trained), ``ampkit.loop`` (running steps), ``ampkit.plan`` (will it fit) beside
``ampkit.choose`` (choosing by measurement), ``ampkit.train`` (the Trainer), ``ampkit.integrations``,
``ampkit.service`` and ``ampkit.cli``. Arrows point down that list and never back up. A name not
listed in ``__all__`` lives in its home module (``ampkit.models.builtin``, ...).
"""

from __future__ import annotations

from .choose.autoselect import confirm_auto
from .choose.bench import BenchReport, compare
from .choose.recommend import Recommendation, tune
from .loop.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatch,
    load_checkpoint,
    save_checkpoint,
)
from .observe.memory import MemoryBreakdown, breakdown
from .observe.monitor import (
    ConsoleSink,
    JSONLSink,
    MLflowSink,
    Monitor,
    TensorBoardSink,
    WandbSink,
    read_jsonl,
)
from .observe.numerics import AuditReport, audit
from .plan.estimate import MemoryEstimate, estimate, largest_batch
from .step.config import ConfigError, MixedPrecisionConfig
from .step.engine import Event, MixedPrecision, StepResult
from .step.fallback import NumericsError
from .step.hardware import DeviceInfo, device_info
from .step.localize import NonFiniteReport, localize_nonfinite
from .step.manifest import Manifest
from .step.precision import Precision, PrecisionError, resolve_precision
from .step.scaler import LossScaler
from .train.rollback import SpikeGuard
from .train.stop import TrainingInterrupted
from .train.trainer import Trainer, TrainSummary
from .train.trainer_config import BatchConfig, CheckpointConfig, EvalConfig, LogConfig

__version__ = "0.1.0"

__all__ = [
    # the engine
    "MixedPrecision",
    "StepResult",
    "Event",
    "LossScaler",
    "NumericsError",
    "Manifest",
    # precision and configuration
    "Precision",
    "PrecisionError",
    "resolve_precision",
    "MixedPrecisionConfig",
    "ConfigError",
    "DeviceInfo",
    "device_info",
    # training loop and checkpoints
    "Trainer",
    "TrainSummary",
    "TrainingInterrupted",
    "CheckpointConfig",
    "EvalConfig",
    "LogConfig",
    "BatchConfig",
    "SpikeGuard",
    "CheckpointManager",
    "CheckpointError",
    "CheckpointMismatch",
    "save_checkpoint",
    "load_checkpoint",
    # observing: monitor and sinks, memory
    "Monitor",
    "JSONLSink",
    "TensorBoardSink",
    "ConsoleSink",
    "MLflowSink",
    "WandbSink",
    "read_jsonl",
    "MemoryBreakdown",
    "breakdown",
    "MemoryEstimate",
    "estimate",
    "largest_batch",
    # numerics
    "audit",
    "AuditReport",
    "localize_nonfinite",
    "NonFiniteReport",
    # choosing by measurement
    "confirm_auto",
    "compare",
    "tune",
    "BenchReport",
    "Recommendation",
    "__version__",
]
