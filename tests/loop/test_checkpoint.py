import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.loop.checkpoint import (
    CheckpointError,
    CheckpointManager,
    capture_rng,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from ampkit.models.builtin import builtin
from ampkit.train.trainer import Trainer


def make_trainer(precision, tmp_path, accum=2, every=None, seed=0):
    torch.manual_seed(seed)
    model, data = builtin("gpt", "tiny", batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = MixedPrecision(
        precision,
        device="cpu",
        accumulation_steps=accum,
        clip_grad_norm=1.0,
        init_scale=2.0**12,
        growth_interval=3,
    )
    model, opt = amp.setup(model, opt)
    return Trainer(
        model,
        opt,
        amp,
        data,
        progress=False,
        log_every=2,
        diagnose=False,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=every,
    )


def test_atomic_save_and_weights_only_load(tmp_path):
    path = str(tmp_path / "a.pt")
    save_checkpoint({"x": torch.arange(5), "meta": {"k": [1, 2]}}, path)
    state = load_checkpoint(path)
    assert torch.equal(state["x"], torch.arange(5)) and state["meta"] == {"k": [1, 2]}
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_checkpoint_is_named_and_skipped(tmp_path, damage):
    mgr = CheckpointManager(str(tmp_path), keep_last=None)
    mgr.save(1, {"v": torch.tensor(1.0)})
    mgr.save(2, {"v": torch.tensor(2.0)})
    bad = mgr.path(2)
    with open(bad, "rb") as f:
        data = f.read()
    with open(bad, "wb") as f:
        f.write(
            {"truncate": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b""}[
                damage
            ]
        )
    with pytest.raises(CheckpointError, match="ckpt-00000002.pt"):
        load_checkpoint(bad)
    with pytest.warns(UserWarning, match="falling back"):
        path, state = mgr.load_latest()
    assert path == mgr.path(1) and state["v"].item() == 1.0


def test_keep_last_and_temp_cleanup(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=2)
    (tmp_path / ".tmp-dead.pt").write_bytes(b"partial")
    for s in range(1, 6):
        mgr.save(s, {"s": s})
    assert [s for s, _ in mgr.list()] == [4, 5]
    assert not (tmp_path / ".tmp-dead.pt").exists()
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(str(tmp_path), keep_last=0)


def test_rng_roundtrip():
    np = pytest.importorskip("numpy")
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    state = capture_rng()
    a = (torch.rand(3), random.random(), np.random.rand())
    restore_rng(state)
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.slow
def test_exact_resume_in_process(precision, tmp_path):
    n = 4
    full = make_trainer(precision, tmp_path / "full")
    full.fit(2 * n)
    half = make_trainer(precision, tmp_path / "half")
    half.fit(n)
    half.save_checkpoint()
    resumed = make_trainer(
        precision, tmp_path / "half", seed=123
    )  # different init: must be overwritten
    assert resumed.resume().endswith(f"ckpt-{n:08d}.pt")
    assert resumed.amp.optimizer_steps == n and resumed.micro_index == 2 * n
    resumed.fit(n)
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert full.amp.stats()["scale"] == resumed.amp.stats()["scale"]


def test_checkpoint_from_different_model_loads_nothing(tmp_path):
    t = make_trainer("fp32", tmp_path)
    t.fit(1)
    t.save_checkpoint()
    torch.manual_seed(0)
    other, data = builtin("gpt", "small", batch_size=2)
    opt = torch.optim.AdamW(other.parameters())
    amp = MixedPrecision("fp32", device="cpu")
    other, opt = amp.setup(other, opt)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    tr = Trainer(other, opt, amp, data, progress=False, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match="shape mismatch: .*nothing was loaded"):
        tr.resume()
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "ampkit", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


COMMON = [
    "--model",
    "gpt",
    "--size",
    "tiny",
    "--batch-size",
    "2",
    "--device",
    "cpu",
    "--no-progress",
    "--json",
    "--grad_accum_steps",
    "2",
    "--init_scale",
    "4096",
]


@pytest.mark.slow
# (fp32 across processes: tests/e2e/test_stop.py resumes the CLI bitwise in fp32 where auto picks it,
# the SIGKILL test below resumes --precision fp32 in fresh processes)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_exact_resume_across_processes(precision, tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    r = run_cli(
        *COMMON,
        "--precision",
        precision,
        "--steps",
        "6",
        "--checkpoint_dir",
        str(full),
        "--checkpoint_every",
        "3",
        "--log_dir",
        str(tmp_path / "l1"),
    )
    assert r.returncode == 0, r.stderr
    part.mkdir()  # the uninterrupted run's step-3 checkpoint, resumed by a fresh process
    shutil.copy(full / "ckpt-00000003.pt", part)
    r = run_cli(
        *COMMON,
        "--precision",
        precision,
        "--steps",
        "6",
        "--checkpoint_dir",
        str(part),
        "--checkpoint_every",
        "3",
        "--resume",
        "--log_dir",
        str(tmp_path / "l2"),
    )
    assert r.returncode == 0, r.stderr
    a = load_checkpoint(str(full / "ckpt-00000006.pt"))
    b = load_checkpoint(str(part / "ckpt-00000006.pt"))
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["amp"]["scaler"] == b["amp"]["scaler"]


def test_resume_without_checkpoint(tmp_path, capsys):
    from ampkit.cli import main

    args = [
        "train",
        *COMMON,
        "--steps",
        "2",
        "--checkpoint_dir",
        str(tmp_path / "none"),
        "--resume",
        "--log_dir",
        str(tmp_path / "l"),
    ]
    assert main(args) == 2
    assert "--allow_fresh" in capsys.readouterr().err
    assert main([*args, "--allow_fresh"]) == 0


@pytest.mark.slow
def test_sigkill_during_checkpointing_never_leaves_a_partial_checkpoint(tmp_path):
    """Kill a training process that checkpoints every step at random moments, repeatedly."""
    ckpt = tmp_path / "ckpt"
    mgr = CheckpointManager(str(ckpt), keep_last=2)
    rng = random.Random(0)

    def newest():
        steps = [s for s, _ in mgr.list()]
        return max(steps) if steps else 0

    kills = 0
    for _ in range(3):
        before = newest()
        args = [
            sys.executable,
            "-m",
            "ampkit",
            "train",
            *COMMON,
            "--precision",
            "fp32",
            "--steps",
            "100000",
            "--checkpoint_dir",
            str(ckpt),
            "--checkpoint_every",
            "1",
            "--keep_last",
            "2",
            "--log_dir",
            str(tmp_path / "log"),
            "--log_every",
            "1",
            "--resume",
            "--allow_fresh",
        ]
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 300  # a loaded machine can take long to import torch
        while newest() <= before and time.time() < deadline and p.poll() is None:
            time.sleep(0.02)  # wait until it is training and checkpointing
        assert p.poll() is None, p.stderr.read().decode()[-2000:]
        time.sleep(
            rng.uniform(0.0, 0.4)
        )  # every step writes a checkpoint: most kills land mid-write
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
        found = mgr.load_latest()
        assert found is not None
        path, state = found
        assert state["step"] == int(path[-11:-3]) >= before  # progress is never lost
        assert set(state) >= {"model", "optimizer", "amp", "rng", "data"}
        for _, other in mgr.list():
            load_checkpoint(other)  # every complete file loads: none is ever partial
    # each round waited for a new checkpoint: >= 3 (more depends on where the random kills land)
    assert kills == 3 and newest() >= 3
    lines = (tmp_path / "log" / "log.jsonl").read_text().splitlines()
    log = [json.loads(line) for line in lines if line.strip().endswith("}")]
    assert any(r.get("kind") == "checkpoint" for r in log)


class _FullDisk:
    """A file whose every write raises ENOSPC, as on a full disk."""

    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("where", ["write", "fsync", "create"])
def test_a_full_disk_names_the_checkpoint_and_replaces_nothing(tmp_path, monkeypatch, where):
    """ENOSPC while writing a checkpoint: one error naming the file, saying the previous checkpoint
    is intact and the partial file gone, and what to do; nothing left behind (issue 34 §3)."""
    import ampkit.loop.checkpoint as ck

    manager = CheckpointManager(str(tmp_path))
    manager.save(1, {"x": torch.arange(3)})
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "write":
        real = os.fdopen
        monkeypatch.setattr(ck.os, "fdopen", lambda *a, **k: _FullDisk(real(*a, **k)))
    elif where == "fsync":
        monkeypatch.setattr(ck.os, "fsync", lambda fd: (_ for _ in ()).throw(full))
    else:

        def mkstemp(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", k.get("dir", "?") + "/.tmp-x")

        monkeypatch.setattr(ck.tempfile, "mkstemp", mkstemp)
    with pytest.raises(CheckpointError) as e:
        manager.save(2, {"x": torch.arange(4)})
    monkeypatch.undo()
    text = str(e.value)
    assert manager.path(2) in text and "No space left on device" in text
    assert "nothing was replaced" in text.lower() and "previous checkpoint" in text
    assert "free space" in text.lower()
    assert ".tmp-" not in text  # the file it was writing, not a temporary name
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert [s for s, _ in manager.list()] == [1]
    step, state = manager.load_latest()[1]["step"], manager.load_latest()[1]
    assert step == 1 and torch.equal(state["x"], torch.arange(3))


def _sharded_checkpoints(directory, steps=(2, 4), writers=2):
    """Sharded checkpoints as a multi-process run leaves them (written here in one process; a
    second rank's shard file added by name: the layout is told from the names alone)."""
    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import ShardedCheckpointManager

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = ShardedCheckpointManager(str(directory), lambda: capture(model, opt))
    for step in steps:
        path = mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        for r in range(1, writers):
            shutil.copy(os.path.join(path, "__0_0.distcp"), os.path.join(path, f"__{r}_0.distcp"))
    return mgr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoints_of_the_other_layout_are_refused_not_a_fresh_start(tmp_path):
    """A one-process run's manager used to see a multi-process run's sharded checkpoints as no
    checkpoint at all (and the other way round): `--resume --allow_fresh` then trained from step 0
    beside them. They are refused, naming what is there and how to go on; so are the other
    layout's checkpoints when they are newer than this layout's newest (resuming would go back)."""
    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import ShardedCheckpointManager

    _sharded_checkpoints(tmp_path / "sharded")
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(str(tmp_path / "sharded")).load_latest()
    for words in (
        "written by a sharded (multi-process) run of 2 processes",
        "ckpt-00000004",
        "--nproc_per_node 2",
        "ampkit export",
    ):
        assert words in str(e.value), (words, str(e.value))

    single = CheckpointManager(str(tmp_path / "single"))
    for step in (2, 4):
        single.save(step, {"w": torch.ones(2)})
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = ShardedCheckpointManager(str(tmp_path / "single"), lambda: capture(model, opt))
    with pytest.raises(CheckpointError, match=r"ckpt-00000004\.pt.* single-file .*one-process run"):
        sharded.load_latest()

    _sharded_checkpoints(tmp_path / "mixed", steps=(6,))  # newer than the one-process run's 4
    mixed = CheckpointManager(str(tmp_path / "mixed"))
    mixed.save(4, {"w": torch.ones(2)})
    with pytest.raises(CheckpointError, match=r"ckpt-00000006.*newer than .*ckpt-00000004\.pt"):
        mixed.load_latest()
    mixed.save(6, {"w": torch.ones(2)})  # (e.g. `ampkit export`ed beside it): this layout's own
    assert mixed.load_latest()[0] == mixed.path(6)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_resume_allow_fresh_refuses_a_multi_process_runs_checkpoints(tmp_path, capsys):
    """`ampkit slurm`'s `--resume --allow_fresh`, rerun with one process beside a 2-process run's
    checkpoints: refused (exit 2), nothing written, and without --allow_fresh the error does not
    suggest it."""
    from ampkit.cli import main

    ck = tmp_path / "ck"
    _sharded_checkpoints(ck)
    before = sorted(os.listdir(ck))
    args = ["train", *COMMON, "--steps", "6", "--checkpoint_dir", str(ck), "--resume"]
    for extra in (["--allow_fresh"], []):
        assert main([*args, *extra, "--log_dir", str(tmp_path / f"l{len(extra)}")]) == 2
        err = capsys.readouterr().err
        assert "sharded (multi-process) run of 2 processes" in err and "--nproc_per_node 2" in err
        assert "--allow_fresh" not in err, err
        assert sorted(set(os.listdir(ck)) - {".ampkit.lock"}) == before  # (the run's lock)
