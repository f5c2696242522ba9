import io
import json
import math
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision
from ampkit.observe.monitor import (
    SCHEMA_VERSION,
    ConsoleSink,
    JSONLSink,
    Monitor,
    TensorBoardSink,
    read_jsonl,
    summarize,
)

from ..support.helpers import SyncCounter


def setup(precision="fp16", fused=True, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    amp = MixedPrecision(precision, device="cpu", **kw)
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def train(model, opt, amp, n, bad=(), accum=1):
    g = torch.Generator().manual_seed(1)
    losses = []
    for i in range(n * accum):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        if i // accum in bad:
            loss = loss * math.inf
        losses.append(loss.detach().clone())
        amp.backward(loss)
        amp.step(opt)
    return losses


def test_one_record_per_step_with_fields():
    model, opt, amp = setup("fp16", accumulation_steps=2)
    mon = Monitor(amp, log_every=4, samples_per_step=16, tokens_per_step=None)
    losses = train(model, opt, amp, 10, accum=2)
    mon.flush()
    assert [r["step"] for r in mon.records] == list(range(1, 11))
    r = mon.records[3]
    for key in (
        "schema_version",
        "type",
        "step",
        "time",
        "loss",
        "precision",
        "scale",
        "skipped",
        "grad_norm",
        "lr",
        "step_time_ms",
        "peak_mem_bytes",
        "samples_per_s",
    ):
        assert key in r
    assert r["schema_version"] == SCHEMA_VERSION and r["precision"] == "fp16" and r["lr"] == 1e-3
    # the recorded loss is the window's mean loss
    for i, rec in enumerate(mon.records):
        expected = (losses[2 * i] + losses[2 * i + 1]).item() / 2
        assert rec["loss"] == pytest.approx(expected, rel=1e-6)
    assert r["scale"] == 65536.0 or r["skipped"] or r["scale"] < 65536.0
    assert r["samples_per_s"] == pytest.approx(16 / (r["step_time_ms"] / 1e3))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_no_per_step_sync_reads_in_batches(precision, monkeypatch):
    """The monitor reads nothing per step: it reads its window in one batch. The step itself is put
    on its device path (what runs on a GPU): on the CPU a bf16 step decides its skip on the host
    by design (the clipped norm, or one C call: step/gradcheck.py), which is not the monitor's read."""
    import ampkit.step.boundary as boundary_module
    import ampkit.step.scaler as scaler_module

    monkeypatch.setattr(scaler_module, "cpu_all_finite", lambda *a, **k: None)
    monkeypatch.setattr(boundary_module, "cpu_norm_finite", lambda *a, **k: None)
    model, opt, amp = setup(precision, clip_grad_norm=1.0)
    mon = Monitor(amp, log_every=5)
    g = torch.Generator().manual_seed(0)
    counts, materialized = [], []
    for _ in range(20):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with SyncCounter() as c:
            with amp.autocast():
                loss = F.cross_entropy(model(x), y)
            amp.backward(loss)
            amp.step(opt)
        counts.append(c.count)
        materialized.append(len(mon.records))
    assert counts == [0] * 20  # no .item() anywhere; the batch read is one tolist()
    assert materialized == [0, 0, 0, 0, 5, 5, 5, 5, 5, 10, 10, 10, 10, 10, 15, 15, 15, 15, 15, 20]


@pytest.mark.cuda
def test_no_per_step_sync_cuda():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    amp = MixedPrecision("fp16", device="cuda", clip_grad_norm=1.0)
    model, opt = amp.setup(model, opt)
    mon = Monitor(amp, log_every=4, samples_per_step=8)
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
    for i in range(12):
        if i >= 4:
            torch.cuda.set_sync_debug_mode(
                "error"
            )  # any stream/device sync raises, flush steps included
        try:
            with amp.autocast():
                loss = F.cross_entropy(model(x), y)
            amp.backward(loss)
            amp.step(opt)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    mon.flush()  # the writer thread builds records in the background; flush() waits for it
    assert len(mon.records) == 12 and [r["step"] for r in mon.records] == list(range(1, 13))
    assert all(r["step_time_ms"] and r["step_time_ms"] > 0 for r in mon.records[1:])
    assert all(r["loss"] > 0 for r in mon.records)


def test_overflow_events_with_scale_before_after():
    model, opt, amp = setup("fp16", init_scale=1024.0)
    mon = Monitor(amp, log_every=3)
    train(model, opt, amp, 9, bad={2, 5})
    mon.flush()
    ov = [e for e in mon.events if e["kind"] == "overflow"]
    assert [e["step"] for e in ov] == [3, 6]
    assert ov[0]["scale_before"] == 1024.0 and ov[0]["scale_after"] == 512.0
    assert ov[1]["scale_before"] == 512.0 and ov[1]["scale_after"] == 256.0
    assert [r["skipped"] for r in mon.records] == [
        False,
        False,
        True,
        False,
        False,
        True,
        False,
        False,
        False,
    ]
    s = mon.summary()
    assert s["skipped_steps"] == 2 and s["overflow_rate"] == pytest.approx(2 / 9)
    assert (s["scale_min"], s["scale_max"], s["scale_last"]) == (256.0, 1024.0, 256.0)
    assert s["scale_changes"] == 2 and s["events"]["overflow"] == 2

    # the interval's last record carries the scaler's growth tracker (finite steps since the last overflow)
    assert [r.get("growth_tracker") for r in mon.records] == [
        None,
        None,
        0,
        None,
        None,
        0,
        None,
        None,
        3,
    ]


def test_growth_tracker_counts_up_to_the_interval_then_the_scale_grows():
    model, opt, amp = setup("fp16", init_scale=256.0, growth_interval=4)
    mon = Monitor(amp, log_every=3)
    train(model, opt, amp, 6)
    mon.flush()
    assert [r.get("growth_tracker") for r in mon.records] == [None, None, 3, None, None, 2]
    assert [r["scale"] for r in mon.records] == [256.0] * 4 + [512.0] * 2


def test_switch_and_user_events_pass_through():
    model, opt, amp = setup("fp16")
    mon = Monitor(amp, log_every=2)
    train(model, opt, amp, 2)
    amp.switch("bf16", reason="test")
    mon.log_event("eval", loss=1.25)
    mon.log_event("checkpoint", path="x.pt")
    train(model, opt, amp, 2)
    mon.flush()
    kinds = [e["kind"] for e in mon.events]
    assert kinds == ["precision_switch", "eval", "checkpoint"]
    assert mon.records[-1]["precision"] == "bf16" and mon.records[-1]["scale"] is None


def test_summary_percentiles():
    recs = [
        {
            "type": "step",
            "step": i + 1,
            "precision": "fp32",
            "loss": 1.0,
            "step_time_ms": float(t),
            "skipped": False,
        }
        for i, t in enumerate([100, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    ]
    s = summarize(recs)
    assert s["step_time_ms_median"] == 5.5  # the first (warm-up) step is left out
    assert s["step_time_ms_p90"] == pytest.approx(9.1)


def test_jsonl_schema_append_and_pandas(tmp_path):
    path = tmp_path / "run" / "log.jsonl"
    for _ in range(2):  # a run, then a "resumed" run appending to the same file
        model, opt, amp = setup("fp16")
        mon = Monitor(amp, [JSONLSink(str(path))], log_every=3)
        train(model, opt, amp, 5)
        mon.close()
    recs = read_jsonl(str(path))
    steps = [r for r in recs if r["type"] == "step"]
    assert len(steps) == 10 and all(r["schema_version"] == SCHEMA_VERSION for r in recs)
    assert sum(1 for r in recs if r.get("kind") == "summary") == 2
    pd = pytest.importorskip("pandas")
    df = pd.read_json(str(path), lines=True)
    assert len(df) == len(recs) and "loss" in df.columns


def test_jsonl_truncated_last_line_is_skipped_with_warning(tmp_path):
    path = tmp_path / "log.jsonl"
    model, opt, amp = setup("fp32")
    mon = Monitor(amp, [JSONLSink(str(path))], log_every=2)
    train(model, opt, amp, 4)
    mon.flush()
    with open(path, "a") as f:
        f.write('{"schema_version": 1, "type": "step", "st')  # crash mid-write
    with pytest.warns(UserWarning, match="truncated last line"):
        recs = read_jsonl(str(path))
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    # a resumed run appends on a fresh line; the partial line in the middle is skipped
    mon2 = Monitor(amp, [JSONLSink(str(path))], log_every=1)
    train(model, opt, amp, 1)
    mon2.flush()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        recs = read_jsonl(str(path))
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and w


def test_jsonl_nonfinite_values_become_null(tmp_path):
    sink = JSONLSink(str(tmp_path / "l.jsonl"))
    sink.write([{"type": "step", "step": 1, "loss": math.nan}])
    sink.close()
    rec = json.loads((tmp_path / "l.jsonl").read_text())
    assert rec["loss"] is None and rec["nonfinite"] == ["loss"]


def test_tensorboard_roundtrip(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, opt, amp = setup("fp16", init_scale=256.0, clip_grad_norm=1.0)
    mon = Monitor(amp, [TensorBoardSink(str(tmp_path))], log_every=4)
    train(model, opt, amp, 8, bad={3})
    mon.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in (
        "train/loss",
        "train/scale",
        "train/grad_norm",
        "train/step_time_ms",
        "train/skipped",
    ):
        assert tag in tags
    losses = acc.Scalars("train/loss")
    # step 4's loss is inf: non-finite values are left out of TensorBoard (they wreck its plots)
    assert [e.step for e in losses] == [1, 2, 3, 5, 6, 7, 8]
    for e, r in zip(losses, [r for r in mon.records if r["step"] != 4]):
        assert e.value == pytest.approx(r["loss"], rel=1e-6)
    assert [e.value for e in acc.Scalars("train/skipped")] == [0, 0, 0, 1, 0, 0, 0, 0]


def test_tensorboard_missing_names_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match=r"ampkit\[tensorboard\]"):
        TensorBoardSink("/tmp/x")


def test_console_sink_shows_progress_and_summary():
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    model, opt, amp = setup("fp16")
    mon = Monitor(
        amp, [ConsoleSink(total_steps=6, console=console)], log_every=3, samples_per_step=8
    )
    train(model, opt, amp, 6)
    mon.close()
    out = buf.getvalue()
    assert "loss" in out and "run summary" in out and "skipped steps" in out


def test_bad_arguments():
    _, _, amp = setup("fp32")
    with pytest.raises(ValueError, match="log_every"):
        Monitor(amp, log_every=0)
    with pytest.raises(TypeError, match="write"):
        Monitor(amp, [object()])


def test_close_unsubscribes():
    model, opt, amp = setup("fp32")
    mon = Monitor(amp, log_every=1)
    train(model, opt, amp, 2)
    mon.close()
    train(model, opt, amp, 2)
    assert len(mon.records) == 2


def test_threaded_writer_gives_the_same_records(tmp_path):
    logs = {}
    for threaded in (False, True):
        model, opt, amp = setup("fp16", init_scale=256.0)
        mon = Monitor(
            amp, [JSONLSink(str(tmp_path / f"{threaded}.jsonl"))], log_every=3, threaded=threaded
        )
        train(model, opt, amp, 10, bad={4})
        amp.record_event("checkpoint", path="x")
        mon.close()
        logs[threaded] = [
            {
                k: v
                for k, v in r.items()
                if k not in ("time", "step_time_ms", "samples_per_s", "peak_mem_bytes")
            }
            for r in read_jsonl(str(tmp_path / f"{threaded}.jsonl"))
            if r["type"] == "step" or r["kind"] in ("overflow", "checkpoint")
        ]
    assert logs[True] == logs[False]
    assert [r.get("kind") for r in logs[True] if r["type"] == "event"] == ["overflow", "checkpoint"]


def test_threaded_writer_errors_surface():
    class Broken:
        def write(self, records):
            raise OSError("disk full")

        def close(self):
            pass

    model, opt, amp = setup("fp32")
    mon = Monitor(amp, [Broken()], log_every=2, threaded=True)
    with pytest.raises(RuntimeError, match="disk full"):
        train(model, opt, amp, 6)
        mon.flush()


@pytest.mark.parametrize(
    "spec, saved_per_param",
    [
        ("fp32", 0),
        ("bf16", 0),  # autocast: its saving is in the activations
        ("bf16-pure", -2),  # 2 + 4 (fp32 grads on the masters) + 4 (masters) + 8 = 18 vs 16
        ("bf16-pure:split", 2),  # 2 + 2 (bf16 grads) + 2 (remainders) + 8 = 14
        ("bf16-pure:stochastic", 4),  # 2 + 2 + 0 + 8 = 12
        ("bf16-pure:stochastic+bf16", 8),  # 2 + 2 + 0 + 4 = 8
    ],
)
def test_the_predicted_state_saving_counts_the_rung(spec, saved_per_param):
    """The run summary's "state memory saved vs fp32 (predicted)" counts what each precision keeps
    (it read 0 MiB for bf16-pure:stochastic+bf16, which keeps half of fp32's bytes)."""
    from ampkit.observe.monitor.summary import state_memory_saved

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    n = sum(p.numel() for p in model.parameters())
    amp = MixedPrecision(spec)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), fused=True))
    with amp.autocast():
        amp.backward(model(torch.randn(4, 64)).float().pow(2).mean())
    amp.step(opt)
    saved = state_memory_saved(amp)
    # the ladder's stand-ins share one scalar (4 bytes): within 16 bytes of the per-parameter count
    assert abs(saved - saved_per_param * n) <= 16


def test_a_full_disk_names_the_log_file(tmp_path, monkeypatch):
    """ENOSPC while appending to the log reaches the user with the file's name (the CLI prints
    ``strerror: 'filename'``), not a bare "No space left on device" (issue 34 §4)."""
    import errno

    path = str(tmp_path / "log.jsonl")
    sink = JSONLSink(path)
    sink.write([{"step": 1}])

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sink._fh, "flush", full)
    with pytest.raises(OSError) as e:
        sink.write([{"step": 2}])
    assert e.value.errno == errno.ENOSPC and e.value.filename == path
    assert "No space left on device" in e.value.strerror and "free space" in e.value.strerror
    monkeypatch.undo()
    sink.close()


def _log_lines(steps, tail: bytes = b"") -> bytes:
    out = b""
    for s in steps:
        out += json.dumps({"type": "step", "step": s, "loss": 1.0}).encode() + b"\n"
    return out + tail


def test_jsonl_sink_after_step_cuts_only_the_redone_tail(tmp_path):
    """A resumed run's log (issue 34 §2): records after the checkpoint's step, at the log's end,
    are cut; a crash's partial last line with them; a damaged line inside stops the cut (it is
    not a redone record); nothing before it changes, byte for byte."""
    from ampkit.observe.monitor.sinks import log_cut

    p = tmp_path / "log.jsonl"
    head = _log_lines([1, 2, 3])
    p.write_bytes(head + _log_lines([4, 5], tail=b'{"type": "step", "st'))
    sink = JSONLSink(str(p), after_step=3)
    sink.close()
    assert p.read_bytes() == head and (sink.dropped, sink.redone) == (2, [4, 5])
    assert log_cut(str(p))[1] == len(head)
    # nothing after the step: nothing cut, the file unchanged
    sink = JSONLSink(str(p), after_step=3)
    sink.close()
    assert p.read_bytes() == head and (sink.dropped, sink.redone) == (0, None)
    # a damaged line inside the log: the cut stops there
    damaged = _log_lines([1]) + b"garbage\n" + _log_lines([2, 3])
    p.write_bytes(damaged)
    sink = JSONLSink(str(p), after_step=1)
    sink.close()
    assert p.read_bytes() == _log_lines([1]) + b"garbage\n" and sink.redone == [2, 3]
    # after_step=None (a fresh run) never cuts
    p.write_bytes(head)
    JSONLSink(str(p)).close()
    assert p.read_bytes() == head


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_an_iteration_of_two_optimizer_steps_is_one_record(tmp_path, precision):
    """A GAN-style loop (``step(optD, update_scale=False)`` then ``step(optG)``) is one optimizer
    step per iteration for the engine (``optimizer_steps``, ``stats()``); the monitor logs one step
    record per iteration too, numbered as the engine counts, skipped when the iteration's scale
    update saw an overflow (D's here, at iteration 2), its loss the iteration's last step's."""
    torch.manual_seed(0)
    d, g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
    opt_d = torch.optim.SGD(d.parameters(), lr=0.01)
    opt_g = torch.optim.SGD(g.parameters(), lr=0.01)
    amp = MixedPrecision(precision, device="cpu", fallback=False)
    _, opt_d, opt_g = amp.setup(torch.nn.ModuleList([d, g]), opt_d, opt_g)
    path = tmp_path / "log.jsonl"
    mon = Monitor(amp, [JSONLSink(str(path))], log_every=1)
    g_losses = []
    for it in range(1, 4):
        x = torch.randn(8, 4)
        opt_d.zero_grad()  # (G's backward through D left gradients there, as in DCGAN's loop)
        with amp.autocast():
            loss_d = d(x).float().square().mean() * (float("inf") if it == 2 else 1.0)
        amp.backward(loss_d)
        amp.step(opt_d, update_scale=False)
        with amp.autocast():
            loss_g = -d(g(x)).float().mean()
        amp.backward(loss_g)
        amp.step(opt_g)
        g_losses.append(loss_g.item())
    summary = mon.close()
    steps = [r for r in read_jsonl(str(path)) if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3] == list(range(1, amp.optimizer_steps + 1))
    assert [r["loss"] for r in steps] == pytest.approx(g_losses)
    assert [r["skipped"] for r in steps] == [False, True, False]
    assert summary["steps"] == 3 == amp.stats()["optimizer_steps"]


def test_the_scales_of_steps_before_a_fallback_survive_it():
    """A fallback fp16 -> bf16 between two reads of the monitor (log_every 50) keeps the fp16
    steps' loss scales in their records and overflow events (issue 34: the log said null for
    every step since the last read, and the summary's scale figures fell short)."""
    model, opt, amp = setup(
        "fp16", init_scale=2.0**60, fallback=True, fallback_patience=3, fallback_check_every=1
    )
    mon = Monitor(amp, log_every=50)
    train(model, opt, amp, 8)  # the scale overflows fp16's backward until the fallback
    mon.flush()
    steps = [r for r in mon.records if r["type"] == "step"]
    assert any(r["precision"] == "bf16" for r in steps)  # it fell back inside the interval
    fp16 = [r for r in steps if r["precision"] == "fp16"]
    # every fp16 step was skipped: each carried half the scale of the one before
    assert [r["scale"] for r in fp16] == [2.0 ** (60 - i) for i in range(len(fp16))]
    overflows = [r for r in mon.events if r.get("kind") == "overflow"]
    assert [o["scale_before"] for o in overflows] == [r["scale"] for r in fp16]
    assert all(r["scale"] is None for r in steps if r["precision"] == "bf16")
    assert mon.summary()["scale_min"] == fp16[-1]["scale"]


def test_the_summary_names_the_ladder_rung():
    """``precision_spec`` says the rung of bf16-pure's ladder (summary.json, the summary event),
    as the run directory and ``--json`` do; the precision alone otherwise."""
    model, opt, amp = setup("bf16-pure", masters="stochastic", state_dtype="bf16")
    mon = Monitor(amp, log_every=1)
    train(model, opt, amp, 2)
    s = mon.close()
    assert s["precision"] == "bf16-pure" and s["precision_spec"] == "bf16-pure:stochastic+bf16"
    model, opt, amp = setup("bf16")
    mon = Monitor(amp, log_every=1)
    train(model, opt, amp, 1)
    assert mon.close()["precision_spec"] == "bf16"
