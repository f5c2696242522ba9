"""The newcomer's problems, one test each (hardening issue §2), run as a user runs them."""

import json
import os
import pathlib
import re
import resource
import signal
import subprocess
import sys

import pytest
import torch

from ampkit.choose.autoselect import measured_choice
from ampkit.cli import main
from ampkit.loop.checkpoint import (
    CheckpointError,
    CheckpointManager,
    DirLock,
    load_checkpoint,
    save_checkpoint,
)
from ampkit.models.builtin import builtin
from ampkit.step.engine import MixedPrecision
from ampkit.train.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]
MLP = [
    "train",
    "--model",
    "mlp",
    "--size",
    "tiny",
    "--device",
    "cpu",
    "--batch-size",
    "8",
    "--no-progress",
]


def strict_json(text):
    """Parse JSON that must not contain NaN/Infinity (Python's json would accept them)."""

    def refuse(name):
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def run(*argv, **kw):
    """The CLI in a fresh process: what a user sees (stdout, stderr, exit code)."""
    return subprocess.run(
        [sys.executable, "-m", "ampkit", *argv],
        capture_output=True,
        text=True,
        cwd=kw.pop("cwd", ROOT),
        timeout=300,
        **kw,
    )


# 1 ------------------------------------------------------------------------- quick start
def test_readme_quick_start_installs_cpu_torch_and_ci_runs_the_same_line():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    line1, line2 = [ln.split("#")[0].strip() for ln in block.strip().splitlines()[:2]]
    assert (
        "download.pytorch.org/whl/cpu" in line1
        and "pip install -e ." in line1
        and "ampkit train" in line1
    )
    assert (
        line2 == 'pip install -e ".[dev]" && pytest'
    )  # the extras only for the tests (issue 34 §5)
    ci = (ROOT / ".ci" / "run").read_text()
    assert line1.split(" && ampkit train")[0] in ci  # CI installs exactly as the README says


# 2 ------------------------------------------------------------------------- auto must not be slower than fp32
def test_auto_is_confirmed_by_measurement_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    model, batches = builtin("mlp", "tiny", batch_size=8)
    before = [p.clone() for p in model.parameters()]
    first = measured_choice(
        model, batches, "bf16", torch.device("cpu"), label="mlp/tiny", batch_size=8
    )
    speed = first.speedups["bf16"]
    assert speed > 0 and not first.cached
    assert first.precision in ("bf16", "fp32") and (
        first.precision == "fp32" or speed > 1
    )  # never slower
    assert "whole training step" in first.reason  # it says what it timed
    assert ("fp32's speed" in first.reason) == (first.precision == "fp32")
    assert all(
        torch.equal(a, b) for a, b in zip(before, model.parameters())
    )  # the model is untouched
    again = measured_choice(
        model, batches, "bf16", torch.device("cpu"), label="mlp/tiny", batch_size=8
    )
    assert again.cached and again.precision == first.precision and again.speedups == first.speedups
    assert (tmp_path / "auto-precision.json").exists()


def test_train_header_says_why_the_precision_was_chosen(tmp_path, capsys):
    assert main([*MLP, "--steps", "2", "--json", "--log_dir", str(tmp_path / "r")]) == 0
    s = strict_json(capsys.readouterr().out)
    assert s["precision_reason"]
    if s["precision"] != "fp32":  # only a measured win may leave fp32 on a CPU
        assert "as fast as fp32" in s["precision_reason"]


# 3 ------------------------------------------------------------------------- --resume and changed flags
def test_resume_honours_precision_lr_clip_and_refuses_accumulation(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert (
        main(
            [
                *MLP,
                "--precision",
                "fp16",
                "--steps",
                "4",
                "--checkpoint_dir",
                ck,
                "--checkpoint_every",
                "2",
                "--log_dir",
                str(tmp_path / "l1"),
                "--json",
            ]
        )
        == 0
    )
    capsys.readouterr()
    rc = main(
        [
            *MLP,
            "--resume",
            "--checkpoint_dir",
            ck,
            "--steps",
            "6",
            "--accumulation_steps",
            "2",
            "--log_dir",
            str(tmp_path / "l2"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "--accumulation_steps 2 differs from the checkpoint's 1" in err
    rc = main(
        [
            *MLP,
            "--resume",
            "--checkpoint_dir",
            ck,
            "--checkpoint_every",
            "2",
            "--steps",
            "6",
            "--precision",
            "bf16",
            "--lr",
            "0.01",
            "--clip_grad_norm",
            "0.5",
            "--json",
            "--log_dir",
            str(tmp_path / "l3"),
        ]
    )
    out = capsys.readouterr()
    assert rc == 0
    s = strict_json(out.out)
    assert s["precision"] == "bf16" and s["optimizer_steps"] == 6
    assert "switches the checkpoint's fp16 to bf16" in out.err
    assert (
        "--lr 0.01 replaces the checkpoint's 0.001" in out.err and "--clip_grad_norm 0.5" in out.err
    )
    # The new settings are what the run now checkpoints.
    state = load_checkpoint(CheckpointManager(ck).list()[-1][1])
    assert (
        state["amp"]["precision"] == "bf16" and state["optimizer"]["param_groups"][0]["lr"] == 0.01
    )


# 4 ------------------------------------------------------------------------- a checkpoint dir of another run
def test_new_run_refuses_another_runs_checkpoints_and_a_locked_dir(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert (
        main(
            [
                *MLP,
                "--steps",
                "2",
                "--checkpoint_dir",
                ck,
                "--checkpoint_every",
                "1",
                "--log_dir",
                str(tmp_path / "l1"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        main([*MLP, "--steps", "2", "--checkpoint_dir", ck, "--log_dir", str(tmp_path / "l2")]) == 2
    )
    err = capsys.readouterr().err
    assert (
        "already holds 2 checkpoint(s) of another run" in err
        and "--resume" in err
        and "--overwrite" in err
    )
    assert (
        main(
            [
                *MLP,
                "--steps",
                "1",
                "--checkpoint_dir",
                ck,
                "--checkpoint_every",
                "1",
                "--overwrite",
                "--log_dir",
                str(tmp_path / "l3"),
            ]
        )
        == 0
    )
    assert [s for s, _ in CheckpointManager(ck).list()] == [1]  # the old run's files are gone
    capsys.readouterr()
    with DirLock(ck):  # another run holds the directory
        assert (
            main(
                [
                    *MLP,
                    "--steps",
                    "2",
                    "--resume",
                    "--checkpoint_dir",
                    ck,
                    "--log_dir",
                    str(tmp_path / "l4"),
                ]
            )
            == 2
        )
    assert "is in use by another ampkit run" in capsys.readouterr().err


# 5 ------------------------------------------------------------------------- tune records the model
def test_tune_file_trains_the_measured_model(tmp_path, capsys):
    cfg = tmp_path / "tune.toml"
    assert (
        main(
            [
                "tune",
                "--model",
                "cnn",
                "--size",
                "tiny",
                "--batch_size",
                "4",
                "--precisions",
                "fp32",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--repeats",
                "1",
                "--device",
                "cpu",
                "--out",
                str(cfg),
            ]
        )
        == 0
    )
    text = cfg.read_text()
    assert 'model = "cnn"' in text and 'size = "tiny"' in text and "batch_size = 4" in text
    capsys.readouterr()
    assert (
        main(
            [
                "train",
                "--config",
                str(cfg),
                "--steps",
                "1",
                "--json",
                "--device",
                "cpu",
                "--log_dir",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    s = strict_json(capsys.readouterr().out)
    assert (s["model"], s["size"], s["batch_size"]) == ("cnn", "tiny", 4)


# 6 ------------------------------------------------------------------------- no abbreviations
def test_abbreviated_flags_are_refused(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[amp]\nprecision = "fp16"\n')
    with pytest.raises(SystemExit):
        main(["train", "--config", str(cfg), "--prec", "fp32"])
    assert "unknown flag '--prec' (did you mean '--precision'?)" in capsys.readouterr().err


# 7 ------------------------------------------------------------------------- failed runs exit non-zero
@pytest.mark.slow
def test_nan_loss_run_exits_nonzero_with_valid_json_and_diagnosis(tmp_path):
    r = run(
        "train",
        "--model",
        "examples.unstable_gpt:factory",
        "--size",
        "tiny",
        "--precision",
        "fp16",
        "--steps",
        "10",
        "--batch-size",
        "2",
        "--device",
        "cpu",
        "--no_fallback",
        "--json",
        "--no-progress",
        "--log_dir",
        str(tmp_path / "r"),
    )
    assert r.returncode == 3, r.stderr
    s = strict_json(r.stdout)  # null, never NaN
    assert s["skipped_steps"] == 10 and s["failure"]
    assert (
        "training failed numerically" in r.stderr
        and "diagnosis: first non-finite value" in r.stderr
    )


# 8 ------------------------------------------------------------------------- checkpoints that must not load
def make_trainer(tmp_path):
    model, batches = builtin("mlp", "tiny", batch_size=4)
    amp = MixedPrecision("fp32", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.setup(model, opt)
    return Trainer(model, opt, amp, batches, progress=False, checkpoint_dir=str(tmp_path / "ck"))


def test_marker_but_missing_keys_is_refused_before_loading(tmp_path):
    t = make_trainer(tmp_path)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    other = {k: torch.randn_like(v) for k, v in before.items()}
    save_checkpoint(
        {"model": other}, str(tmp_path / "ck" / "ckpt-00000001.pt")
    )  # no optimizer, no amp
    with pytest.raises(CheckpointError, match="lacks optimizer, amp"):
        t.resume()
    assert all(
        torch.equal(before[k], v) for k, v in t.model.state_dict().items()
    )  # weights untouched
    state = t.state_dict()
    state["optimizer"]["param_groups"][0]["params"] = state["optimizer"]["param_groups"][0][
        "params"
    ][:1]
    with pytest.raises(CheckpointError, match="optimizer state does not fit"):
        t.load_state_dict({**state, "model": other})
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items())


def test_dir_of_only_corrupt_checkpoints_says_so(tmp_path, capsys):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "ckpt-00000004.pt").write_bytes(b"not a checkpoint")
    (ck / "ckpt-00000002.pt").write_bytes(b"")
    # one error naming every file and its reason (no warning first: nothing was fallen back to)
    with pytest.raises(CheckpointError, match="every checkpoint .* is damaged or unreadable") as e:
        CheckpointManager(str(ck)).load_latest()
    assert "ckpt-00000004.pt" in str(e.value) and "ckpt-00000002.pt" in str(e.value)
    rc = main(
        [
            *MLP,
            "--resume",
            "--checkpoint_dir",
            str(ck),
            "--steps",
            "2",
            "--log_dir",
            str(tmp_path / "l"),
        ]
    )
    assert rc == 2 and "unreadable (2 file(s))" in capsys.readouterr().err


class Foreign:
    pass


def test_pickle_refusal_keeps_torchs_reason(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"ampkit_checkpoint": 1, "payload": Foreign()}, path)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(path))
    assert "Unsupported global" in str(e.value) and "Foreign" in str(e.value)


# 9 ------------------------------------------------------------------------- filesystem faults
@pytest.mark.slow
def test_bad_run_dirs_are_one_line_before_training(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for flag, value, says in (
        ("--log_dir", str(a_file), "is a file, not a directory"),
        ("--checkpoint_dir", str(a_file / "sub"), "cannot be created"),
        ("--log_dir", "/proc/ampkit-cannot-write-here", "cannot be created"),
    ):
        r = run(*MLP, "--steps", "1", flag, value)
        assert r.returncode == 2, r.stderr
        assert says in r.stderr and flag in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_full_disk_for_logs_is_one_line(tmp_path):
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    os.symlink("/dev/full", log_dir / "log.jsonl")  # every write: ENOSPC
    r = run(*MLP, "--steps", "4", "--log_every", "2", "--log_dir", str(log_dir))
    assert r.returncode == 2
    assert "No space left on device" in r.stderr and "Traceback" not in r.stderr
    assert str(log_dir / "log.jsonl") in r.stderr and "free space" in r.stderr  # which file, what to do


def _limit_file_size():  # runs in the child: writes past 64 KiB fail with EFBIG instead of a signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


@pytest.mark.slow
def test_checkpoint_write_failure_keeps_the_previous_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    common = [
        "train",
        "--model",
        "gpt",
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--batch-size",
        "2",
        "--no-progress",
        "--checkpoint_dir",
        str(ck),
        "--checkpoint_every",
        "2",
        "--precision",
        "fp32",
    ]
    assert run(*common, "--steps", "2", "--log_dir", str(tmp_path / "l1")).returncode == 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ampkit",
            *common,
            "--resume",
            "--steps",
            "4",
            "--log_dir",
            str(tmp_path / "l2"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        preexec_fn=_limit_file_size,
    )
    assert r.returncode == 2, r.stderr
    assert "could not write checkpoint" in r.stderr and "File too large" in r.stderr
    assert "Traceback" not in r.stderr
    assert not [p for p in os.listdir(ck) if p.startswith(".tmp-")]  # no partial file left behind
    assert [s for s, _ in CheckpointManager(str(ck)).list()] == [2]
    assert load_checkpoint(str(ck / "ckpt-00000002.pt"))["step"] == 2  # the previous one is intact


# 10 ------------------------------------------------------------------------ smaller ones
@pytest.mark.slow
def test_reused_log_dir_keeps_runs_apart_in_the_report(tmp_path, capsys):
    from ampkit.observe.report import make_report

    log = str(tmp_path / "run")
    assert main([*MLP, "--steps", "4", "--log_every", "2", "--log_dir", log]) == 0
    assert main([*MLP, "--steps", "6", "--log_every", "2", "--log_dir", log, "--seed", "1"]) == 0
    out = make_report(log, metrics=["loss"])
    (summary,) = out["summaries"].values()
    assert summary["steps"] == 6  # the second run only, not 4 + 6 merged
    assert out["notes"] and "holds 2 runs" in out["notes"][0]
    assert "holds 2 runs" in pathlib.Path(out["markdown"]).read_text()


@pytest.mark.slow
def test_eval_losses_on_screen_and_in_the_report(tmp_path, capsys):
    from ampkit.observe.report import make_report

    log = str(tmp_path / "run")
    assert (
        main([*MLP, "--steps", "4", "--eval_every", "2", "--log_every", "2", "--log_dir", log]) == 0
    )
    out = capsys.readouterr().out
    assert re.search(r"eval loss: step 2: \d+\.\d+, step 4: \d+\.\d+", out)
    md = pathlib.Path(make_report(log, metrics=["loss"])["markdown"]).read_text()
    assert "## Held-out evaluation" in md and "| 4 |" in md


def test_grad_ckpt_modules_errors_name_the_flag(tmp_path, capsys):
    assert (
        main(
            [
                *MLP,
                "--steps",
                "1",
                "--grad_ckpt_modules",
                "NoSuchBlock",
                "--log_dir",
                str(tmp_path / "r"),
            ]
        )
        == 2
    )
    assert "--grad_ckpt_modules 'NoSuchBlock'" in capsys.readouterr().err


def test_tomli_is_declared_for_old_pythons():
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"tomli[^"]*; python_version < .3\.11.', text)
