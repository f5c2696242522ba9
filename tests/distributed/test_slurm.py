"""``ampkit slurm`` survives preemption: the sbatch script asks for USR1 before the time limit,
allows requeue, always trains with ``--resume --allow_fresh``, and its batch shell stops ``srun``
with SIGTERM on USR1/TERM, then requeues (USR1) or exits 143 (TERM).

The script runs here for real under ``bash`` with stub ``srun`` (runs its command) and
``scontrol`` (answers ``show hostnames``, records ``requeue ID``) on PATH: with a stand-in for
srun (the shell logic, fast) and with torchrun + 2 CPU workers (gloo).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ampkit.cli import main
from ampkit.distributed.slurm import _time_seconds, sbatch_script

from ..support.dist_helpers import free_port
from ..support.helpers import assert_exits_cleanly

TINY = ["--model", "mlp", "--size", "tiny", "--device", "cpu", "--no_progress"]
JOB_ID = "4242"


def _train_command(script: str) -> list[str]:
    """The tokens of the script's ``-m ampkit train ...`` command (after ``train``, before ``&``)."""
    line = next(ln for ln in script.splitlines() if "-m ampkit train" in ln)
    tokens = shlex.split(line)
    tokens = tokens[tokens.index("train") + 1 :]
    assert tokens[-1] == "&"  # srun runs in the background; the batch shell waits for it
    return tokens[:-1]


# ---------------------------------------------------------------------------------- content


@pytest.mark.slow
def test_script_asks_for_requeue_append_and_a_warning_signal(tmp_path, capsys):
    assert (
        main(
            [
                "slurm",
                "--nodes",
                "2",
                "--gpus_per_node",
                "8",
                "--time",
                "04:00:00",
                "--",
                "--model",
                "gpt",
                "--steps",
                "1000",
            ]
        )
        == 0
    )
    script = capsys.readouterr().out
    (tmp_path / "job.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    header = [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]
    for needle in (
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@120",
        "#SBATCH --nodes=2",
        "#SBATCH --time=04:00:00",
    ):
        assert needle in header, needle
    for needle in (
        "trap 'on_signal USR1' USR1",
        "trap 'on_signal TERM' TERM",
        'kill -TERM "$SRUN_PID"',
        'scontrol requeue "$SLURM_JOB_ID"',
        "exit 143",
        'wait "$SRUN_PID"',
        "CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/$SLURM_JOB_ID}",
        # what the script had before stays
        "PRECISION=${PRECISION:-bf16}",
        "NPROC_PER_NODE=${NPROC_PER_NODE:-8}",
        "RDZV_PORT=${RDZV_PORT:-29500}",
        "scontrol show hostnames",
        '--rdzv_endpoint="$HEAD_NODE:$RDZV_PORT"',
    ):
        assert needle in script, needle
    assert main(["slurm", "--signal_seconds", "300", "--", "--steps", "5"]) == 0
    assert "#SBATCH --signal=B:USR1@300\n" in capsys.readouterr().out


def test_resume_allow_fresh_and_checkpoint_dir_are_added_exactly_once():
    tokens = _train_command(
        sbatch_script(["--model", "gpt", "--steps", "10"], nodes=1, gpus_per_node=2)
    )
    for name in ("--resume", "--allow_fresh", "--checkpoint_dir", "--precision"):
        assert tokens.count(name) == 1, (name, tokens)
    assert tokens[tokens.index("--checkpoint_dir") + 1] == "$CHECKPOINT_DIR"
    assert tokens[:2] == ["--precision", "$PRECISION"] and tokens[2:6] == [
        "--model",
        "gpt",
        "--steps",
        "10",
    ]


@pytest.mark.parametrize(
    "given",
    [
        ["--resume", "--allow_fresh", "--checkpoint_dir", "/shared/ckpt"],
        ["--resume", "--allow-fresh", "--checkpoint-dir=/shared/ckpt"],
        ["train", "--checkpoint_dir=/shared/ckpt", "--allow_fresh", "--resume"],
    ],
)
def test_user_given_resume_flags_and_checkpoint_dir_are_not_duplicated(given):
    script = sbatch_script([*given, "--steps", "10"], nodes=1, gpus_per_node=2)
    tokens = _train_command(script)
    spelled = lambda *names: sum(t.split("=")[0] in names for t in tokens)  # noqa: E731
    assert spelled("--resume") == 1
    assert spelled("--allow_fresh", "--allow-fresh") == 1
    assert spelled("--checkpoint_dir", "--checkpoint-dir") == 1
    assert "/shared/ckpt" in " ".join(tokens) and "$CHECKPOINT_DIR" not in tokens
    assert "CHECKPOINT_DIR=" not in script  # no variable for a directory the user chose


def test_config_file_checkpoint_dir_is_respected_and_its_overwrite_refused(tmp_path):
    good = tmp_path / "run.toml"
    good.write_text('[train]\ncheckpoint_dir = "/shared/ckpt"\nsteps = 10\n')
    tokens = _train_command(sbatch_script(["--config", str(good)], nodes=1, gpus_per_node=2))
    assert (
        "--checkpoint_dir" not in tokens and tokens.count("--resume") == 1
    )  # the file's directory is used
    plain = tmp_path / "plain.toml"
    plain.write_text("[train]\nsteps = 10\n")
    tokens = _train_command(sbatch_script([f"--config={plain}"], nodes=1, gpus_per_node=2))
    assert tokens.count("--checkpoint_dir") == 1
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\ncheckpoint_dir = "/shared/ckpt"\noverwrite = true\n')
    with pytest.raises(
        ValueError, match=r"\[train\] overwrite in --config .*would delete its checkpoints"
    ):
        sbatch_script(["--config", str(bad)], nodes=1, gpus_per_node=2)
    with pytest.raises(ValueError, match="--config .*missing.toml.* cannot"):
        sbatch_script(["--config", str(tmp_path / "missing.toml")], nodes=1, gpus_per_node=2)


def test_overwrite_is_refused(capsys):
    with pytest.raises(ValueError, match="--overwrite.*would delete its checkpoints"):
        sbatch_script(["--steps", "5", "--overwrite"], nodes=1, gpus_per_node=2)
    assert main(["slurm", "--", "--checkpoint_dir", "/x", "--overwrite"]) == 2
    assert "would delete its checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize("seconds", [0, -5, 65536, 1.5, True])
def test_bad_signal_seconds_is_refused(seconds):
    with pytest.raises(
        ValueError, match=r"--signal_seconds .* must be a whole number of seconds from 1 to 65535"
    ):
        sbatch_script([], nodes=1, gpus_per_node=2, signal_seconds=seconds)


def test_bad_signal_seconds_on_the_command_line(capsys):
    assert main(["slurm", "--signal_seconds", "0", "--", "--steps", "5"]) == 2
    err = capsys.readouterr().err
    assert "ampkit slurm: error: --signal_seconds 0 must be" in err and "USR1" in err
    with pytest.raises(SystemExit):
        main(["slurm", "--signal_seconds", "soon"])
    assert "invalid int value" in capsys.readouterr().err
    # a warning at or before the job's start is a mistake too
    assert main(["slurm", "--time", "2", "--signal_seconds", "120"]) == 2
    assert "not shorter than --time 2 (120 s)" in capsys.readouterr().err
    assert main(["slurm", "--time", "00:02:01", "--signal_seconds", "120"]) == 0


def test_slurm_time_limits_in_seconds():
    assert _time_seconds("90") == 90 * 60  # MINUTES
    assert _time_seconds("30:15") == 30 * 60 + 15  # MM:SS
    assert _time_seconds("04:00:00") == 4 * 3600
    assert _time_seconds("2-12") == 2 * 86400 + 12 * 3600  # D-HH
    assert _time_seconds("1-02:30") == 86400 + 2 * 3600 + 30 * 60
    assert _time_seconds("1-00:00:05") == 86400 + 5


# ------------------------------------------------------------------------------ running it


def _stubs(tmp_path: Path, srun: str | None = None) -> tuple[Path, Path]:
    """``srun`` and ``scontrol`` stubs in tmp_path/bin; returns (bin dir, scontrol's requeue record)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "scontrol.log"
    stubs = {
        # one task: run the command (the script puts srun in the background, as with the real one)
        "srun": srun or '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
        "scontrol": '#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; exit 0; fi\n'
        f'echo "$*" >> {shlex.quote(str(record))}\n',
    }
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir, record


def _env(bin_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("CHECKPOINT_DIR", "SLURM_RESTART_COUNT")
    }
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        PYTHONUNBUFFERED="1",
        SLURM_JOB_NODELIST="node[1]",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_ID=JOB_ID,
        **extra,
    )
    return env


def _processes_with(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line contains ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry))
    return pids


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


# A stand-in for srun (no torch): note when it starts, and on SIGTERM note it, take a moment
# (a checkpoint) and exit 143, as torchrun does after its workers stopped.
FAKE_SRUN = """#!/bin/bash
trap 'echo term >> "$MARKS"; sleep 0.5; exit 143' TERM
echo started >> "$MARKS"
for _ in $(seq 300); do sleep 0.1; done
echo finished >> "$MARKS"
"""


def _start_fake(tmp_path: Path, srun: str = FAKE_SRUN) -> tuple[subprocess.Popen, Path, Path]:
    bin_dir, record = _stubs(tmp_path, srun=srun)
    marks = tmp_path / "marks"
    (tmp_path / "job.sh").write_text(sbatch_script(["--steps", "5"], nodes=1, gpus_per_node=2))
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "job.sh")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(bin_dir, MARKS=str(marks)),
        start_new_session=True,
    )
    _wait_for(
        lambda: marks.exists() and "started" in marks.read_text(), 20, "the fake srun to start"
    )
    return proc, marks, record


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["USR1", "TERM", "USR1 then TERM"])
def test_batch_shell_stops_srun_then_requeues_or_exits_143(tmp_path, sig):
    proc, marks, record = _start_fake(tmp_path)
    try:
        for name in sig.split(" then "):
            os.kill(proc.pid, getattr(signal, f"SIG{name}"))
            time.sleep(0.1)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert marks.read_text().split() == ["started", "term"]  # srun got exactly one SIGTERM
    if sig.startswith("USR1"):
        assert proc.returncode == 0, err
        assert record.read_text() == f"requeue {JOB_ID}\n"
        assert f"ampkit: time limit near: checkpointing, then requeue of job {JOB_ID}" in err
        assert f"job {JOB_ID} requeued (srun exited 143)" in err
    else:
        assert proc.returncode == 143, err
        assert not record.exists()  # Slurm requeues a preempted job itself
        assert "ampkit: SIGTERM (preemption or scancel): checkpointing, then exit" in err
    if sig == "USR1 then TERM":
        assert "SIGTERM while already stopping after SIGUSR1" in err


@pytest.mark.slow
def test_without_a_signal_the_script_exits_with_sruns_status(tmp_path):
    proc, _, record = _start_fake(tmp_path, srun='#!/bin/bash\necho started >> "$MARKS"\nexit 7\n')
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 7, err
    assert not record.exists() and "ampkit: time limit" not in err


@pytest.mark.slow
def test_training_that_finishes_despite_the_signal_is_not_requeued(tmp_path):
    srun = "#!/bin/bash\ntrap '' TERM\necho started >> \"$MARKS\"\nsleep 1\nexit 0\n"
    proc, _, record = _start_fake(tmp_path, srun=srun)
    os.kill(proc.pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert not record.exists() and "nothing to requeue" in err


def _torch_job(tmp_path: Path, *flags: str) -> tuple[Path, dict[str, str], Path]:
    """The script for 2 CPU processes of ``ampkit train TINY flags``, and its environment."""
    script = sbatch_script(
        [*TINY, "--log_dir", str(tmp_path / "run"), *flags],
        nodes=1,
        gpus_per_node=2,
        port=free_port(),
        precision="fp32",
    )
    path = tmp_path / "job.sh"
    path.write_text(script)
    bin_dir, record = _stubs(tmp_path)
    return path, _env(bin_dir), record


def _json(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("{") :])


@pytest.mark.slow
@pytest.mark.distributed
def test_real_run_completes_then_a_rerun_with_more_steps_resumes(tmp_path):
    # (a) a plain run: 2 processes, exit 0, the default checkpoint directory is per job id
    job, env, record = _torch_job(tmp_path, "--steps", "2", "--checkpoint_every", "2", "--json")
    r = subprocess.run(
        ["bash", str(job)], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )
    assert_exits_cleanly(r, "first run")
    out = _json(r.stdout)
    assert out["world_size"] == 2 and out["precision"] == "fp32" and out["optimizer_steps"] == 2
    assert "starting fresh (--allow_fresh)" in r.stderr
    ckpt = tmp_path / "checkpoints" / JOB_ID
    assert any(ckpt.iterdir()), "no checkpoint in checkpoints/$SLURM_JOB_ID"
    assert not record.exists()
    # (c) the same job again (a requeue: same SLURM_JOB_ID, same directory) with a higher total
    job, env, record = _torch_job(tmp_path, "--steps", "5", "--checkpoint_every", "2", "--json")
    r = subprocess.run(
        ["bash", str(job)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**env, "SLURM_RESTART_COUNT": "1"},
        timeout=300,
    )
    assert_exits_cleanly(r, "requeued run")
    assert _json(r.stdout)["optimizer_steps"] == 5
    assert "resumed from" in r.stderr and "at step 2" in r.stderr
    assert f"ampkit: restart 1 of job {JOB_ID}" in r.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_real_run_requeues_itself_on_usr1_and_leaves_no_process(tmp_path):
    # (b) USR1 mid-run: srun -> torchrun -> workers get SIGTERM; the job is requeued, exit 0
    marker = str(tmp_path / "run")
    job, env, record = _torch_job(
        tmp_path, "--steps", "100000", "--checkpoint_every", "1000000", "--log_every", "1"
    )
    log = tmp_path / "job.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            ["bash", str(job)],
            cwd=tmp_path,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        metrics = tmp_path / "run" / "log.jsonl"
        _wait_for(
            lambda: metrics.exists() and '"type":"step"' in metrics.read_text(),
            240,
            f"training to start (log: {log})",
        )
        os.kill(proc.pid, signal.SIGUSR1)
        status = proc.wait(timeout=300)  # only catches a hang
        text = log.read_text()
        assert status == 0, text[-3000:]
        assert record.read_text() == f"requeue {JOB_ID}\n"
        assert f"ampkit: time limit near: checkpointing, then requeue of job {JOB_ID}" in text
        # torchrun reaped its workers before it exited; the job's processes are all gone
        _wait_for(lambda: not _processes_with(marker), 60, "the job's processes to end")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_all(_processes_with(marker))
