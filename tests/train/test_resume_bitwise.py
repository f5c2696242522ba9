"""Stops at every point of a spike-rollback run and of an fp16 fallback run resume bitwise (issue 34).

For each step ``k`` of the run, the run is stopped there and resumed by a fresh Trainer (a new model,
optimizer and engine, built as a new process builds them) to the end; the whole training state --
every parameter and optimizer tensor, the engine's state (scale, counters, fallback, events), the
RNG, the data position -- must equal the uninterrupted run's, bitwise (same machine, same process).

* a SIGKILL is "the process died right after checkpoint k was written": the uninterrupted run
  (``checkpoint_every=1``) keeps a copy of every checkpoint it writes, the rewritten ones after a
  rollback too, and each copy is resumed from its own directory (``Trainer.resume``);
* a graceful stop (SIGTERM/SIGINT) is ``request_stop()`` at step ``k`` -- what the signal handler
  records -- with no checkpoint but the stop's own.

Real signals to real processes: the slow test at the end (a SIGTERM after the spike, a SIGKILL
before the fallback's decision, each resumed by a new process) and ``benchmarks/kill_campaign.py
--points 3 --configs rollback,fp16-fallback``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampkit
from ampkit.loop.checkpoint import load_checkpoint
from ampkit.loop.seed import seed_everything
from ampkit.train.trainer import Trainer, TrainingInterrupted

from .test_rollback import Net, data

STEPS = {"rollback": 12, "fallback": 9}
CORRUPT = (6, 7)  # data indices whose targets are x1000: optimizer steps 7 and 8 (after the warmup)
GUARD = {"every": 3, "warmup": 3, "keep": 3}  # reads at steps 3, 6, 9, ...
FALLBACK = {
    "init_scale": 1e9,
    "fallback_patience": 2,
    "fallback_check_every": 3,
}  # overflows; falls back at 6


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))).float(), y)


def trainer(
    case: str, ckdir: Path, every: int | None, callbacks: tuple = (), **settings: Any
) -> Trainer:
    """A fresh run of ``case``: ``rollback`` (bf16, x1000 spikes at steps 7 and 8: step 9's read
    rolls back to step 6 and drops the first; the replay meets the second, so step 9's read rolls
    back from that snapshot again, which is then suspect: to step 3) or ``fallback`` (fp16 with
    ``init_scale=1e9``: step 3's check reads 3 consecutive overflows, step
    6 acts on that reading and falls back to bf16): stops before, between and after the reads."""
    seed_everything(
        0
    )  # torch, Python, numpy: all checkpointed, so all compared (across processes too)
    if case == "rollback":
        model, amp = Net(), ampkit.MixedPrecision("bf16", device="cpu")
        batches, extra = (
            data(bad=True, corrupt=CORRUPT, nan=()),
            {"spike_rollback": GUARD, "fallback": False},
        )
    else:
        model, amp = Small(), ampkit.MixedPrecision("fp16", device="cpu", **FALLBACK)
        batches, extra = data(bad=False, corrupt=(), nan=()), {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.setup(model, opt)
    extra["scheduler"] = torch.optim.lr_scheduler.StepLR(
        opt, 2, gamma=0.9
    )  # checkpointed and snapshotted too
    # diagnose=False: the first-skip diagnosis is an observation made at the monitor's reads (not state)
    return Trainer(
        model,
        opt,
        amp,
        batches,
        loss_fn=lambda m, b: m(*b),
        callbacks=callbacks,
        checkpoint_dir=str(ckdir),
        checkpoint_every=every,
        keep_last=None,
        progress=False,
        **{"diagnose": False, **settings},
        **extra,
    )


class Keep:
    """Copy every checkpoint the run writes (a process killed right after it leaves exactly that)."""

    def __init__(self, into: Path) -> None:
        self.into, self.copies = into, []

    def on_checkpoint(self, trainer: Trainer, path: str) -> None:
        d = self.into / f"kill{len(self.copies):02d}"
        d.mkdir(parents=True)
        self.copies.append((trainer.amp.optimizer_steps, shutil.copy(path, d)))


class StopAt:
    """``request_stop()`` after step ``k`` (its first occurrence: a rollback runs some steps twice)."""

    def __init__(self, k: int) -> None:
        self.k, self.done = k, False

    def on_step_end(self, trainer: Trainer, step: int, result: Any) -> None:
        if step == self.k and not self.done:
            self.done = True
            trainer.request_stop()


def finish(case: str, ckdir: Path) -> dict[str, Any]:
    """Resume the newest checkpoint of ``ckdir`` in a fresh Trainer and train to the end."""
    t = trainer(case, ckdir, every=None)
    assert t.resume() is not None
    if t.amp.optimizer_steps < STEPS[case]:
        t.fit(STEPS[case] - t.amp.optimizer_steps)
    return t.state_dict()


def differences(a: Any, b: Any, where: str = "state") -> list[str]:
    """Where two training states differ (tensors: dtype, shape and every bit); wall-clock fields and
    the run's id are not training state."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (set(a) | set(b)) - {"seconds", "id"}
        return [
            d
            for k in sorted(keys, key=str)
            for d in differences(a.get(k), b.get(k), f"{where}.{k}")
        ]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


@pytest.fixture(scope="module", params=["rollback", "fallback"])
def run(request, tmp_path_factory):
    """The uninterrupted run (checkpointing every step, every checkpoint kept) and its end state."""
    case, root = request.param, tmp_path_factory.mktemp(request.param)
    keep = Keep(root / "kills")
    t = trainer(case, root / "ck", every=1, callbacks=(keep,))
    t.fit(STEPS[case])
    events = [(e.kind, e.step) for e in t.amp.events]
    if case == "rollback":
        assert [
            (e.step, e.data["offending_step"], e.data["rolled_back_to"])
            for e in t.amp.events
            if e.kind == "spike"
        ] == [(6, 7, 6), (3, 7, 3)]  # (recorded after the restore)
    else:
        assert ("fallback", 6) in events and t.amp.precision.name == "bf16"
    return case, root, keep.copies, t.state_dict()


def test_a_kill_after_any_checkpoint_resumes_bitwise(run):
    case, _, copies, end = run
    assert len(copies) >= STEPS[case]
    bad = {
        f"checkpoint #{i} (step {step})": differences(finish(case, Path(path).parent), end)[:4]
        for i, (step, path) in enumerate(copies)
    }
    assert not {k: v for k, v in bad.items() if v}


def test_a_graceful_stop_at_any_step_resumes_bitwise(run):
    case, root, _, end = run
    bad = {}
    for k in range(1, STEPS[case]):
        ckdir = root / f"stop{k:02d}"
        with pytest.raises(TrainingInterrupted) as stop:
            trainer(case, ckdir, every=None, callbacks=(StopAt(k),)).fit(STEPS[case])
        assert stop.value.checkpoint is not None
        bad[f"stop at step {k} (checkpoint of step {stop.value.step})"] = differences(
            finish(case, ckdir), end
        )[:4]
    assert not {k: v for k, v in bad.items() if v}


def _diagnosed_and_resumed(root: Path) -> tuple[dict[str, Any], list[tuple[int, Any]]]:
    """The fp16 fallback run with the first-skip diagnosis on (the Trainer's default) and the
    monitor reading every 4 steps: the uninterrupted run's end state, and for kills after
    checkpoints 1, 2 and 3 (before the first read) the resumed runs' end states."""
    keep = Keep(root / "kills")
    whole = trainer("fallback", root / "ck", every=1, callbacks=(keep,), diagnose=True, log_every=4)
    whole.fit(STEPS["fallback"])
    resumed = []
    for step, path in keep.copies[:3]:
        t = trainer("fallback", Path(path).parent, every=None, diagnose=True, log_every=4)
        assert t.resume() is not None
        t.fit(STEPS["fallback"] - t.amp.optimizer_steps)
        resumed.append((step, t.state_dict()))
    return whole.state_dict(), resumed


def _without_fallback_diagnosis(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in e.items() if not (e["kind"] == "fallback" and k == "diagnosis")}
        for e in events
    ]


def test_a_stop_before_the_monitor_reads_a_skip_resumes_with_the_same_diagnosis(tmp_path):
    """The fp16 run skips from step 1 but the monitor reads its records every ``log_every`` steps:
    a checkpoint written in between did not hold the diagnosis yet, so the resumed run diagnosed
    another step (another batch, at another scale). The diagnosis is now made before each
    checkpoint is written; and it changes no random stream or buffer (the weights agree)."""
    end, resumed = _diagnosed_and_resumed(tmp_path)
    diagnoses = [e for e in end["amp"]["events"] if e["kind"] == "diagnosis"]
    assert len(diagnoses) == 1 and diagnoses[0]["scale"] == FALLBACK["init_scale"]
    for step, state in resumed:
        got, want = (_without_fallback_diagnosis(x["amp"]["events"]) for x in (state, end))
        assert not differences(got, want), step
        assert not differences(state["model"], end["model"]), step


def test_the_fallback_after_a_resume_carries_the_runs_diagnosis(tmp_path):
    end, resumed = _diagnosed_and_resumed(tmp_path)
    for step, state in resumed:
        assert not differences(state["amp"]["events"], end["amp"]["events"]), step


# ---------------------------------------------------------------------------- real processes, real signals
CHILD = """
import os, signal, sys
from pathlib import Path
from tests.train.test_resume_bitwise import STEPS, trainer

case, ckdir, at, sig = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

class Signal:  # a real signal to this process after step `at`: SIGTERM stops after it, SIGKILL before its checkpoint
    def on_step_end(self, trainer, step, result):
        if step == at:
            os.kill(os.getpid(), sig)

t = trainer(case, ckdir, every=1, callbacks=(Signal(),) if at else ())
t.resume()
t.fit(STEPS[case] - t.amp.optimizer_steps)
"""


REAL = {
    "rollback": (8, signal.SIGTERM),
    "fallback": (5, signal.SIGKILL),
}  # after the spike; before the decision


@pytest.mark.slow
def test_a_real_signal_then_a_new_process_resumes_bitwise(run, tmp_path):
    """rollback: SIGTERM after the spike's step, before the read that catches it; fallback: SIGKILL
    (before step 5's checkpoint) while step 3's reading waits for step 6's decision."""
    case = run[0]
    at, sig = REAL[case]
    root = Path(__file__).resolve().parents[2]
    child = [sys.executable, "-c", CHILD, case, str(tmp_path / "ck")]
    env = {**os.environ, "PYTHONPATH": str(root)}
    first = subprocess.run(
        [*child, str(at), str(int(sig))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert first.returncode == (143 if sig == signal.SIGTERM else -9), first.stderr[-2000:]
    second = subprocess.run(
        [*child, "0", "0"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stderr[-2000:]
    final = load_checkpoint(str(tmp_path / "ck" / f"ckpt-{STEPS[case]:08d}.pt"))
    assert not differences({k: final[k] for k in run[3]}, run[3])
