"""`ampkit plan`: by depth extrapolation for gpt / Hugging Face stacks, said so in the output;
--verify measures the full model at the answers; bad input is one clear line."""

import json

import pytest

from ampkit.cli import main


@pytest.mark.slow
def test_plan_says_how_it_found_the_answers_and_verify_measures_them(capsys):
    argv = ["plan", "--model", "gpt", "--size", "tiny", "--memory", "24MiB", "--precisions", "fp32,bf16-pure",
            "--batch_size", "4", "--json"]
    assert main(argv) == 0
    fast = json.loads(capsys.readouterr().out)
    assert fast["method"].startswith("estimated by depth extrapolation from 1- and 2-block copies")
    assert all(r["method"] == "depth" and r["verified"] is None for r in fast["rows"])
    assert main([*argv, "--verify"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["method"].startswith("depth extrapolation, verified")
    for a, b in zip(fast["rows"], checked["rows"]):
        assert b["method"] == "depth, verified" and b["verified"] is True
        for k in ("peak_bytes", "parts", "largest_batch", "largest_batch_activation_checkpointing"):
            assert a[k] == b[k], k
    assert main(["plan", "--model", "mlp", "--size", "tiny", "--memory", "8MiB", "--precisions", "fp32",
                 "--batch_size", "4"]) == 0  # not a stack of blocks: the full model measured, and said so
    assert "measured: the full model's training step" in " ".join(capsys.readouterr().out.split())  # (wrapped)


@pytest.mark.parametrize("argv,says", [
    (["--model_config", "n_layer=2"], "--model_config is for Hugging Face config models"),
    (["--memory", "0GiB"], "memory size '0GiB' must be > 0"),
    (["--memory", "100KiB"], "smaller than the parameters"),
])
@pytest.mark.slow
def test_plan_bad_input_is_one_clear_line(argv, says, capsys):
    base = {"--size": "tiny", "--memory": "24MiB"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    flat = [x for kv in base.items() for x in kv]
    assert main(["plan", "--model", "gpt", "--precisions", "fp32", *flat]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_rows_measured_in_forked_workers_are_the_serial_rows(capsys):
    """--workers 2 measures the precisions in two forked processes: the same rows, in the asked
    order, as one process. (In a fresh process: a test runner's worker has threads, where the
    plan does not fork.)"""
    import subprocess
    import sys

    argv = ["plan", "--model", "gpt", "--size", "tiny", "--memory", "24MiB", "--precisions", "bf16,fp32",
            "--batch_size", "4", "--json"]
    r = subprocess.run([sys.executable, "-m", "ampkit", *argv, "--workers", "2"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    forked = json.loads(r.stdout)
    assert main([*argv, "--workers", "1"]) == 0
    serial = json.loads(capsys.readouterr().out)
    assert [row["precision"] for row in forked["rows"]] == ["bf16", "fp32"]
    assert forked == serial


def test_workers_fall_back_to_one_process_where_forking_is_unsafe(monkeypatch):
    import threading

    from ampkit.cli.plan import workers

    monkeypatch.setattr(threading, "active_count", lambda: 1)  # as in `ampkit plan`'s own process
    assert workers(6, 1) == 1 and workers(1, 4) == 1 and workers(3, 8) == 3 and workers(6, 2) == 2
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # another thread runs: no fork
    assert workers(6, 4) == 1
