"""Experiment trackers as Monitor sinks: MLflow and Weights & Biases.

Each receives exactly the records the JSONL log gets, batch by batch, in-process: give them to the
Monitor beside :class:`~ampkit.observe.monitor.JSONLSink`, or to a Trainer as
``LogConfig(sinks=[...])`` (what ``ampkit train --mlflow/--wandb`` does). a step record's numbers
become metrics at its ``step`` (``skipped`` as 0/1; non-finite values, written ``null`` in the
JSONL, are left out, as TensorBoard's sink does), its ``precision`` a tag / config value, and
events (fallbacks, overflows, checkpoints, the summary) a JSONL artifact (MLflow) or the run
summary (W&B). Both work without a server: ``file://`` tracking URIs for MLflow,
``mode="offline"`` (or ``WANDB_MODE=offline``) for W&B.

Install with ``pip install "ampkit[mlflow]"`` (mlflow-skinny) / ``"ampkit[wandb]"``.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from typing import Any, Optional

from .sinks import finite_json, log_cut

__all__ = ["JSONLFollower", "MLflowSink", "WandbSink", "metrics_of"]

#: fields of a step record that are not metrics
_NOT_METRICS = ("schema_version", "type", "step", "time", "precision", "run_id", "kind")


def _require(module: str, extra: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:  # an optional extra
        raise ImportError(f'{what} needs the {extra} package: pip install "ampkit[{extra}]"') from e


def metrics_of(record: dict[str, Any]) -> dict[str, float]:
    """The metrics of one step record: its finite numbers, ``skipped`` as 0.0/1.0."""
    out: dict[str, float] = {}
    for key, v in record.items():
        if key in _NOT_METRICS:
            continue
        if isinstance(v, (int, float)) and math.isfinite(
            v
        ):  # (a bool is an int: skipped -> 0.0/1.0)
            out[key] = float(v)
    return out


def _event_details(record: dict[str, Any]) -> dict[str, Any]:
    """The event as ``log.jsonl`` holds it: plain JSON (tensors, paths -> text; inf/NaN -> null)."""
    return json.loads(json.dumps(finite_json(record), default=str, allow_nan=False))


class MLflowSink:
    """Log to an MLflow run: ``MLflowSink("file:///tmp/mlruns")`` (or an ``http(s)://`` server).

    Args:
        tracking_uri: where MLflow stores runs. A ``file:`` URI or a plain path is MLflow's file
            store, which MLflow 3 keeps behind ``MLFLOW_ALLOW_FILE_STORE=true``; this sink sets that
            (unless already set) since asking for a file store is the opt-in.
        experiment: the experiment's name (created when missing).
        run_name: the new run's name; ``run_id``: continue an existing run instead (a resume).
        params: logged once as the run's parameters (e.g. the engine's config).

    ``run_id`` is the run written to. Events are appended to the artifact ``ampkit/events.jsonl``.
    """

    def __init__(
        self,
        tracking_uri: str,
        *,
        experiment: str = "ampkit",
        run_name: Optional[str] = None,
        run_id: Optional[str] = None,
        params: Optional[dict[str, Any]] = None,
    ) -> None:
        if not isinstance(tracking_uri, str) or not tracking_uri:
            raise ValueError(
                f"tracking_uri={tracking_uri!r} must be an MLflow tracking URI, "
                "e.g. file:///tmp/mlruns or http://localhost:5000"
            )
        if "://" not in tracking_uri or tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow = _require("mlflow", "mlflow", "MLflowSink")
        self._entities = _require("mlflow.entities", "mlflow", "MLflowSink")
        self.tracking_uri = tracking_uri
        self._client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        if run_id is None:
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id if found else self._client.create_experiment(experiment)
            )
            run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        self.run_id: str = run_id
        self._closed = False
        self._events: list[dict[str, Any]] = []
        self._precision: Optional[str] = None
        if params:
            self._client.log_batch(
                run_id, params=[self._entities.Param(k, str(v)[:6000]) for k, v in params.items()]
            )

    def write(self, records: list[dict[str, Any]]) -> None:
        metric = self._entities.Metric
        metrics, now = [], int(time.time() * 1000)
        for r in records:
            if r.get("type") == "step":
                stamp = int(r["time"] * 1000) if isinstance(r.get("time"), (int, float)) else now
                metrics += [metric(k, v, stamp, int(r["step"])) for k, v in metrics_of(r).items()]
                if r.get("precision") and r["precision"] != self._precision:
                    self._precision = r["precision"]
                    self._client.set_tag(self.run_id, "ampkit.precision", self._precision)
            else:
                self._events.append(_event_details(r))
        for i in range(0, len(metrics), 1000):  # MLflow's limit per log_batch call
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        if self._events and any(r.get("type") != "step" for r in records):
            text = "".join(json.dumps(e) + "\n" for e in self._events)
            self._client.log_text(self.run_id, text, "ampkit/events.jsonl")

    def close(self) -> None:
        """Mark the run finished (idempotent)."""
        if not self._closed:
            self._closed = True
            self._client.set_terminated(self.run_id)


class WandbSink:
    """Log to a Weights & Biases run: ``WandbSink("my-project", mode="offline")``.

    Args:
        project: the W&B project.
        run_name, dir, mode (``"online"``, ``"offline"``; default ``WANDB_MODE``), config: passed to
            ``wandb.init``; ``run``: log into a run already started instead (then left open by ``close``).

    Step records are logged with ``run.log(metrics, step=record["step"])``; events are kept in
    the run's summary under ``ampkit_events`` (W&B's step must only grow, and events share a
    step with its record).
    """

    def __init__(
        self,
        project: Optional[str] = None,
        *,
        run_name: Optional[str] = None,
        dir: Optional[str] = None,
        mode: Optional[str] = None,
        config: Optional[dict[str, Any]] = None,
        run: Any = None,
    ) -> None:
        wandb = _require("wandb", "wandb", "WandbSink")
        self._own = run is None  # finish only a run this sink started
        if run is None:
            # Read WANDB_MODE here: wandb reads the environment once per process (its first init).
            mode = mode if mode is not None else os.environ.get("WANDB_MODE") or None
            if mode is not None and mode not in ("online", "offline", "disabled"):
                raise ValueError(
                    f"mode={mode!r} is not a W&B mode; choose one of: online, offline, disabled"
                )
            run = wandb.init(project=project, name=run_name, dir=dir, mode=mode, config=config)
        self.run = run
        self._events: list[dict[str, Any]] = []

    def write(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            if r.get("type") == "step":
                values: dict[str, Any] = dict(metrics_of(r))
                if r.get("precision"):
                    values["precision"] = r["precision"]
                self.run.log(values, step=int(r["step"]))
            else:
                self._events.append(_event_details(r))
        if any(r.get("type") != "step" for r in records):
            self.run.summary["ampkit_events"] = list(self._events)

    def close(self) -> None:
        """Finish the run if this sink started it (idempotent)."""
        if self._own:
            self._own = False
            self.run.finish()


class JSONLFollower:
    """Send a JSONL log's new records to sinks as the log grows, e.g. a log another process writes
    (a run in the same process gives its sinks to the Monitor / ``LogConfig(sinks=...)`` instead).

    A :class:`ampkit.Trainer` callback: ``on_step_end`` forwards the complete lines written since
    the last call (the log grows once per ``log_every`` steps, so most calls only compare a file
    size), ``on_train_end`` forwards the rest (the summary) and closes the sinks. The trackers
    thus receive exactly the log's records, in its batches, without the loop knowing them. Only
    lines written after construction are sent (a resumed run appends to the same log, after
    cutting the records of the steps it redoes: the follower goes on from the cut).
    """

    def __init__(self, path: str, sinks: list[Any]) -> None:
        self.path, self.sinks = path, list(sinks)
        self._offset = os.path.getsize(path) if os.path.exists(path) else 0
        self._cut = log_cut(path)
        self._closed = False

    def poll(self) -> None:
        """Forward the complete lines written since the last call."""
        cut = log_cut(self.path)
        if cut is not self._cut:  # a resumed run in this process cut the log's redone tail
            self._cut = cut
            self._offset = min(self._offset, cut[1]) if cut else self._offset
        if (
            self._closed
            or not os.path.exists(self.path)
            or os.path.getsize(self.path) <= self._offset
        ):
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        if end == 0:
            return
        self._offset += end
        records = [
            json.loads(line) for line in data[:end].decode("utf-8").splitlines() if line.strip()
        ]
        if records:
            for sink in self.sinks:
                sink.write(records)

    def on_step_end(self, trainer: Any, step: int, result: Any) -> None:
        self.poll()

    def on_train_end(self, trainer: Any, summary: Any) -> None:
        self.close()

    def close(self) -> None:
        """Forward what is left and close the sinks (idempotent)."""
        if self._closed:
            return
        self.poll()
        self._closed = True
        for sink in self.sinks:
            sink.close()
