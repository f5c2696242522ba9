"""No run lost: graceful stops on SIGINT/SIGTERM (CLI, Trainer.fit, two processes), jobs that die
as one, checkpoint directories never shared by accident, resuming with the same command line.

Real processes and real signals; two-process runs go through ``ampkit train --nproc_per_node 2``
(torchrun, gloo on CPU). Every resumed run is compared bitwise with an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ampkit
from ampkit.cli import main
from ampkit.distributed.launch import job_status
from ampkit.loop.checkpoint import DirLock, load_checkpoint
from ampkit.train.trainer import Trainer

from ..support.helpers import assert_exits_cleanly

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "mlp", "--size", "tiny", "--device", "cpu", "--no_progress", "--log_every", "5"]
SMALL = [
    "--model",
    "mlp",
    "--size",
    "small",
    "--device",
    "cpu",
    "--no_progress",
    "--log_every",
    "5",
]  # ~10 ms a step


# ---------------------------------------------------------------------------- helpers
def spawn(args: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    out.parent.mkdir(parents=True, exist_ok=True)
    f = open(out, "w")  # noqa: SIM115 - closed by the child's exit; read back by path
    return subprocess.Popen(
        [sys.executable, "-m", "ampkit", *args],
        stdout=f,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def run(
    args: list[str], env: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ampkit", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def wait_for_steps(log: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (
            log.exists()
            and sum('"type":"step"' in ln.replace(" ", "") for ln in log.read_text().splitlines())
            >= n
        ):
            return
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before {n} steps"
        time.sleep(0.1)
    raise AssertionError(f"no {n} steps in {log} within {timeout} s")


def leftovers(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions ``marker`` (a test's own tmp path)."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = (
                    Path(f"/proc/{d}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                    .decode(errors="replace")
                )
                state = Path(f"/proc/{d}/stat").read_text().split(")")[-1].split()[0]
            except OSError:
                continue
            if marker in cmd and state != "Z":
                pids.append(int(d))
    return pids


def wait_gone(marker: str, timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and leftovers(marker):
        time.sleep(0.2)
    left = leftovers(marker)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    return left


def digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def assert_same(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, set(a) ^ set(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")


def trained_state(path: str) -> dict:
    """The parts of a checkpoint that training computed: weights, optimizer state, scale, data position."""
    if os.path.isdir(path):
        from ampkit.distributed import dcp

        state = dcp.consolidate(path)
    else:
        state = load_checkpoint(path)
    return {
        "model": state["model"],
        "optimizer": state["optimizer"]["state"],
        "scaler": state["amp"]["scaler"],
        "precision": state["amp"]["precision"],
        "steps": state["amp"]["optimizer_steps"],
        "data": state["data"],
    }


def stop_line(output: str) -> re.Match:
    m = re.search(
        r"ampkit: stopped by (SIG\w+) after optimizer step (\d+); checkpoint (\S+) written\. "
        r"Resume with: (ampkit train .*)",
        output,
    )
    assert m, output[-3000:]
    return m


def resume_args(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "ampkit"
    return words[1:]


# ---------------------------------------------------------------------------- one process, CLI
CLI_RUN = [*SMALL, "--steps", "150", "--checkpoint_every", "150"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the CLI run of CLI_RUN, never stopped (its final checkpoint's path)."""
    d = tmp_path_factory.mktemp("uninterrupted")
    r = run(["train", *CLI_RUN, "--checkpoint_dir", str(d / "ck"), "--log_dir", str(d / "log")])
    assert r.returncode == 0, r.stderr[-3000:]
    return str(d / "ck" / "ckpt-00000150.pt")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_stops_gracefully_and_resumes_bitwise(tmp_path, sig, uninterrupted):
    common = CLI_RUN
    proc = spawn(
        [
            "train",
            *common,
            "--checkpoint_dir",
            str(tmp_path / "ck"),
            "--log_dir",
            str(tmp_path / "a"),
        ],
        tmp_path / "a.out",
    )
    wait_for_steps(tmp_path / "a" / "log.jsonl", 10, proc)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig
    out = (tmp_path / "a.out").read_text()
    m = stop_line(out)
    stopped = int(m.group(2))
    assert m.group(1) == signal.Signals(sig).name and 10 <= stopped < 150
    newest = sorted((tmp_path / "ck").glob("ckpt-*.pt"))[-1]
    assert newest.name == f"ckpt-{stopped:08d}.pt" and m.group(3).endswith(newest.name)
    assert load_checkpoint(str(newest))["amp"]["optimizer_steps"] == stopped
    events = [json.loads(x) for x in (tmp_path / "a" / "log.jsonl").read_text().splitlines()]
    assert any(
        e.get("kind") == "stop" and e.get("signal") == signal.Signals(sig).name for e in events
    )
    # The printed command, run as is, finishes the run; it equals an uninterrupted one bitwise.
    r = run(resume_args(m.group(4)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {newest} at step {stopped}" in "".join((r.stdout + r.stderr).split("\n"))
    assert_same(
        trained_state(str(tmp_path / "ck" / "ckpt-00000150.pt")), trained_state(uninterrupted)
    )


@pytest.mark.slow
def test_sigterm_before_training_exits_143_with_a_message(tmp_path):
    proc = spawn(
        [
            "train",
            "--model",
            "gpt",
            "--size",
            "small",
            "--device",
            "cpu",
            "--steps",
            "3",
            "--no_progress",
            "--log_dir",
            str(tmp_path / "a"),
        ],
        tmp_path / "a.out",
    )
    time.sleep(0.5)  # still importing / building: no training yet
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    out = (tmp_path / "a.out").read_text()
    assert code in (143, -signal.SIGTERM), out[-2000:]  # -15: the signal beat Python's start-up
    if code == 143:
        assert "interrupted (SIGTERM)" in out or "stopped by SIGTERM" in out


# ---------------------------------------------------------------------------- one process, a script
SCRIPT = """
import os, sys, time, torch
import ampkit
from ampkit.train.trainer import Trainer

steps, ck = int(sys.argv[1]), sys.argv[2]
hold = sys.argv[3] if len(sys.argv) > 3 else None  # a file: at step 10, wait until it exists


class Hold:  # the run cannot end before the test's signal arrives (it stops at step 5..10)
    def on_step_end(self, trainer, step, result):
        end = time.monotonic() + 300  # (only catches a hang)
        while hold and step == 10 and not os.path.exists(hold) and time.monotonic() < end:
            time.sleep(0.05)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
amp = ampkit.MixedPrecision("bf16", device="cpu", accumulation_steps=2)
model, opt = amp.setup(model, opt)
w = torch.randn(64, 10, generator=torch.Generator().manual_seed(1))

def batches(i):
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(100 + i))
    return x, (x @ w).argmax(1)

trainer = Trainer(model, opt, amp, batches, loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                  progress=False, log_every=5, log_dir=ck + "-log", checkpoint_dir=ck,
                  checkpoint_every=steps, callbacks=[Hold()])
trainer.resume()
trainer.fit(steps - amp.optimizer_steps)   # not caught: a graceful stop exits 130/143 by itself
"""


@pytest.mark.slow
def test_a_script_calling_fit_stops_on_sigterm_with_143_and_resumes_bitwise(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ck = str(tmp_path / "ck")
    f = open(tmp_path / "a.out", "w")  # noqa: SIM115
    signalled = tmp_path / "signalled"
    proc = subprocess.Popen(
        [sys.executable, str(script), "20", ck, str(signalled)],
        stdout=f,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    wait_for_steps(Path(ck + "-log") / "log.jsonl", 5, proc)
    proc.send_signal(signal.SIGTERM)
    signalled.touch()  # (the run waits at step 10 for this: it cannot finish first)
    assert proc.wait(timeout=300) == 143
    out = (tmp_path / "a.out").read_text()
    m = re.search(
        r"ampkit: stopped by SIGTERM after optimizer step (\d+); checkpoint (\S+) written\. "
        r"Resume with Trainer.resume\(\)",
        out,
    )
    assert m and "Traceback" not in out, out[-2000:]
    assert 5 <= int(m.group(1)) <= 10
    assert sorted(Path(ck).glob("ckpt-*.pt"))[-1].name == f"ckpt-{int(m.group(1)):08d}.pt"
    for args in (["20", ck], ["20", str(tmp_path / "ref")]):  # resume it; the uninterrupted one
        r = subprocess.run(
            [sys.executable, str(script), *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-2000:]
    assert_same(
        trained_state(os.path.join(ck, "ckpt-00000020.pt")),
        trained_state(str(tmp_path / "ref" / "ckpt-00000020.pt")),
    )


def _trainer(tmp_path, name, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = ampkit.MixedPrecision("bf16", device="cpu", accumulation_steps=2)
    model, opt = amp.setup(model, opt)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))

    def batches(i):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + i))
        return x, (x @ w).argmax(1)

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    return Trainer(
        model,
        opt,
        amp,
        batches,
        loss_fn=loss_fn,
        progress=False,
        log_every=2,
        checkpoint_dir=str(tmp_path / name),
        **kwargs,
    )


class _SignalAt:
    def __init__(self, step, sig):
        self.step, self.sig = step, sig

    def on_step_end(self, trainer, step, result):
        if step == self.step:
            os.kill(os.getpid(), self.sig)  # as if `kill` arrived during this step


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.slow
def test_fit_raises_after_checkpointing_and_restores_the_users_handlers(tmp_path, sig):
    seen = []
    mine = lambda s, f: seen.append(s)  # noqa: E731 - the user's own handler
    before = signal.signal(sig, mine)
    try:
        t = _trainer(tmp_path, "ck", callbacks=[_SignalAt(4, sig)])
        with pytest.raises(ampkit.TrainingInterrupted) as info:
            t.fit(10)
        e = info.value
        assert isinstance(e, KeyboardInterrupt)
        assert (e.signal, e.step, e.exit_code) == (sig, 4, 128 + sig)
        assert e.checkpoint == str(tmp_path / "ck" / "ckpt-00000004.pt") and os.path.isfile(
            e.checkpoint
        )
        assert signal.getsignal(sig) is mine and seen == []  # ours only while fit ran
        # A fresh trainer resumes from it and ends bitwise equal to an uninterrupted run.
        t2 = _trainer(tmp_path, "ck")
        assert t2.resume() == e.checkpoint
        t2.fit(6)
        ref = _trainer(tmp_path, "ref")
        ref.fit(10)
        assert_same(t2.state_dict()["model"], ref.state_dict()["model"])
        assert_same(t2.state_dict()["optimizer"], ref.state_dict()["optimizer"])
    finally:
        signal.signal(sig, before)


def test_request_stop_from_a_callback_and_no_checkpoint_dir(tmp_path):
    class Stop:
        def on_step_end(self, trainer, step, result):
            if step == 2:
                trainer.request_stop()

    t = _trainer(tmp_path, "ck", callbacks=[Stop()])
    t.checkpoints = None  # as without a checkpoint_dir
    with pytest.raises(ampkit.TrainingInterrupted, match="nothing was saved") as info:
        t.fit(5)
    assert info.value.step == 2 and info.value.checkpoint is None


def test_second_signal_while_stopping_does_not_interrupt(tmp_path, capsys):
    class Twice:
        def on_checkpoint(self, trainer, path):
            os.kill(os.getpid(), signal.SIGINT)  # arrives while the stop's checkpoint is written

    t = _trainer(tmp_path, "ck", callbacks=[_SignalAt(3, signal.SIGTERM), Twice()])
    with pytest.raises(ampkit.TrainingInterrupted) as info:
        t.fit(10)
    assert info.value.signal == signal.SIGTERM and info.value.step == 3
    assert load_checkpoint(info.value.checkpoint)["amp"]["optimizer_steps"] == 3
    assert "already stopping" in capsys.readouterr().err


# ---------------------------------------------------------------------------- two processes
TWO = ["--nproc_per_node", "2", *TINY]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_sigterm_then_sigint_to_the_launcher(tmp_path):
    common = [
        "--nproc_per_node",
        "2",
        *SMALL,
        "--steps",
        "40",
        "--checkpoint_every",
        "40",
    ]  # stops at ~11
    proc = spawn(
        [
            "train",
            *common,
            "--checkpoint_dir",
            str(tmp_path / "ck"),
            "--log_dir",
            str(tmp_path / "a"),
        ],
        tmp_path / "a.out",
    )
    wait_for_steps(tmp_path / "a" / "log.jsonl", 10, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 143  # (timeouts here and below only catch a hang)
    assert wait_gone(str(tmp_path), 120) == []
    out = (tmp_path / "a.out").read_text()
    m = stop_line(out)
    stopped = int(m.group(2))
    ck = tmp_path / "ck" / f"ckpt-{stopped:08d}"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith(".")) == [
        ck.name
    ]
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(ck)).read_metadata().state_dict_metadata)
    assert {"rng.rank0", "rng.rank1"} <= keys  # both ranks wrote their part of the same step
    assert "--nproc_per_node 2" in m.group(4)
    r = run(resume_args(m.group(4)))
    assert_exits_cleanly(r, "resumed")
    r = run(
        [
            "train",
            *common,
            "--checkpoint_dir",
            str(tmp_path / "ref"),
            "--log_dir",
            str(tmp_path / "r"),
        ]
    )
    assert_exits_cleanly(r, "reference")
    assert 10 <= stopped < 40
    assert_same(
        trained_state(str(tmp_path / "ck" / "ckpt-00000040")),
        trained_state(str(tmp_path / "ref" / "ckpt-00000040")),
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_sigkill_of_the_launcher_leaves_no_worker(tmp_path):
    proc = spawn(
        [
            "train",
            *TWO,
            "--steps",
            "100000",
            "--checkpoint_dir",
            str(tmp_path / "ck"),
            "--log_dir",
            str(tmp_path / "a"),
        ],
        tmp_path / "a.out",
    )
    wait_for_steps(tmp_path / "a" / "log.jsonl", 10, proc)
    assert len(leftovers(str(tmp_path))) == 4  # launcher, torchrun, two workers
    proc.kill()
    proc.wait(timeout=60)
    assert wait_gone(str(tmp_path), 120) == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("rank,where", [(1, "step:3"), (0, "step:3"), (1, "build")])
def test_two_processes_an_error_on_one_rank_ends_the_job(tmp_path, rank, where):
    r = run(
        [
            "train",
            "--nproc_per_node",
            "2",
            "--model",
            "tests.rank_fault:factory",
            "--device",
            "cpu",
            "--no_progress",
            "--steps",
            "50",
            "--log_dir",
            str(tmp_path / "a"),
        ],
        env={"AMPKIT_TEST_FAIL_RANK": str(rank), "AMPKIT_TEST_FAIL_AT": where},
    )
    assert r.returncode not in (0, None)
    text = r.stdout + r.stderr
    what = "user factory failed" if where == "build" else "user model failed"
    assert f"{what} on rank {rank}" in text, text[-3000:]
    assert wait_gone(str(tmp_path), 60) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_locked_checkpoint_dir_exits_2_on_every_rank(tmp_path):
    ck = tmp_path / "ck"
    with DirLock(str(ck), what="--checkpoint_dir"):  # another run holds it
        r = run(
            [
                "train",
                *TWO,
                "--steps",
                "2",
                "--checkpoint_dir",
                str(ck),
                "--log_dir",
                str(tmp_path / "a"),
            ]
        )
    assert r.returncode == 2, r.stderr[-3000:]
    assert (
        "in use by another ampkit run" in r.stderr
        and r.stderr.count("in use by another ampkit run") == 1
    )


# ---------------------------------------------------------------------------- checkpoint dirs
@pytest.mark.slow
@pytest.mark.distributed
def test_sharded_dir_of_another_run_is_refused_and_a_mismatched_resume_changes_nothing(tmp_path):
    ck = tmp_path / "ck"
    r = run(
        [
            "train",
            *TWO,
            "--steps",
            "4",
            "--checkpoint_dir",
            str(ck),
            "--checkpoint_every",
            "2",
            "--log_dir",
            str(tmp_path / "a"),
        ]
    )
    assert_exits_cleanly(r)
    before = digest(ck)
    assert "ckpt-00000004/.metadata" in before
    r = run(
        [
            "train",
            *TWO,
            "--steps",
            "4",
            "--checkpoint_dir",
            str(ck),
            "--log_dir",
            str(tmp_path / "b"),
        ]
    )
    assert r.returncode == 2 and "already holds" in r.stderr, r.stderr[-3000:]
    assert digest(ck) == before
    r = run(
        [
            "train",
            *TWO,
            "--size",
            "small",
            "--steps",
            "6",
            "--checkpoint_dir",
            str(ck),
            "--resume",
            "--log_dir",
            str(tmp_path / "c"),
        ]
    )
    assert r.returncode == 2, r.stderr[-3000:]
    assert "does not fit this model" in r.stderr and "shape mismatch" in r.stderr, r.stderr[-3000:]
    assert digest(ck) == before
    # (a usage error after the resume on every rank: status 2, not torchrun's 1 -- "nothing to do"
    # takes the same way out, tested in one process below)


def test_single_file_mismatched_resume_changes_nothing(tmp_path, capsys):
    ck = tmp_path / "ck"
    assert (
        main(
            [
                "train",
                *TINY,
                "--steps",
                "2",
                "--checkpoint_dir",
                str(ck),
                "--checkpoint_every",
                "2",
                "--log_dir",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    before = digest(ck)
    assert (
        main(
            [
                "train",
                *TINY,
                "--size",
                "small",
                "--steps",
                "4",
                "--checkpoint_dir",
                str(ck),
                "--resume",
                "--log_dir",
                str(tmp_path / "b"),
            ]
        )
        == 2
    )
    assert digest(ck) == before
    capsys.readouterr()
    # nothing left to do is a usage error (status 2), and changes nothing either
    assert (
        main(
            [
                "train",
                *TINY,
                "--steps",
                "2",
                "--checkpoint_dir",
                str(ck),
                "--resume",
                "--log_dir",
                str(tmp_path / "c"),
            ]
        )
        == 2
    )
    assert "nothing to do: already at step 2 of --steps 2" in capsys.readouterr().err
    assert digest(ck) == before


# ---------------------------------------------------------------------------- same command line, same run
@pytest.mark.slow
def test_resume_with_the_same_flags_keeps_the_fallback_and_diagnoses_once(tmp_path, capsys):
    cfg = tmp_path / "amp.toml"
    cfg.write_text(
        "[amp]\nfallback_patience = 2\nfallback_check_every = 2\n"
    )  # fall back within a few steps
    common = [
        "--model",
        "examples.unstable_gpt:factory",
        "--size",
        "tiny",
        "--precision",
        "fp16",
        "--device",
        "cpu",
        "--no_progress",
        "--checkpoint_every",
        "2",
        "--log_every",
        "2",
        "--config",
        str(cfg),
    ]
    assert (
        main(
            [
                "train",
                *common,
                "--steps",
                "8",
                "--checkpoint_dir",
                str(tmp_path / "ck"),
                "--log_dir",
                str(tmp_path / "a"),
            ]
        )
        == 0
    )
    first = load_checkpoint(str(tmp_path / "ck" / "ckpt-00000008.pt"))
    assert first["amp"]["precision"] == "bf16"  # fell back during the first run
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                *common,
                "--steps",
                "12",
                "--checkpoint_dir",
                str(tmp_path / "ck"),
                "--resume",
                "--log_dir",
                str(tmp_path / "b"),
            ]
        )
        == 0
    )
    cap = capsys.readouterr()
    err = " ".join((cap.out + cap.err).split())
    assert "is the run's own setting" in err and "continuing in bf16" in err, err
    assert (
        main(
            [
                "train",
                *common,
                "--steps",
                "12",
                "--checkpoint_dir",
                str(tmp_path / "ref"),
                "--log_dir",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    resumed = load_checkpoint(str(tmp_path / "ck" / "ckpt-00000012.pt"))
    assert resumed["amp"]["precision"] == "bf16"
    assert_same(
        trained_state(str(tmp_path / "ck" / "ckpt-00000012.pt")),
        trained_state(str(tmp_path / "ref" / "ckpt-00000012.pt")),
    )
    kinds = [e["kind"] for e in resumed["amp"]["events"]]
    ref_kinds = [
        e["kind"]
        for e in load_checkpoint(str(tmp_path / "ref" / "ckpt-00000012.pt"))["amp"]["events"]
    ]
    assert kinds.count("diagnosis") == ref_kinds.count("diagnosis") == 1
    # A *different* flag still asks for a switch.
    flags = [*common[:4], "--precision", "fp32", *common[6:]]
    assert (
        main(
            [
                "train",
                *flags,
                "--steps",
                "14",
                "--checkpoint_dir",
                str(tmp_path / "ck"),
                "--resume",
                "--log_dir",
                str(tmp_path / "c"),
            ]
        )
        == 0
    )
    assert load_checkpoint(str(tmp_path / "ck" / "ckpt-00000014.pt"))["amp"]["precision"] == "fp32"


@pytest.mark.slow
def test_two_fresh_runs_with_one_seed_are_bitwise_equal(tmp_path):
    for name in ("a", "b"):
        assert (
            main(
                [
                    "train",
                    *TINY,
                    "--steps",
                    "6",
                    "--seed",
                    "7",
                    "--checkpoint_dir",
                    str(tmp_path / name),
                    "--checkpoint_every",
                    "6",
                    "--log_dir",
                    str(tmp_path / f"log-{name}"),
                ]
            )
            == 0
        )
    a = load_checkpoint(str(tmp_path / "a" / "ckpt-00000006.pt"))
    b = load_checkpoint(str(tmp_path / "b" / "ckpt-00000006.pt"))
    for key in ("model", "optimizer", "rng", "data"):
        assert_same(a[key], b[key], key)
    assert a["rng"]["python"]["state"] == b["rng"]["python"]["state"]


# ---------------------------------------------------------------------------- the launcher's status
def test_job_status_names_the_first_failure(tmp_path):
    assert job_status(0, None, str(tmp_path)) == 0
    assert job_status(1, signal.SIGTERM, str(tmp_path)) == 143
    assert job_status(1, None, str(tmp_path)) == 1  # no worker said anything
    (tmp_path / "rank0").write_text("143")  # stopped because rank 1 failed
    time.sleep(0.01)
    (tmp_path / "rank1").write_text("2")
    assert job_status(1, None, str(tmp_path)) == 2
    (tmp_path / "rank0").write_text("3")
    os.utime(tmp_path / "rank0", ns=(1, 1))  # rank 0 failed first
    assert job_status(1, None, str(tmp_path)) == 3


def test_deterministic_flag_reaches_torch_and_the_checkpoint(tmp_path):
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    try:
        assert (
            main(
                [
                    "train",
                    *TINY,
                    "--steps",
                    "2",
                    "--deterministic",
                    "warn",
                    "--checkpoint_dir",
                    str(tmp_path / "ck"),
                    "--checkpoint_every",
                    "2",
                    "--log_dir",
                    str(tmp_path / "a"),
                ]
            )
            == 0
        )
        assert (
            torch.are_deterministic_algorithms_enabled()
            and torch.is_deterministic_algorithms_warn_only_enabled()
        )
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert (
            load_checkpoint(str(tmp_path / "ck" / "ckpt-00000002.pt"))["amp"]["config"][
                "deterministic"
            ]
            == "warn"
        )
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        if before[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
