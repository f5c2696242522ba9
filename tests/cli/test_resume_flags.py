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


GPT = ["train", "--model", "gpt", "--size", "tiny", "--device", "cpu", "--no_progress"]


def test_block_size_is_refused_and_data_is_said_on_resume(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # long paths: no wrapping inside them
    """``--block_size`` changes what batch i holds, the epoch's length and a step's tokens: another
    one is refused naming both (the default too), as ``--batch_size`` is. ``--data`` changes the
    text the run goes on with: said, either way (given, or dropped for the built-in corpus). The
    same line again says nothing. A checkpoint from before ampkit recorded them resumes as
    before."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world, this is a tiny corpus of text for testing. " * 200)
    other = tmp_path / "other.txt"
    other.write_text("another text altogether, read on resume instead of the first. " * 200)
    ck = str(tmp_path / "ck")
    line = [*GPT, "--batch_size", "2", "--block_size", "32", "--data", str(corpus)]
    line += ["--checkpoint_dir", ck, "--log_dir", str(tmp_path / "l")]
    assert main([*line, "--steps", "2", "--checkpoint_every", "2"]) == 0
    capsys.readouterr()

    def resume(*flags, steps="3"):
        i = line.index("--block_size")
        words = [*line[:i], *flags, *line[i + 4 :]] if flags != ("same",) else list(line)
        return main([*words, "--steps", steps, "--checkpoint_every", "1", "--resume"])

    assert resume("--block_size", "16", "--data", str(corpus)) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "its run read samples of 32 tokens, this data's are 16 (2 samples a batch)" in err
    assert "--block_size 32" in err
    assert resume("--data", str(corpus)) == 2  # the default, 64: refused too
    assert "samples of 32 tokens, this data's are 64" in " ".join(capsys.readouterr().err.split())

    assert resume("--block_size", "32", "--data", str(other)) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"--data {other} replaces the run's {corpus}: training goes on from step 2" in out
    assert resume("--block_size", "32", steps="4") == 0  # no --data: the built-in corpus
    out = " ".join(capsys.readouterr().out.split())
    assert f"no --data: the run read {other} until step 3" in out
    assert resume("--block_size", "32", "--data", str(corpus), steps="5") == 0
    capsys.readouterr()
    assert resume("same", steps="6") == 0  # the same line again: nothing to say
    assert "note:" not in capsys.readouterr().out

    # A checkpoint written before ampkit recorded the file and the tokens: resumed as before.
    manager = CheckpointManager(ck)
    path, state = manager.load_latest()
    for key in ("data_file", "tokens_per_batch"):
        del state["data"][key]
    manager.save(state["amp"]["optimizer_steps"], state)
    assert resume("--block_size", "16", "--data", str(other), steps="7") == 0
    assert "note:" not in capsys.readouterr().out


def test_the_resume_hint_names_the_runs_log_dir():
    """Following "Resume with: ..." continues the run's own log (and summary) even when the first
    command let ampkit choose runs/<stamp>-<precision> (review43): the hint names that dir."""
    import argparse

    from ampkit.cli.resume import resume_hint

    args = argparse.Namespace(checkpoint_dir="ck")
    argv = ["train", "--model", "mlp", "--checkpoint_dir", "ck"]
    hint = resume_hint(args, argv, "runs/20261128-bf16")
    assert hint.endswith("--resume --log_dir runs/20261128-bf16")
    given = resume_hint(args, [*argv, "--log_dir=mine"], "mine")
    assert given.count("log_dir") == 1
