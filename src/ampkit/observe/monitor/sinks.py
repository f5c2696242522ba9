"""Where records go: JSONL files, TensorBoard event files, the console.

A sink is anything with ``write(records)`` and ``close()``. Records arrive in batches (one per
``log_every`` steps), so sinks do their I/O once per batch.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any, Optional

__all__ = ["ConsoleSink", "JSONLSink", "TensorBoardSink", "finite_json", "log_cut", "read_jsonl"]

#: the newest cut of each log this process made (``JSONLSink(after_step=)``): real path -> (a
#: token, the byte length the log was cut to); a :class:`~.trackers.JSONLFollower` of that log
#: goes on from there
_CUTS: dict[str, tuple[object, int]] = {}


def log_cut(path: str) -> Optional[tuple[object, int]]:
    """The newest cut of the log at ``path`` made in this process: ``(token, length)``, or None."""
    return _CUTS.get(os.path.realpath(path))


def _record_of(line: bytes) -> Optional[dict[str, Any]]:
    """A log line's record, or None where the line is not a whole record with a step."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) and isinstance(r.get("step"), int) else None


class JSONLSink:
    """Append one JSON object per line to ``path``; flushed to the OS per batch.

    Flushing survives a crash of the training process; ``fsync=True`` also survives a crash of
    the machine, at about a millisecond per batch. Appending makes it safe across resumed runs:
    a resumed run continues the same file. A line cut short by a crash is skipped (with a
    warning) by :func:`read_jsonl`.

    ``after_step``: the run goes on after that optimizer step (a resume from its checkpoint), so
    the records of later steps at the log's end -- an earlier process's, which this one redoes --
    are cut off first (one ``truncate``: the log is whole before and after), as TensorBoard's
    ``purge_step`` does for its events; each step is then in the log once. ``dropped`` counts the
    records cut and ``redone`` gives the first and last step record cut (None: none). ``run_id``:
    only that run's records are cut (a log dir another run also wrote keeps its records).
    """

    def __init__(
        self,
        path: str,
        *,
        fsync: bool = False,
        after_step: Optional[int] = None,
        run_id: Optional[str] = None,
    ) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self.path = path
        self._fsync = fsync
        self.dropped, self.redone, self.shared = 0, None, False
        if after_step is not None and os.path.exists(path):
            self._cut_after(after_step, run_id)
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the sink
        # A crash mid-line leaves a partial last line; start ours on a fresh line.
        if self._fh.tell() > 0:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._fh.write("\n")

    def _cut_after(self, step: int, run_id: Optional[str]) -> None:
        """Cut the log's tail of records after ``step`` (and a line a crash cut short there); with
        ``run_id``, only that run's: another run's record (a log dir two runs share) ends the cut
        and sets ``shared``."""
        with open(self.path, "rb") as f:
            data = f.read()
        lines, starts, pos = data.split(b"\n"), [], 0
        for line in lines:
            starts.append(pos)
            pos += len(line) + 1
        keep, steps, last = len(data), [], True
        for i in range(len(lines) - 1, -1, -1):  # from the end: only the tail is redone
            if not lines[i].strip():
                continue
            r = _record_of(lines[i])
            if r is None and not last:  # a damaged line inside the log: not a redone record
                break
            last = False
            if r is not None:
                if run_id is not None and r.get("run_id", run_id) != run_id:
                    self.shared = True  # another run's: never ours to cut
                    break
                if r["step"] <= step:
                    break
                self.dropped += 1
                if r.get("type") == "step":
                    steps.append(r["step"])
            keep = starts[i]
        if keep < len(data):
            os.truncate(self.path, keep)
            _CUTS[os.path.realpath(self.path)] = (object(), keep)
        if steps:
            self.redone = [min(steps), max(steps)]

    def write(self, records: list[dict[str, Any]]) -> None:
        try:
            self._fh.write("".join(_line(r) + "\n" for r in records))
            self._fh.flush()
            if self._fsync:
                os.fsync(self._fh.fileno())
        except OSError as e:  # e.g. a full disk: say which file, and what to do
            raise OSError(
                e.errno,
                f"{e.strerror or e} (appending to the run's log; free space on that disk, then "
                "resume from the last checkpoint or run again)",
                self.path,
            ) from e

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


def _value(v: Any) -> Optional[str]:
    """JSON text of a scalar, or None when it needs the general encoder (or is non-finite)."""
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else None
    return None


def _line(record: dict[str, Any]) -> str:
    """One JSON line. Step records (flat dicts of numbers and a few known strings) take a fast
    path about 5x cheaper than ``json.dumps``; anything else goes through the encoder."""
    if record.get("type") == "step":
        parts = []
        for k, v in record.items():
            text = _value(v)
            if text is None:
                if isinstance(v, str):
                    text = json.dumps(v)
                else:
                    return json.dumps(finite_json(record), allow_nan=False)
            parts.append(f'"{k}":{text}')
        return "{" + ",".join(parts) + "}"
    return json.dumps(finite_json(record), allow_nan=False)


def finite_json(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as the JSONL log writes it: JSON has no inf/NaN, so they become null and their keys
    are listed under ``nonfinite`` (a NaN loss is the event, and is logged as such)."""
    out = {}
    for k, v in record.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
            out.setdefault("nonfinite", []).append(k)
        elif isinstance(v, dict):
            out[k] = finite_json(v)
        else:
            out[k] = v
    return out


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Read a JSONL log. A truncated last line (a crash mid-write) is skipped with a warning;
    a malformed line elsewhere raises ``ValueError`` naming the file and line."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"log file {path!r} does not exist")
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    records = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == last:
                warnings.warn(
                    f"{path}: skipping a truncated last line {i + 1} (the run was probably "
                    f"interrupted mid-write); {len(records)} records before it are kept",
                    stacklevel=2,
                )
                break
            # A partial line followed by a resumed run's records: skip it too, but say so.
            if i + 1 < len(lines) and not line.rstrip().endswith("}"):
                warnings.warn(f"{path}: skipping a truncated line {i + 1}", stacklevel=2)
                continue
            raise ValueError(f"{path}: line {i + 1} is not valid JSON: {e}") from None
    return records


_TB_SCALARS = (
    "loss",
    "scale",
    "grad_norm",
    "lr",
    "step_time_ms",
    "samples_per_s",
    "tokens_per_s",
    "peak_mem_bytes",
)


class TensorBoardSink:
    """Write scalars through ``torch.utils.tensorboard.SummaryWriter`` (needs ``ampkit[tensorboard]``).

    Step records become scalars under ``train/``; ``skipped`` becomes ``train/skipped`` (0/1);
    events become text under ``events/<kind>``.
    """

    def __init__(self, log_dir: str, *, purge_step: Optional[int] = None) -> None:
        """``purge_step``: a resumed run goes on from that step; TensorBoard drops the events of
        that step and later that an earlier process wrote (``SummaryWriter(purge_step=)``)."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # tensorboard is an optional extra
            raise ImportError(
                'TensorBoard logging needs the tensorboard package: pip install "ampkit[tensorboard]"'
            ) from e
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def write(self, records: list[dict[str, Any]]) -> None:
        w = self._writer
        for r in records:
            step = r["step"]
            if r["type"] == "step":
                for key in _TB_SCALARS:
                    v = r.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                        w.add_scalar(f"train/{key}", v, step)
                w.add_scalar("train/skipped", float(bool(r.get("skipped"))), step)
            else:
                details = {
                    k: v
                    for k, v in r.items()
                    if k not in ("schema_version", "type", "kind", "step", "time")
                }
                w.add_text(f"events/{r['kind']}", json.dumps(details, default=str)[:4000], step)
        w.flush()

    def close(self) -> None:
        self._writer.close()


class ConsoleSink:
    """A rich progress bar with live loss / scale / throughput; prints the summary table at the end."""

    def __init__(
        self, total_steps: Optional[int] = None, *, console: Any = None, title: str = "train"
    ) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.console = console or Console()
        self._progress = Progress(
            TextColumn(f"[bold]{title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task(title, total=total_steps, info="")
        self._started = False

    def write(self, records: list[dict[str, Any]]) -> None:
        from .summary import summary_table

        if not self._started:
            self._progress.start()
            self._started = True
        steps = [r for r in records if r["type"] == "step"]
        if steps:
            r = steps[-1]
            info = f"loss {r['loss']:.4f}" if r.get("loss") is not None else "loss nan"
            if r.get("scale") is not None:
                info += f"  scale {r['scale']:g}"
                if r.get("growth_tracker") is not None:
                    info += f" (growth {r['growth_tracker']})"
            if r.get("tokens_per_s"):
                info += f"  {r['tokens_per_s']:,.0f} tok/s"
            elif r.get("samples_per_s"):
                info += f"  {r['samples_per_s']:,.0f} samples/s"
            self._progress.update(self._task, completed=r["step"], info=info)
        for e in records:
            if e["type"] == "event" and e["kind"] == "diagnosis":
                self._progress.console.print(
                    f"[yellow]diagnosis[/] (first skipped step): {e.get('message', '')}"
                )
            if e["type"] == "event" and e["kind"] == "eval" and e.get("loss") is not None:
                self._progress.console.print(
                    f"eval at step {e['step']}: loss {e['loss']:.4f} ({e.get('precision', '')})"
                )
            if e["type"] == "event" and e["kind"] in (
                "fallback",
                "fallback_retry",
                "precision_switch",
            ):
                self._progress.console.print(
                    f"[yellow]{e['kind']}[/] at step {e['step']}: "
                    f"{e.get('from', '')} → {e.get('to', '')} ({e.get('reason', '')})"
                )
            if e["type"] == "event" and e["kind"] == "summary":
                self.close()
                summary = {
                    k: v
                    for k, v in e.items()
                    if k not in ("schema_version", "type", "kind", "step", "time")
                }
                self.console.print(summary_table(summary))

    def close(self) -> None:
        if self._started:
            self._progress.stop()
            self._started = False
