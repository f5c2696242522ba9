"""Monitor: one record per optimizer step, read from the device in batches.

The monitor subscribes to the engine's ``step`` events. Each event carries device tensors
(loss, scale, found_inf, grad norm); the monitor only *holds* them, and every ``log_every``
steps stacks them into one tensor. On CPU that tensor is read at once; on CUDA it is copied to
pinned host memory without blocking and a writer thread waits for the copy, builds the records
and writes the sinks — so the monitor never stalls the GPU or the training thread. Step times come from host
clocks on CPU and from CUDA events on GPU (recorded without syncing, read with the batch).
"""

from __future__ import annotations

import math
import queue
import resource
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch

from ...step.engine import Event, MixedPrecision
from ...step.precision import precision_row
from ...step.rung import Rung, join_spec
from .summary import state_memory_saved, summarize

__all__ = ["SCHEMA_VERSION", "Monitor", "peak_memory_bytes"]

SCHEMA_VERSION = 1


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: allocated bytes on CUDA (``max_memory_allocated``), peak RSS on CPU. No sync."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


class Monitor:
    """Per-step metrics for a :class:`MixedPrecision` engine, written to sinks in batches.

    Args:
        amp: the engine to observe (subscribes to its events at once).
        sinks: objects with ``write(records)`` and ``close()`` (JSONL, TensorBoard, console).
        log_every: steps per host read / sink write (the only syncs the monitor makes).
        samples_per_step, tokens_per_step: for throughput (per optimizer step, i.e. including
            accumulation); None leaves those fields out.
        optimizer: whose learning rate to record (default: the engine's first optimizer).
        threaded: build records and write sinks on a background thread (default: on CUDA,
            where the training thread only launches kernels and should never wait).
        context: called at each step (host values only, no sync); its dict joins that step's
            record (the Trainer's gives ``epoch``).
        history: a resumed run's records from before this monitor (its log's, e.g. from
            :func:`read_jsonl`): :meth:`summary` covers the whole run, not this process's steps.

    Record schema (``type == "step"``): ``schema_version, type, step, time, loss, precision,
    scale, skipped, grad_norm, lr, step_time_ms, samples_per_s, tokens_per_s, peak_mem_bytes`` and
    ``run_id`` when one is given (the Trainer gives one, kept across resumes).
    Events (``type == "event"``): ``schema_version, type, kind, step, time`` plus details;
    kinds: ``overflow`` (``scale_before``, ``scale_after``), ``fallback``,
    ``precision_switch``, ``checkpoint``, ``eval``, ``summary``.
    """

    def __init__(
        self,
        amp: MixedPrecision,
        sinks: Sequence[Any] = (),
        *,
        log_every: int = 10,
        samples_per_step: Optional[int] = None,
        tokens_per_step: Optional[int] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        threaded: Optional[bool] = None,
        run_id: Optional[str] = None,
        context: Optional[Callable[[], dict[str, Any]]] = None,
        history: Sequence[dict[str, Any]] = (),
    ) -> None:
        if not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"log_every={log_every!r} must be an integer >= 1")
        for s in sinks:
            if not (callable(getattr(s, "write", None)) and callable(getattr(s, "close", None))):
                raise TypeError(f"sink {s!r} must have write(records) and close() methods")
        self.amp = amp
        self.sinks = list(sinks)
        self.log_every = log_every
        self.samples_per_step = samples_per_step
        self.tokens_per_step = tokens_per_step
        self._optimizer = optimizer
        self.run_id = run_id  # stamped on every record, so a reused log file keeps runs apart
        self.context = (
            context  # host-side fields for each step record, read at the step (e.g. the epoch)
        )
        self.records: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        # a resumed run's records before this monitor (its log's): the summary covers the run
        self.history = [r for r in history if r.get("kind") != "summary"]
        # (step, wall time, loss, scale, found_inf, grad norm, lr, precision, context, timer): the timer last
        self._pending: list[
            tuple[int, float, Any, Any, Any, Any, Optional[float], str, Any, Any]
        ] = []
        self._switched: tuple[int, str] = (-1, "")  # (step, precision before) of the last switch
        self._pending_events: list[dict[str, Any]] = []
        self._cuda = amp.device.type == "cuda"
        self._last_time = time.perf_counter()
        self._event_pool: list[Any] = []
        self._worker: Optional[threading.Thread] = None
        self._worker_error: Optional[BaseException] = None
        if threaded if threaded is not None else self._cuda:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._work, name="ampkit-monitor", daemon=True)
            self._worker.start()
        self._last_cuda_event = self._cuda_event() if self._cuda else None
        self._closed = False
        self._unsubscribe = amp.subscribe(self._on_event)

    # ------------------------------------------------------------------ observing
    def _cuda_event(self) -> Any:
        e = self._event_pool.pop() if self._event_pool else torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _on_event(self, event: Event) -> None:
        if event.kind != "step":
            if event.kind in ("fallback", "precision_switch") and "from" in event.data:
                self._switched = (
                    event.step,
                    str(event.data["from"]),
                )  # that step ran before the switch
            self._pending_events.append(self._event_record(event.kind, event.step, event.data))
            return
        now = time.perf_counter()
        result = event.data["result"]
        timer: Any = self._cuda_event() if self._cuda else now - self._last_time
        self._last_time = now
        ran_in = self._switched[1] if self._switched[0] == event.step else self.amp.precision.name
        self._pending.append(
            (
                event.step,
                time.time(),
                event.data["loss"],
                result.scale,
                result.found_inf,
                result.grad_norm,
                self._lr(),
                ran_in,
                self.context() if self.context else None,
                timer,
            )
        )
        # read on the run's own steps (a resumed run reads, and so diagnoses, where an uninterrupted one does)
        if event.step % self.log_every == 0 or len(self._pending) >= self.log_every:
            self.flush(wait=False)

    def _lr(self) -> Optional[float]:
        opt = self._optimizer
        if opt is None:
            opts = self.amp.optimizers
            opt = self._optimizer = opts[0] if opts else None
        if opt is None:
            return None
        lr = opt.param_groups[0].get("lr")
        return float(lr) if isinstance(lr, (int, float)) else None

    def log_event(self, kind: str, **data: Any) -> None:
        """Record an event (``checkpoint``, ``eval``, ...) at the current step; written at the next flush."""
        self._pending_events.append(self._event_record(kind, self.amp.optimizer_steps, data))

    def _event_record(self, kind: str, step: int, data: dict[str, Any]) -> dict[str, Any]:
        rec = {
            "schema_version": SCHEMA_VERSION,
            "type": "event",
            "kind": kind,
            "step": step,
            "time": time.time(),
            **_plain(data),
        }
        if self.run_id is not None:
            rec["run_id"] = self.run_id
        return rec

    # ------------------------------------------------------------------ reading
    def flush(self, wait: bool = True) -> list[dict[str, Any]]:
        """Read pending steps to the host and write them and pending events to the sinks.

        On CPU the batch is read and written at once. On CUDA the values are copied to pinned
        host memory without blocking and handed to a writer thread, which waits for the copy,
        builds the records and writes the sinks while training goes on — the training thread
        never waits for the device or pays for serialization. ``wait=True`` (the default, used
        by :meth:`summary` and :meth:`close`) returns once everything pending is written.
        Returns the records written by this call (always empty when a writer thread is used).
        """
        launched = None
        if self._pending:
            pending, self._pending = self._pending, []
            launched = self._launch(pending)
        events, self._pending_events = self._pending_events, []
        if self._worker is not None:
            self._raise_worker_error()
            if launched is not None or events:
                self._queue.put((launched, events))
            if wait:
                done = threading.Event()
                self._queue.put(done)
                done.wait()
                self._raise_worker_error()
            return []
        return self._write(self._process(launched) if launched is not None else [], events)

    def _write(
        self, out: list[dict[str, Any]], events: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        self.records.extend(r for r in out if r["type"] == "step")
        batch = sorted(out + events, key=lambda r: (r["step"], r["type"] != "step"))
        self.events.extend(r for r in batch if r["type"] == "event")
        if batch:
            for sink in self.sinks:
                sink.write(batch)
        return batch

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                launched, events = item
                self._write(self._process(launched) if launched is not None else [], events)
            except BaseException as e:  # surfaced on the training thread at the next flush
                self._worker_error = e

    def _raise_worker_error(self) -> None:
        if self._worker_error is not None:
            err, self._worker_error = self._worker_error, None
            raise RuntimeError(f"the monitor's writer thread failed: {err!r}") from err

    def _launch(self, pending: list[Any]) -> tuple[list[Any], torch.Tensor, Any, Optional[float]]:
        """Stack the batch's device scalars and start their copy to the host (no wait on CUDA)."""
        dev = self.amp.device
        nan = torch.full((), math.nan, device=dev)
        scaled = self.amp.precision.needs_scaler
        live_scale = self.amp.scaler.scale_tensor if scaled else None
        flat: list[torch.Tensor] = []
        # the scale of the precision each step ran in (one since a fallback: still read)
        scaling = {name: precision_row(name).needs_scaler for name in {p[7] for p in pending}}
        for _, _, loss, scale, found, norm, _, ran_in, *_ in pending:
            flat += [
                loss if loss is not None else nan,
                scale if scale is not None and scaling[ran_in] else nan,
                found if found is not None else nan,
                norm if norm is not None else nan,
            ]
        growth = self.amp.scaler.growth_tracker if scaled else None
        flat += [
            live_scale if live_scale is not None else nan,
            growth if growth is not None else nan,
        ]
        flat = [
            t if (t.dtype is torch.float32 and t.dim() == 0) else t.detach().float().reshape(())
            for t in flat
        ]
        stacked = torch.stack(flat)
        done = None
        if self._cuda:
            stacked = stacked.to("cpu", non_blocking=True)  # lands in pinned memory, asynchronously
            done = torch.cuda.Event()
            done.record()
        return pending, stacked, done, float(peak_memory_bytes(dev))

    def _process(
        self, launched: tuple[list[Any], torch.Tensor, Any, Optional[float]]
    ) -> list[dict[str, Any]]:
        pending, stacked, done, peak = launched
        if done is not None and not done.query():
            done.synchronize()  # recorded an interval ago, so this rarely waits
        values = stacked.tolist()  # on CPU: the one read of this interval
        step_ms = self._step_times(pending)
        out: list[dict[str, Any]] = []
        for i, (step, wall, *_rest) in enumerate(pending):
            loss, scale, found, norm = values[4 * i : 4 * i + 4]
            ms = step_ms[i]
            rec: dict[str, Any] = {
                "schema_version": SCHEMA_VERSION,
                "type": "step",
                "step": step,
                "time": wall,
                "loss": _num(loss),
                "precision": pending[i][7],
                "scale": _num(scale),
                "skipped": bool(found > 0) if not math.isnan(found) else False,
                "grad_norm": _num(norm),
                "lr": pending[i][6],
                "step_time_ms": ms,
                "peak_mem_bytes": int(peak) if peak is not None else None,
            }
            if self.run_id is not None:
                rec["run_id"] = self.run_id
            if pending[i][8]:
                rec.update(pending[i][8])
            if self.samples_per_step and ms:
                rec["samples_per_s"] = self.samples_per_step / (ms / 1e3)
            if self.tokens_per_step and ms:
                rec["tokens_per_s"] = self.tokens_per_step / (ms / 1e3)
            out.append(rec)
            if i == len(pending) - 1 and not math.isnan(
                values[-1]
            ):  # the scaler's state after the interval
                rec["growth_tracker"] = int(values[-1])
            if rec["skipped"]:
                after = values[4 * (i + 1) + 1] if i + 1 < len(pending) else values[-2]
                out.append(
                    self._event_record(
                        "overflow", step, {"scale_before": _num(scale), "scale_after": _num(after)}
                    )
                    | {"time": wall}
                )
        return out

    def _step_times(self, pending: list[Any]) -> list[Optional[float]]:
        if not self._cuda:
            return [t * 1e3 for *_, t in pending]
        times: list[Optional[float]] = []
        prev = self._last_cuda_event
        for *_, ev in pending:
            times.append(prev.elapsed_time(ev) if prev is not None else None)
            if prev is not None:
                self._event_pool.append(prev)
            prev = ev
        self._last_cuda_event = prev
        return times

    # ------------------------------------------------------------------ ending
    def summary(self) -> dict[str, Any]:
        """Summary of everything recorded so far (flushes first): see :func:`ampkit.observe.monitor.summarize`;
        plus ``memory_saved_bytes_predicted`` (:func:`~ampkit.observe.monitor.summary.state_memory_saved`)."""
        self.flush()
        return self._summarize()

    def _summarize(self) -> dict[str, Any]:
        steps = [r for r in self.history if r.get("type") == "step"] + self.records
        events = [r for r in self.history if r.get("type") == "event"] + self.events
        rung = Rung.of(self.amp.config) if self.amp.precision.row.has_ladder else None
        return {
            **summarize(steps, events),
            # the precision that runs now, with its ladder rung (as the run directory names it)
            "precision_spec": join_spec(
                self.amp.precision.name, None if not rung or rung.plain else rung
            ),
            "memory_saved_bytes_predicted": state_memory_saved(self.amp),
        }

    def close(self) -> dict[str, Any]:
        """Flush, write a ``summary`` event, close the sinks and unsubscribe. Returns the summary."""
        if self._closed:
            return self._summarize()
        summary = self.summary()
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        record = self._event_record("summary", self.amp.optimizer_steps, summary)
        self.events.append(record)
        for sink in self.sinks:
            sink.write([record])
            sink.close()
        self._unsubscribe()
        self._closed = True
        return summary

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _num(x: float) -> Optional[float]:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    """JSON-safe copy of event details (tensors become numbers, objects their repr)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else v.tolist()
        elif isinstance(v, dict):
            v = _plain(v)
        elif not isinstance(v, (str, int, float, bool, list, tuple, type(None))):
            v = repr(v)
        out[k] = v
    return out
