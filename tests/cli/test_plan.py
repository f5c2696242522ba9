"""`ampkit plan`: by depth extrapolation for gpt / Hugging Face stacks, said so in the output;
--verify measures the full model at the answers; bad input is one clear line."""

import json

import pytest

from ampkit.cli import main


@pytest.mark.slow
def test_plan_says_how_it_found_the_answers_and_verify_measures_them(capsys):
    argv = [
        "plan",
        "--model",
        "gpt",
        "--size",
        "tiny",
        "--memory",
        "24MiB",
        "--precisions",
        "fp32,bf16-pure",
        "--batch_size",
        "4",
        "--json",
    ]
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
    assert (
        main(
            [
                "plan",
                "--model",
                "mlp",
                "--size",
                "tiny",
                "--memory",
                "8MiB",
                "--precisions",
                "fp32",
                "--batch_size",
                "4",
            ]
        )
        == 0
    )  # not a stack of blocks: the full model measured, and said so
    assert "measured: the full model's training step" in " ".join(
        capsys.readouterr().out.split()
    )  # (wrapped)


@pytest.mark.parametrize(
    "argv,says",
    [
        (["--model_config", "n_layer=2"], "--model_config is for Hugging Face config models"),
        (["--memory", "0GiB"], "memory size '0GiB' must be > 0"),
        (
            ["--device", "h100"],
            "--device 'h100' is not a device a plan knows (did you mean 'h100-80gb'?); choose cpu or "
            "one of: cuda, h200-141gb",
        ),
        (
            ["--device", "cuda", "--memory", None],
            "the memory of an unnamed CUDA device is not known here; give --memory",
        ),
    ],
)
@pytest.mark.slow
def test_plan_bad_input_is_one_clear_line(argv, says, capsys):
    base = {"--size": "tiny", "--memory": "24MiB"}
    for k, v in zip(argv[::2], argv[1::2]):
        base[k] = v
    flat = [x for kv in base.items() if kv[1] is not None for x in kv]
    try:  # a bad flag value is argparse's exit; the rest the command's status
        code = main(["plan", "--model", "gpt", "--precisions", "fp32", *flat])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
def test_rows_measured_in_forked_workers_are_the_serial_rows(capsys):
    """--workers 2 measures the precisions in two forked processes: the same rows, in the asked
    order, as one process. (In a fresh process: a test runner's worker has threads, where the
    plan does not fork.)"""
    import subprocess
    import sys

    argv = [
        "plan",
        "--model",
        "gpt",
        "--size",
        "tiny",
        "--memory",
        "24MiB",
        "--precisions",
        "bf16,fp32",
        "--batch_size",
        "4",
        "--json",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "ampkit", *argv, "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
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


def test_rows_that_cannot_fit_say_why_and_the_plan_goes_on(capsys):
    """(issue 36) The plan stopped at its first row whose state alone exceeded the budget ("no batch
    size fits"), answering none of the rows that fit. A budget between fp32's state (16 B/param) and
    the stochastic rung's with bf16 states: fp32's row says why, the rung's is answered."""
    argv = [
        "plan",
        "--model",
        "gpt",
        "--size",
        "medium",
        "--block_size",
        "16",
        "--memory",
        "150MiB",
        "--batch_size",
        "4",
        "--workers",
        "1",
        "--precisions",
        "fp32,bf16-pure:stochastic+bf16",
        "--json",
    ]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    fp32, rung = plan["rows"]
    assert fp32["largest_batch"] == 0 and not fp32["fits"]
    assert (
        "optimizer state alone need" in fp32["why_not"]
        and "more than the budget's 150.0 MiB" in fp32["why_not"]
    )
    assert rung["precision"] == "bf16-pure:stochastic+bf16" and rung["why_not"] is None
    assert (
        rung["largest_batch"] >= 1
        and rung["largest_batch_activation_checkpointing"] >= rung["largest_batch"]
    )
    # no full set of gradients held: fp32 fits too with the optimizer in backward, the rung a larger batch
    assert fp32["largest_batch_optimizer_in_backward"] >= 1
    assert rung["largest_batch_optimizer_in_backward"] > rung["largest_batch"]
    assert plan["device"] == "cpu"


def test_a_plan_for_a_named_gpu_from_this_cpu_machine(capsys):
    """--device h100-80gb on a machine without a GPU: planned on fake CPU tensors, the budget is the
    card's memory less the CUDA context and fragmentation, and every output names the device."""
    from ampkit.plan.devices import DEVICES

    argv = [
        "plan",
        "--model",
        "gpt",
        "--size",
        "tiny",
        "--device",
        "h100-80gb",
        "--batch_size",
        "4",
        "--workers",
        "1",
        "--precisions",
        "bf16,bf16-pure:split",
    ]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    h100 = DEVICES["h100-80gb"]
    assert (plan["device"], plan["device_name"]) == ("h100-80gb", "NVIDIA H100 80GB HBM3")
    assert plan["memory_bytes"] == h100.memory_bytes and plan["budget_bytes"] == h100.budget()
    assert plan["device_info"]["capability"] == [9, 0]
    bf16, split = plan["rows"]
    assert (
        bf16["largest_batch"] == split["largest_batch"] == 1 << 16
    )  # a tiny model: the plan's limit
    assert bf16["peak_bytes"] >= h100.workspace_bytes() and split["method"] == "depth"
    assert main(argv) == 0
    table = " ".join(capsys.readouterr().out.split())
    assert (
        "ampkit plan for NVIDIA H100 80GB HBM3 (h100-80gb)" in table
        and "cuBLAS workspaces" in table
    )
    # the ladder's gradients are planned in bf16, and the caption says when they are not
    assert "bf16-pure:split: gradients planned in bf16" in table and "accumulation or DDP" in table
    assert split["parts"]["gradients"] * 2 == bf16["parts"]["gradients"]
    assert (
        main(
            [
                "plan",
                "--model",
                "gpt",
                "--size",
                "tiny",
                "--device",
                "cuda",
                "--memory",
                "8GiB",
                "--precisions",
                "bf16",
                "--batch_size",
                "4",
                "--workers",
                "1",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["device"] == "cuda"


@pytest.mark.slow
def test_llama3_8b_for_an_h100_answers_every_row():
    """(issue 36) The Llama-3-8B-shaped config, 2048 tokens, batch 1, the four rows of the report, for
    an H100 from this CPU machine: every row is answered (the state alone of each exceeds 80 GiB,
    said so), and the stochastic rung with bf16 states fits with the optimizer in backward."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    cfg = (
        "hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,"
        "num_key_value_heads=8,vocab_size=128256,max_position_embeddings=2048"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ampkit",
            "plan",
            "--model",
            "llama",
            "--model_config",
            cfg,
            "--block_size",
            "2048",
            "--batch_size",
            "1",
            "--device",
            "h100-80gb",
            "--no_cache",
            "--json",
            "--precisions",
            "bf16,bf16-pure,bf16-pure:split,bf16-pure:stochastic,bf16-pure:stochastic+bf16",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads(r.stdout)
    assert plan["device"] == "h100-80gb" and len(plan["rows"]) == 5
    for row in plan["rows"][:4]:
        assert row["largest_batch"] == 0 and "optimizer state alone need" in row["why_not"], row
    params = 8_030_261_248  # Llama-3-8B's parameters
    assert plan["rows"][0]["parts"]["parameters"] == 4 * params  # bf16 autocast: fp32 weights
    assert plan["rows"][4]["largest_batch_optimizer_in_backward"] >= 1
    # the ladder keeps bf16 gradients: stochastic 2 + 0 + 8 + 2 = 12 B/param, and stochastic with
    # bf16 states (8 B/param) fits batch 1 as is
    stochastic, both = plan["rows"][3]["parts"], plan["rows"][4]
    assert stochastic["gradients"] == 2 * params
    state = sum(v for k, v in stochastic.items() if k not in ("activations", "temporaries"))
    assert 12 * params <= state <= 12 * params + (64 << 20)
    assert both["largest_batch"] >= 1


def test_a_plan_whose_every_row_the_gpu_cannot_run_says_nothing_was_estimated(capsys):
    """--device v100-32gb --precisions bf16,fp8: both rows refused, yet the caption read "per row
    (see each row's method): ; depth: estimated by depth extrapolation ..." of nothing measured."""
    argv = ["plan", "--model", "mlp", "--size", "tiny", "--device", "v100-32gb"]
    assert main([*argv, "--precisions", "bf16,bf16-pure:split", "--workers", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in plan["rows"]] == ["refused", "refused"]
    assert "extrapolation" not in plan["method"] and "no row was estimated" in plan["method"]
    assert plan["device_name"] == "NVIDIA V100 32GB"
    assert main([*argv, "--precisions", "fp32,bf16", "--workers", "1"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "cannot run bf16: the NVIDIA V100 32GB (sm_70) has no bf16" in text
    assert "no batch fits bf16" not in text
