"""Observability: per-step records read in batches, summaries, and sinks (JSONL, TensorBoard, console,
MLflow, Weights & Biases)."""

from .core import SCHEMA_VERSION, Monitor, peak_memory_bytes
from .sinks import ConsoleSink, JSONLSink, TensorBoardSink, read_jsonl
from .summary import summarize, summary_table
from .trackers import MLflowSink, WandbSink

__all__ = [
    "SCHEMA_VERSION",
    "ConsoleSink",
    "JSONLSink",
    "MLflowSink",
    "Monitor",
    "TensorBoardSink",
    "WandbSink",
    "peak_memory_bytes",
    "read_jsonl",
    "summarize",
    "summary_table",
]
