"""Where a Trainer's run is written: the monitor's sinks (JSONL, TensorBoard, a progress bar) and
``summary.json``. Rank 0 alone writes."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict
from typing import Any, Optional

from ..choose.autoselect import auto_decision
from ..distributed import is_main
from ..observe.monitor import ConsoleSink, JSONLSink, Monitor, TensorBoardSink, read_jsonl
from ..step import tomlio
from .trainer_config import LogConfig

__all__ = ["open_monitor", "run_sinks", "write_summary"]


def open_monitor(
    trainer: Any, steps: int, accum: int, extra_sinks: list[Any], resumed: Optional[str]
) -> Monitor:
    """A Trainer's monitor for ``steps`` more optimizer steps of ``accum`` batches. At step 0 it
    also logs what was chosen before it (auto precision, batch); after a resume (``resumed``: what
    was loaded) a ``resumed`` event, once the log's records of the steps redone are cut."""
    amp, source = trainer.amp, trainer.source
    samples, tokens = source.samples_per_batch, source.tokens_per_batch  # per rank
    per_step = accum * trainer.world_size  # throughput: all ranks
    at = amp.optimizer_steps
    sinks = run_sinks(
        trainer.settings.log,
        steps + at,
        trainer.notes,
        resumed_at=at if resumed and at else None,
        run_id=trainer.run_id,
    )
    log = next((s for s in sinks if isinstance(s, JSONLSink)), None)
    monitor = Monitor(
        amp,
        sinks + extra_sinks,
        log_every=trainer.settings.log.every,
        run_id=trainer.run_id,
        samples_per_step=samples * per_step if samples else None,
        tokens_per_step=tokens * per_step if tokens else None,
        optimizer=trainer.optimizer,
        context=lambda: {"epoch": source.batch_epoch},
        history=_history(log.path, trainer.run_id) if log is not None and at else (),
    )
    if at == 0:
        decision = auto_decision(amp)
        if decision is not None:
            monitor.log_event("auto_precision", **decision)
        if trainer.auto_batch is not None:
            monitor.log_event("auto_batch", **asdict(trainer.auto_batch))
    elif resumed:  # where the run went on, and which steps of an earlier process it redoes
        monitor.log_event(
            "resumed",
            source=resumed,
            dropped_records=log.dropped if log else 0,
            redone_steps=log.redone if log else None,
        )
    return monitor


def _history(path: str, run_id: str) -> list[dict[str, Any]]:
    """The run's records in its log so far (a reused log's other runs left out), for the summary."""
    with warnings.catch_warnings():  # a line cut by a crash was cut from the log with the tail
        warnings.simplefilter("ignore")
        records = read_jsonl(path) if os.path.exists(path) else []
    return [r for r in records if r.get("run_id") == run_id]


def run_sinks(
    log: LogConfig,
    total_steps: int,
    notes: list[str],
    resumed_at: Optional[int] = None,
    run_id: Optional[str] = None,
) -> list[Any]:
    """The sinks ``log`` asks for, then its own ``sinks`` (none off rank 0, where those are closed
    unused); a missing optional one is a line in ``notes``. ``total_steps`` sizes the progress bar
    (0: unknown). ``resumed_at``: the run goes on from that checkpointed step, so the log's records
    of later steps (an earlier process's, redone now) are cut and TensorBoard purges them."""
    sinks: list[Any] = []
    if not is_main():  # one process prints and writes logs
        for sink in log.sinks:
            sink.close()
        return sinks
    if log.dir:
        os.makedirs(log.dir, exist_ok=True)
        jsonl = JSONLSink(os.path.join(log.dir, "log.jsonl"), after_step=resumed_at, run_id=run_id)
        sinks.append(jsonl)
        if log.tensorboard:  # (a tb/ another run also wrote is not purged: its steps would go)
            purge = None if resumed_at is None or jsonl.shared else resumed_at + 1
            try:
                sinks.append(TensorBoardSink(os.path.join(log.dir, "tb"), purge_step=purge))
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
