"""Issue 24 item 6: the seed guide 004's command lines run as written (tiny steps, this CPU), the
``--debug`` and ``--print_config`` flags, the Slurm script's environment form with stub
``srun``/``scontrol``, and config aliases in a ``--config`` file."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from ampkit.cli import main
from ampkit.cli.slurm import train_env_flags
from ampkit.step.logs import logger

TINY = [
    "--model",
    "mlp",
    "--size",
    "tiny",
    "--device",
    "cpu",
    "--no_progress",
    "--steps",
    "2",
    "--batch_size",
    "4",
]


def _train(tmp_path: Path, capsys, *argv: str) -> tuple[int, dict, str]:
    code = main(["train", *TINY, "--log_dir", str(tmp_path / "run"), "--json", *argv])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else {}), err


@pytest.mark.parametrize(
    "argv, precision, note",
    [
        (
            ["--mixed_precision", "bf16", "--amp_opt_level", "O2"],
            "bf16-pure",
            "training in bf16-pure",
        ),
        (["--mixed_precision", "bf16", "--amp_opt_level", "O1"], "bf16", "training in bf16"),
        (
            ["--mixed_precision", "fp16", "--amp_opt_level", "O0"],
            "fp32",
            "--amp_opt_level O0 wins: training in fp32",
        ),
        (["--mixed_precision", "no"], "fp32", None),
    ],
)
def test_seed_004_lines_train_in_the_precision_they_mean(tmp_path, capsys, argv, precision, note):
    code, out, err = _train(tmp_path, capsys, *argv)
    assert code == 0, err
    assert out["precision"] == precision and out["optimizer_steps"] == 2
    if note:
        assert note in " ".join(err.split())  # the console wraps lines


def test_fp8_on_a_cpu_is_one_line_naming_fp8_emulate(tmp_path, capsys):
    code, _, err = _train(tmp_path, capsys, "--mixed_precision", "fp8")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--fp8_emulate" in lines[0] and "fp8_emulate=True" not in lines[0]


def test_debug_logs_through_the_ampkit_logger_and_turns_on_anomaly_mode(tmp_path, capsys):
    try:
        code, _, err = _train(tmp_path, capsys, "--precision", "bf16", "--debug")
        assert code == 0, err
        assert "ampkit DEBUG precision bf16 on cpu" in err
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    finally:
        torch.autograd.set_detect_anomaly(False)
        for h in list(logger.handlers):
            logger.removeHandler(h)
        logger.setLevel(logging.NOTSET)


def test_print_config_prints_toml_that_reads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = [
        "train",
        *TINY,
        "--mixed_precision",
        "bf16",
        "--amp_opt_level",
        "O2",
        "--min_scale",
        "2",
        "--print_config",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    data = tomllib.loads(text)
    assert data["amp"]["precision"] == "bf16-pure" and data["amp"]["min_scale"] == 2.0
    assert (
        data["train"]["steps"] == 2
        and data["train"]["model"] == "mlp"
        and "print_config" not in data["train"]
    )
    assert not (tmp_path / "runs").exists()  # printed and exited: no run directory, nothing trained
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path), "--print_config"]) == 0
    again = capsys.readouterr().out
    strip = lambda t: [ln for ln in t.splitlines() if not ln.startswith("#")]  # noqa: E731
    assert strip(again) == strip(text)


def test_config_file_amp_aliases_and_did_you_mean(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(
        '[amp]\nmixed_precision_dtype = "fp16"\nloss_scale_window = 3\nautomatic_fallback = false\n'
    )
    assert main(["train", *TINY, "--config", str(path), "--print_config"]) == 0
    amp = tomllib.loads(capsys.readouterr().out)["amp"]
    assert (amp["precision"], amp["growth_interval"], amp["fallback"]) == ("fp16", 3, False)
    path.write_text("[amp]\nmin_loss_scal = 1.0\n")
    assert main(["train", *TINY, "--config", str(path)]) == 2
    assert "did you mean 'min_loss_scale', an alias of 'min_scale'" in capsys.readouterr().err


# ------------------------------------------------------------------------- Slurm, environment


def _stub_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": '#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n',
        "scontrol": '#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then echo 127.0.0.1; fi\n',
    }
    # a python stand-in that records its argv instead of starting torchrun
    stubs["fakepython"] = (
        f'#!/bin/bash\n{sys.executable} -c "import json,sys; print(json.dumps(sys.argv[1:]))" "$@"\n'
    )
    for name, text in stubs.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def _run_script(tmp_path: Path, capsys, train_flags: list[str], **env: str) -> list[str]:
    assert main(["slurm", "--nodes", "1", "--gpus_per_node", "2", "--", *train_flags]) == 0
    (tmp_path / "job.sh").write_text(capsys.readouterr().out)
    bin_dir = _stub_bin(tmp_path)
    base = {
        k: v
        for k, v in os.environ.items()
        if k.upper() not in {n.upper() for n in train_env_flags()}
    }
    base.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=str(bin_dir / "fakepython"),
        SLURM_JOB_NODELIST="n1",
        SLURM_JOB_NUM_NODES="1",
        SLURM_JOB_ID="7",
        **env,
    )
    r = subprocess.run(
        ["bash", str(tmp_path / "job.sh")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=base,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    argv = json.loads(r.stdout.strip().splitlines()[-1])
    return argv[argv.index("train") + 1 :]


def _value(argv: list[str], flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last one given wins in argparse


@pytest.mark.slow
def test_slurm_script_reads_precision_and_batch_size_from_the_environment(tmp_path, capsys):
    argv = _run_script(
        tmp_path,
        capsys,
        ["--model", "mlp", "--batch_size", "16", "--steps", "10"],
        PRECISION="bf16",
        BATCH_SIZE="512",
        LR="0.01",
        AMP_OPT_LEVEL="O2",
    )
    assert _value(argv, "--precision") == "bf16" and _value(argv, "--batch_size") == "512"
    assert _value(argv, "--lr") == "0.01" and _value(argv, "--amp_opt_level") == "O2"
    assert (
        _value(argv, "--steps") == "10" and _value(argv, "--model") == "mlp"
    )  # not in the env: as generated
    # the parsed command means what the environment said
    from ampkit.cli import build_parser

    args = build_parser().parse_args(["train", *argv])
    assert (args.precision, args.batch_size, args.lr, args.amp_opt_level) == (
        "bf16",
        512,
        0.01,
        "O2",
    )


@pytest.mark.slow
def test_slurm_script_without_environment_keeps_the_generated_flags(tmp_path, capsys):
    argv = _run_script(tmp_path, capsys, ["--mixed_precision", "fp16", "--batch_size", "16"])
    assert _value(argv, "--precision") == "fp16" and _value(argv, "--batch_size") == "16"
    assert "--mixed_precision" not in argv and "--lr" not in argv
