"""A resumed run's log reads as the uninterrupted run's (issue 34 §2): the steps after the
checkpoint that an earlier process logged and the resumed one redoes are in ``log.jsonl`` (and
TensorBoard) once, not twice; a ``resumed`` event says where the run went on and what was redone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import builtin
from ampkit.observe.monitor.trackers import JSONLFollower
from ampkit.train.trainer import Trainer


def _trainer(tmp_path: Path, ck: str = "ck", amp=None, **extra) -> Trainer:
    """A Trainer of the tiny MLP (bf16 unless ``amp`` is given); ``extra`` adds or overrides its
    settings (checkpoints every 4 steps, a log record every step)."""
    torch.manual_seed(0)
    model, data = builtin("mlp", "tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = amp or MixedPrecision("bf16", device="cpu")
    model, opt = amp.setup(model, opt)
    settings = {"checkpoint_every": 4, "log_every": 1, **extra}
    return Trainer(
        model,
        opt,
        amp,
        data,
        progress=False,
        checkpoint_dir=str(tmp_path / ck),
        log_dir=str(tmp_path / "log"),
        **settings,
    )


def _records(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "log" / "log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_a_resumed_run_logs_each_step_once(tmp_path):
    first = _trainer(tmp_path)
    first.fit(7)  # checkpoint at 4; steps 5-7 logged, then the process "dies"
    assert [r["step"] for r in _records(tmp_path) if r["type"] == "step"] == list(range(1, 8))
    del first
    again = _trainer(tmp_path)
    assert again.resume().endswith("ckpt-00000004.pt")
    again.fit(6)  # 5..10: 5-7 redone
    recs = _records(tmp_path)
    assert [r["step"] for r in recs if r["type"] == "step"] == list(range(1, 11))
    summaries = [r for r in recs if r.get("kind") == "summary"]
    assert [r["step"] for r in summaries] == [10]  # the dead process's summary at 7 went with it
    (resumed,) = [r for r in recs if r.get("kind") == "resumed"]
    assert resumed["step"] == 4 and resumed["redone_steps"] == [5, 7]
    assert resumed["dropped_records"] == 4  # steps 5, 6, 7 and the summary at 7
    # the records are in step order, the event right where the run went on
    steps = [r["step"] for r in recs]
    assert steps == sorted(steps) and recs.index(resumed) + 1 == steps.index(5)


def test_a_resume_at_the_log_end_drops_nothing_and_a_fresh_run_never_cuts(tmp_path):
    first = _trainer(tmp_path)
    first.fit(4)  # checkpoint at 4, the log ends at 4
    before = _records(tmp_path)
    again = _trainer(tmp_path)
    again.resume()
    again.fit(2)
    recs = _records(tmp_path)
    assert recs[: len(before)] == before
    (resumed,) = [r for r in recs if r.get("kind") == "resumed"]
    assert resumed["dropped_records"] == 0 and resumed["redone_steps"] is None
    # a fresh run (step 0) into the same log dir appends: it never cuts another run's records
    n = len(recs)
    _trainer(tmp_path, ck="other").fit(1)
    assert _records(tmp_path)[:n] == recs


def test_a_follower_made_before_the_resume_forwards_the_resumed_records(tmp_path):
    _trainer(tmp_path).fit(7)

    class Keep:
        def __init__(self):
            self.records = []

        def write(self, records):
            self.records += records

        def close(self):
            pass

    keep = Keep()
    follower = JSONLFollower(str(tmp_path / "log" / "log.jsonl"), [keep])
    again = _trainer(tmp_path, callbacks=[follower])
    again.resume()
    again.fit(3)
    assert [r["step"] for r in keep.records if r["type"] == "step"] == [5, 6, 7]
    assert any(r.get("kind") == "resumed" for r in keep.records)


def test_tensorboard_purges_the_redone_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _trainer(tmp_path, tensorboard=True).fit(7)
    again = _trainer(tmp_path, tensorboard=True)
    again.resume()
    again.fit(6)
    acc = EventAccumulator(str(tmp_path / "log" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 11))


def test_a_resumed_runs_summary_covers_the_whole_run(tmp_path):
    """summary.json (and the summary event) of a resumed run counts the run's steps, skips, scales
    and precisions from its first step, as the uninterrupted run's does (it counted the last
    process's steps alone)."""

    def fp16(path):
        amp = MixedPrecision(
            "fp16",
            device="cpu",
            init_scale=2.0**60,
            fallback=True,
            fallback_patience=3,
            fallback_check_every=2,
        )
        return _trainer(path, amp=amp, checkpoint_every=3, log_every=4)

    whole = fp16(tmp_path / "a")
    whole.fit(12)
    ref = json.loads((tmp_path / "a" / "log" / "summary.json").read_text())
    first = fp16(tmp_path / "b")
    first.fit(7)  # killed after checkpoint 6 (step 7 is redone)
    again = fp16(tmp_path / "b")
    again.resume()
    again.fit(6)
    got = json.loads((tmp_path / "b" / "log" / "summary.json").read_text())
    keys = (
        "steps",
        "first_step",
        "last_step",
        "skipped_steps",
        "overflow_rate",
        "scale_min",
        "scale_max",
        "scale_changes",
        "steps_by_precision",
        "fallbacks",
        "final_loss",
    )
    assert ref["skipped_steps"] > 0 and ref["fallbacks"] == 1
    assert {k: got[k] for k in keys} == {k: ref[k] for k in keys}


def test_a_checkpoint_without_its_data_position_says_the_data_starts_over(tmp_path):
    """A state without ``data`` (written by hand, or by another writer) restarts the data at its
    first batch: said, not silent (recheck43)."""
    first = _trainer(tmp_path)
    first.fit(4)
    state = first.state_dict()
    del state["data"]
    again = _trainer(tmp_path, ck="other")
    with pytest.warns(UserWarning, match="no data position"):
        again.load_state_dict(state, source="a hand-made state")
    assert again.amp.optimizer_steps == 4


def test_resuming_one_run_never_cuts_another_runs_records_from_a_shared_log(tmp_path):
    """Two runs write one log dir (each record carries its run_id): resuming the first cuts only
    its own redone records; the second run's records after it stay (review43)."""
    _trainer(tmp_path, ck="ckA").fit(6)  # run A: checkpoint at 4
    _trainer(tmp_path, ck="ckB").fit(5)  # run B, fresh, into the same log
    before = _records(tmp_path)
    b_id = before[-1]["run_id"]
    b_records = [r for r in before if r.get("run_id") == b_id]
    again = _trainer(tmp_path, ck="ckA")
    again.resume()
    again.fit(2)
    after = _records(tmp_path)
    assert [r for r in after if r.get("run_id") == b_id] == b_records
    (resumed,) = [r for r in after if r.get("kind") == "resumed"]
    assert resumed["dropped_records"] == 0 and resumed["redone_steps"] is None
