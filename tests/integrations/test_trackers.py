"""MLflow and W&B sinks receive what the JSONL log gets, step for step (file store / offline run):
beside a Monitor's JSONLSink, as a Trainer's ``LogConfig(sinks=...)``, and from ``ampkit train``."""

import json

import pytest
import torch

from ampkit import JSONLSink, LogConfig, MixedPrecision, Monitor, Trainer, read_jsonl
from ampkit.observe.monitor import MLflowSink, WandbSink, trackers
from ampkit.observe.monitor.sinks import finite_json
from ampkit.observe.monitor.trackers import metrics_of
from tests.support.unstable_model import Unstable, data


def train(sink, tmp_path, steps=12):
    """fp16 from a too-large scale on a model that overflows: skipped steps, overflow events."""
    torch.manual_seed(0)
    model = Unstable(gain=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("fp16", device="cpu", init_scale=2.0**24)
    amp.setup(model, opt)
    log = str(tmp_path / "log.jsonl")
    with Monitor(amp, [JSONLSink(log), sink], log_every=5, samples_per_step=32) as monitor:
        for x, y in data(steps):
            with amp.autocast():
                loss = model(x, y)
            amp.backward(loss)
            amp.step(opt)
        monitor.log_event("checkpoint", path="ckpt.pt")
    records = read_jsonl(log)
    steps_ = [r for r in records if r["type"] == "step"]
    assert (
        len(steps_) == steps
        and any(r["skipped"] for r in steps_)
        and not all(r["skipped"] for r in steps_)
    )
    return steps_, [r for r in records if r["type"] == "event"]


def test_metrics_of_a_record():
    rec = {
        "schema_version": 1,
        "type": "step",
        "step": 3,
        "time": 1.5,
        "loss": 2.0,
        "precision": "fp16",
        "scale": None,
        "skipped": True,
        "grad_norm": float("nan"),
        "lr": 1e-3,
    }
    assert metrics_of(rec) == {"loss": 2.0, "skipped": 1.0, "lr": 1e-3}


@pytest.mark.slow
def test_mlflow_file_store_equals_the_jsonl_log(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    sink = MLflowSink(uri, experiment="test", run_name="fp16", params={"precision": "fp16"})
    steps, events = train(sink, tmp_path)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"precision": "fp16"}
    assert run.data.tags["ampkit.precision"] == "fp16"
    keys = set().union(*(metrics_of(r) for r in steps))
    assert {"loss", "scale", "skipped", "lr", "step_time_ms", "samples_per_s"} <= keys
    for key in keys:
        got = [
            (m.step, m.value)
            for m in sorted(client.get_metric_history(sink.run_id, key), key=lambda m: m.step)
        ]
        want = [(r["step"], metrics_of(r)[key]) for r in steps if key in metrics_of(r)]
        assert got == want, key
    path = client.download_artifacts(sink.run_id, "ampkit/events.jsonl", str(tmp_path / "dl"))
    with open(path) as f:
        logged = [json.loads(line) for line in f]
    assert logged == json.loads(json.dumps(events)) and {"overflow", "checkpoint"} <= {
        e["kind"] for e in logged
    }


def test_mlflow_refuses_a_bad_uri():
    with pytest.raises(ValueError, match="tracking URI"):
        MLflowSink("")


@pytest.mark.slow
def test_wandb_offline_run_equals_the_jsonl_log(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.integrations.wandb_records import read_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("ampkit-test", mode="offline", dir=str(tmp_path))
    steps, events = train(sink, tmp_path)
    history, summary = read_run(str(tmp_path))
    assert [h["_step"] for h in history] == [r["step"] for r in steps]
    for h, r in zip(history, steps):
        assert {k: v for k, v in h.items() if not k.startswith("_")} == {
            **metrics_of(r),
            "precision": r["precision"],
        }
    assert summary["ampkit_events"] == json.loads(json.dumps(events))


def test_wandb_refuses_a_bad_mode():
    pytest.importorskip("wandb")
    with pytest.raises(ValueError, match="online, offline, disabled"):
        WandbSink("p", mode="sometimes")


class Recording:
    """A sink keeping every batch it is given, and whether it was closed."""

    def __init__(self):
        self.batches, self.closed = [], False

    def write(self, records):
        self.batches.append(list(records))

    def close(self):
        self.closed = True


def fit_with(sinks, tmp_path, steps=7):
    """A Trainer run on the unstable fp16 model with ``LogConfig(sinks=sinks)``: its log's records."""
    torch.manual_seed(0)
    model = Unstable(gain=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("fp16", device="cpu", init_scale=2.0**24)
    model, opt = amp.setup(model, opt)
    batches = data(steps)
    trainer = Trainer(
        model,
        opt,
        amp,
        lambda i: batches[i % steps],
        diagnose=False,
        log=LogConfig(
            dir=str(tmp_path / "run"), every=3, progress=False, tensorboard=False, sinks=sinks
        ),
    )
    trainer.fit(steps)
    return read_jsonl(str(tmp_path / "run" / "log.jsonl"))


def test_trainer_hands_its_sinks_the_jsonl_records(tmp_path):
    """``LogConfig(sinks=[...])``: each sink gets the batches log.jsonl gets, in-process, then is closed."""
    sink = Recording()
    logged = fit_with([sink], tmp_path)
    got = [r for batch in sink.batches for r in batch]
    assert [finite_json(r) for r in got] == logged and sink.closed
    assert [r["step"] for r in got if r["type"] == "step"] == list(range(1, 8))
    assert len(sink.batches) >= 3  # in batches of log_every, not one replay at the end
    assert got[-1]["kind"] == "summary"


def test_only_rank_0_writes_to_the_sinks(monkeypatch, tmp_path):
    """Off rank 0 the Trainer's own sinks are closed unused (one process writes, as for log.jsonl)."""
    from ampkit.train import runlog

    sink = Recording()
    log = LogConfig(dir=str(tmp_path), progress=False, sinks=[sink])
    *own, last = runlog.run_sinks(log, 5, [])
    for other in own:
        other.close()  # log.jsonl's
    assert last is sink and not sink.closed
    monkeypatch.setattr(runlog, "is_main", lambda: False)
    assert runlog.run_sinks(log, 5, []) == [] and sink.closed and not sink.batches


def test_log_config_refuses_a_non_sink():
    with pytest.raises(TypeError, match="write.records. and close"):
        LogConfig(sinks=[object()])
    with pytest.raises(TypeError, match="list of sinks"):
        LogConfig(sinks="mlflow")
    assert LogConfig(sinks=[Recording()]).sinks.__class__ is tuple


def test_tracker_sinks_are_public_beside_jsonl():
    import ampkit
    import ampkit.observe.monitor as monitor

    for name in ("MLflowSink", "WandbSink"):
        assert name in ampkit.__all__ and name in monitor.__all__
        assert getattr(ampkit, name) is getattr(monitor, name) is getattr(trackers, name)


def test_trainer_mlflow_sink_equals_its_jsonl(tmp_path, monkeypatch):
    """A Trainer with ``LogConfig(sinks=[MLflowSink(...)])``: the MLflow run is the log, in-process."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.setattr(trackers.JSONLFollower, "poll", _no_replay)
    uri = (tmp_path / "mlruns").as_uri()
    sink = MLflowSink(uri, experiment="test", run_name="trainer")
    records = fit_with([sink], tmp_path)
    steps = [r for r in records if r["type"] == "step"]
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(sink.run_id).info.status == "FINISHED"
    assert_mlflow_metrics(client, sink.run_id, steps)
    path = client.download_artifacts(sink.run_id, "ampkit/events.jsonl", str(tmp_path / "dl"))
    with open(path) as f:
        assert [json.loads(line) for line in f] == [r for r in records if r["type"] == "event"]


@pytest.mark.slow
def test_trainer_wandb_offline_sink_equals_its_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tests.integrations.wandb_records import read_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    records = fit_with([WandbSink("ampkit-test", mode="offline", dir=str(tmp_path))], tmp_path)
    steps = [r for r in records if r["type"] == "step"]
    history, summary = read_run(str(tmp_path))
    assert [h["_step"] for h in history] == [r["step"] for r in steps]
    for h, r in zip(history, steps):
        assert {k: v for k, v in h.items() if not k.startswith("_")} == {
            **metrics_of(r),
            "precision": r["precision"],
        }
    assert summary["ampkit_events"] == [r for r in records if r["type"] == "event"]


def _no_replay(self, *args, **kwargs):
    raise AssertionError("the run's log.jsonl was re-read: trackers must be fed in-process")


def assert_mlflow_metrics(client, run_id, steps):
    """Every metric of every step record is in the MLflow run at its step, and nothing else."""
    keys = set().union(*(metrics_of(r) for r in steps))
    assert {"loss", "scale", "skipped", "lr"} <= keys
    for key in keys:
        got = [
            (m.step, m.value)
            for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        ]
        assert got == [(r["step"], metrics_of(r)[key]) for r in steps if key in metrics_of(r)], key


def test_ampkit_train_mlflow_equals_its_log(tmp_path, monkeypatch):
    """``ampkit train --mlflow URI``: the run's MLflow metrics are its log.jsonl, step for step,
    handed to the Trainer's monitor in-process (the log is never re-read for it)."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    from ampkit.cli import main

    monkeypatch.setattr(trackers.JSONLFollower, "poll", _no_replay)
    monkeypatch.setattr(trackers.JSONLFollower, "__init__", _no_replay)
    uri, run = (tmp_path / "mlruns").as_uri(), tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--model",
                "mlp",
                "--size",
                "tiny",
                "--steps",
                "7",
                "--precision",
                "fp16",
                "--device",
                "cpu",
                "--log_dir",
                str(run),
                "--log_every",
                "3",
                "--no_progress",
                "--mlflow",
                uri,
            ]
        )
        == 0
    )
    steps = [r for r in read_jsonl(str(run / "log.jsonl")) if r["type"] == "step"]
    client = MlflowClient(tracking_uri=uri)
    [found] = client.search_runs([client.get_experiment_by_name("ampkit").experiment_id])
    assert found.info.run_name == "run" and found.data.params["precision"] == "fp16"
    assert found.info.status == "FINISHED" and found.data.tags["ampkit.precision"] == "fp16"
    assert_mlflow_metrics(client, found.info.run_id, steps)
    assert len(steps) == 7
    path = client.download_artifacts(found.info.run_id, "ampkit/events.jsonl", str(tmp_path / "dl"))
    with open(path) as f:
        events = [json.loads(line) for line in f]
    assert events == [r for r in read_jsonl(str(run / "log.jsonl")) if r["type"] == "event"]
    assert events[-1]["kind"] == "summary"


@pytest.mark.slow
def test_ampkit_train_wandb_offline_equals_its_log(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from ampkit.cli import main
    from tests.integrations.wandb_records import read_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--model",
                "mlp",
                "--size",
                "tiny",
                "--steps",
                "5",
                "--precision",
                "bf16",
                "--device",
                "cpu",
                "--log_dir",
                str(run),
                "--log_every",
                "2",
                "--no_progress",
                "--wandb",
                "ampkit-test",
            ]
        )
        == 0
    )
    steps = [r for r in read_jsonl(str(run / "log.jsonl")) if r["type"] == "step"]
    history, summary = read_run(str(run))
    assert [h["_step"] for h in history] == [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    for h, r in zip(history, steps):
        assert {k: v for k, v in h.items() if not k.startswith("_")} == {
            **metrics_of(r),
            "precision": "bf16",
        }
    assert [e["kind"] for e in summary["ampkit_events"]][-1] == "summary"
