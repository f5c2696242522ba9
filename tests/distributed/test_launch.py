"""``ampkit train --nproc_per_node``, ``torchrun -m ampkit``, ``ampkit slurm`` and ``ampkit export``:
real processes through PyTorch's own launcher (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ampkit.cli import main
from ampkit.distributed.launch import strip_flags, torchrun_command
from ampkit.distributed.slurm import sbatch_script

from ..support.helpers import assert_exits_cleanly

pytestmark = pytest.mark.distributed

TINY = ["--model", "mlp", "--size", "tiny", "--device", "cpu", "--no_progress"]


def ampkit(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ampkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.slow
def test_train_on_two_processes_reports_world_size_and_logs_once(tmp_path):
    r = ampkit(
        "train",
        "--nproc_per_node",
        "2",
        *TINY,
        "--steps",
        "5",
        "--json",
        "--log_dir",
        str(tmp_path / "run"),
    )
    assert_exits_cleanly(r)
    out = json.loads(r.stdout)  # one JSON document: rank 0 alone prints
    assert out["world_size"] == 2 and out["optimizer_steps"] == 5
    # One log, written by rank 0; 5 step records.
    steps = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert sum(1 for s in steps if s.get("type") == "step") == 5
    assert r.stderr.count("ampkit train: mlp/tiny") == 1


@pytest.mark.slow
def test_ranks_see_different_batches_and_fsdp_resumes(tmp_path):
    ck = str(tmp_path / "ck")
    common = [
        "train",
        "--nproc_per_node",
        "2",
        "--parallel",
        "fsdp",
        *TINY,
        "--json",
        "--checkpoint_dir",
        ck,
        "--checkpoint_every",
        "2",
    ]
    r = ampkit(*common, "--steps", "2", "--log_dir", str(tmp_path / "a"))
    assert_exits_cleanly(r)
    assert os.path.isfile(os.path.join(ck, "ckpt-00000002", ".metadata"))
    r = ampkit(*common, "--steps", "4", "--resume", "--log_dir", str(tmp_path / "b"))
    assert_exits_cleanly(r)
    assert json.loads(r.stdout)["optimizer_steps"] == 4
    # The export loads in one process, without pickled code.
    out = str(tmp_path / "one.pt")
    assert main(["export", os.path.join(ck, "ckpt-00000004"), out]) == 0
    state = torch.load(out, weights_only=True)
    assert state["step"] == 4 and state["data"]["micro_index"] == 4
    assert set(state["model"]) and all(isinstance(v, torch.Tensor) for v in state["model"].values())


def test_the_trainer_interleaves_ranks_over_the_data():
    from ampkit.train.trainer import Trainer

    seen = []
    model = torch.nn.Linear(2, 1)
    from ampkit import MixedPrecision

    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def batches(i):
        seen.append(i)
        return torch.randn(4, 2), torch.randn(4, 1)

    t = Trainer(
        model,
        opt,
        amp,
        batches,
        progress=False,
        loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
    )
    t.world_size, t.rank = 2, 1  # what rank 1 of 2 sees
    t.source.world_size, t.source.rank = 2, 1  # (the batch source reads its rank at construction)
    t.fit(3)
    assert seen == [1, 3, 5]


def test_launch_command_lines():
    cmd = torchrun_command(
        ["train", "--nproc_per_node", "4", "--steps=3", "--nnodes=1"], nproc_per_node=4
    )
    assert cmd[1:3] == ["-m", "ampkit.distributed.torchrun"] and "--standalone" in cmd
    assert cmd[-4:] == ["-m", "ampkit", "train", "--steps=3"]
    multi = torchrun_command(
        ["train"], nproc_per_node=8, nnodes="2", node_rank=1, rdzv_endpoint="n1:29500"
    )
    assert (
        "--rdzv_endpoint=n1:29500" in multi
        and "--rdzv_backend=c10d" in multi
        and "--node_rank=1" in multi
    )
    with pytest.raises(ValueError, match="needs --rdzv_endpoint"):
        torchrun_command(["train"], nproc_per_node=8, nnodes="2")
    assert strip_flags(["--nproc-per-node", "2", "--rdzv_id=x", "--lr", "1"]) == ["--lr", "1"]


@pytest.mark.slow
def test_slurm_script_is_valid_bash_with_overridable_settings(tmp_path, capsys):
    assert (
        main(
            [
                "slurm",
                "--nodes",
                "2",
                "--gpus_per_node",
                "8",
                "--partition",
                "gpu",
                "--time",
                "04:00:00",
                "--",
                "--model",
                "gpt",
                "--precision",
                "fp16",
                "--steps",
                "1000",
            ]
        )
        == 0
    )
    script = capsys.readouterr().out
    path = tmp_path / "job.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    for needle in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=04:00:00",
        "#SBATCH --ntasks-per-node=1",
        "PRECISION=${PRECISION:-fp16}",
        "NPROC_PER_NODE=${NPROC_PER_NODE:-8}",
        "scontrol show hostnames",
        "srun ",
        "-m torch.distributed.run",
        "--rdzv_backend=c10d",
        '--rdzv_endpoint="$HEAD_NODE:$RDZV_PORT"',
        '-m ampkit train --precision "$PRECISION"',
        "STEPS=${STEPS:-1000}",
        '--steps "$STEPS"',
    ):  # a given flag is its variable's default (issue 24)
        assert needle in script, needle
    assert script.count("--precision") == 1  # the flag became $PRECISION's default
    with pytest.raises(ValueError, match="--nproc_per_node belongs to the script"):
        sbatch_script(["--nproc_per_node", "2"], nodes=1, gpus_per_node=2)
    with pytest.raises(ValueError, match="not a Slurm time limit"):
        sbatch_script([], nodes=1, gpus_per_node=2, time="four hours")


# (The generated sbatch script run end to end with a stub srun, two processes: tests/distributed/
# test_slurm.py::test_real_run_completes_then_a_rerun_with_more_steps_resumes, which asserts what the
# one-node launch here asserted and more.)


def test_sharded_checkpoints_skip_incomplete_and_report_corrupt(tmp_path):
    import warnings

    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import CheckpointError, ShardedCheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    mgr = ShardedCheckpointManager(str(tmp_path), lambda: capture(model, opt), keep_last=5)
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # DCP warns that no process group exists (one process is fine)
        first = mgr.save(
            1, {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": {"x": 1}}
        )
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            model.weight.add_(1.0)
        second = mgr.save(
            2, {"model": model.state_dict(), "optimizer": opt.state_dict(), "amp": {"x": 2}}
        )
        os.makedirs(tmp_path / "ckpt-00000003.partial")  # a save killed midway
        os.remove(os.path.join(second, ".metadata"))  # ... or one without its metadata
        assert [s for s, _ in mgr.list()] == [1]
        path, state = mgr.load_latest()
        assert path == first and state["amp"] == {"x": 1} and state["step"] == 1
        assert torch.equal(state["model"]["weight"], saved["weight"])
        assert not torch.equal(
            model.weight, saved["weight"]
        )  # loading read into copies: nothing applied yet
        for name in os.listdir(first):
            if name.endswith(".distcp"):
                with open(os.path.join(first, name), "r+b") as f:
                    f.truncate(10)
        with pytest.raises(CheckpointError, match="unreadable"):
            mgr.load_latest()


def test_sharded_checkpoint_refuses_pickled_objects(tmp_path):
    import datetime
    import warnings

    from ampkit.distributed.states import capture
    from ampkit.loop.checkpoint import CheckpointError, ShardedCheckpointManager

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = ShardedCheckpointManager(str(tmp_path), lambda: capture(model, opt))
    osd = opt.state_dict()
    osd["param_groups"][0]["lr"] = datetime.date(
        2020, 1, 1
    )  # not a weights_only type: a stand-in for a payload
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr.save(1, {"model": model.state_dict(), "optimizer": osd, "amp": {}})
        with pytest.raises(CheckpointError, match="unreadable"):
            mgr.load_latest()
