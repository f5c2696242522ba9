"""Flags given to ``ampkit train --resume`` never go silently unused (issue 34: never a silently
different run). The checkpoint carries the engine's settings, the optimizer's hyperparameters and
the random state, so a flag that differs from them is applied and said (``--lr``,
``--weight_decay``, ``--clip_grad_norm``, ``--precision``), said as not applying (``--seed``,
``--init_scale``: the run's random state and running scale continue), or refused naming both
values (an engine setting the checkpoint fixed) -- and the same command line again (a requeue)
is not a change."""

from __future__ import annotations

import pytest
import torch

from ampkit.cli import main
from ampkit.loop.checkpoint import CheckpointManager

MLP = ["train", "--model", "mlp", "--size", "tiny", "--device", "cpu", "--no_progress"]


@pytest.fixture()
def checkpointed(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    first = [
        *MLP,
        "--precision",
        "fp16",
        "--seed",
        "0",
        "--weight_decay",
        "0.01",
        "--growth_interval",
        "100",
        "--fallback_patience",
        "3",
        "--steps",
        "4",
        "--checkpoint_dir",
        ck,
        "--checkpoint_every",
        "4",
        "--log_dir",
        str(tmp_path / "l1"),
    ]
    assert main(first) == 0
    capsys.readouterr()
    return ck, first


def _resume(ck, tmp_path, *flags):
    return main(
        [
            *MLP,
            "--resume",
            "--checkpoint_dir",
            ck,
            "--checkpoint_every",
            "6",
            "--steps",
            "6",
            "--log_dir",
            str(tmp_path / "l2"),
            *flags,
        ]
    )


def test_the_same_command_line_again_is_not_a_change(checkpointed, tmp_path, capsys):
    ck, first = checkpointed
    i = first.index("--steps")  # the requeue's line, with more steps
    again = [*first[:i], "--steps", "6", *first[i + 2 :], "--resume"]
    assert main(again) == 0
    out = capsys.readouterr().out
    assert "note:" not in out


def test_weight_decay_given_on_resume_applies_and_is_said(checkpointed, tmp_path, capsys):
    ck, _ = checkpointed
    assert _resume(ck, tmp_path, "--weight_decay", "0.2") == 0
    out = capsys.readouterr().out
    assert "--weight_decay 0.2 replaces the checkpoint's 0.01" in out
    state = CheckpointManager(ck).load_latest()[1]
    assert {g["weight_decay"] for g in state["optimizer"]["param_groups"]} == {0.2}


def test_seed_and_init_scale_on_resume_are_said_not_to_apply(checkpointed, tmp_path, capsys):
    ck, _ = checkpointed
    assert _resume(ck, tmp_path, "--seed", "7", "--init_scale", "1024") == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--seed 7: the run continues the checkpoint's random state (seed 0)" in out
    assert "--init_scale 1024" in out and "continues from the checkpoint" in out


@pytest.mark.parametrize(
    ("flag", "value", "theirs"),
    [("--growth_interval", "500", "100"), ("--fallback_patience", "9", "3")],
)
def test_an_engine_setting_that_differs_is_refused_naming_both(
    checkpointed, tmp_path, capsys, flag, value, theirs
):
    ck, _ = checkpointed
    before = CheckpointManager(ck).load_latest()[1]
    assert _resume(ck, tmp_path, flag, value) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{flag} {value} differs from the checkpoint's {theirs}" in err
    after = CheckpointManager(ck).load_latest()[1]  # nothing trained, nothing written
    assert after["amp"]["optimizer_steps"] == before["amp"]["optimizer_steps"] == 4
    assert torch.equal(next(iter(after["model"].values())), next(iter(before["model"].values())))


def test_with_json_the_notes_go_to_stderr(checkpointed, tmp_path, capsys):
    ck, _ = checkpointed
    assert _resume(ck, tmp_path, "--seed", "3", "--json") == 0
    out = capsys.readouterr()
    assert "--seed 3" in " ".join(out.err.split()) and "--seed" not in out.out
