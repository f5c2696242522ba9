"""Where a Trainer's run is written: the monitor's sinks (JSONL, TensorBoard, a progress bar) and
``summary.json``. Rank 0 alone writes."""

from __future__ import annotations

import json
import os
from typing import Any

from ..distributed import is_main
from ..observe.monitor import ConsoleSink, JSONLSink, TensorBoardSink
from ..step import tomlio
from .trainer_config import LogConfig

__all__ = ["run_sinks", "write_summary"]


def run_sinks(log: LogConfig, total_steps: int, notes: list[str]) -> list[Any]:
    """The sinks ``log`` asks for, then its own ``sinks`` (none off rank 0, where those are closed
    unused); a missing optional one is a line in ``notes``. ``total_steps`` sizes the progress bar
    (0: unknown)."""
    sinks: list[Any] = []
    if not is_main():  # one process prints and writes logs
        for sink in log.sinks:
            sink.close()
        return sinks
    if log.dir:
        os.makedirs(log.dir, exist_ok=True)
        sinks.append(JSONLSink(os.path.join(log.dir, "log.jsonl")))
        if log.tensorboard:
            try:
                sinks.append(TensorBoardSink(os.path.join(log.dir, "tb")))
            except ImportError as e:
                notes.append(str(e))
    if log.progress:
        sinks.append(ConsoleSink(total_steps=total_steps or None, console=log.console))
    return sinks + list(log.sinks)


def write_summary(log_dir: str, summary: dict[str, Any]) -> None:
    """``summary.json`` in ``log_dir``: the monitor's closing summary, written atomically (a
    failed write, e.g. a full disk, leaves the previous file as it was and names the file)."""
    path = os.path.join(log_dir, "summary.json")
    try:
        tomlio.write(path, json.dumps(summary, indent=2))
    except OSError as e:
        raise OSError(
            e.errno,
            f"{e.strerror or e} (writing the run's summary; nothing was replaced: free space on "
            "that disk; the checkpoints and log.jsonl hold the run)",
            path,
        ) from e
