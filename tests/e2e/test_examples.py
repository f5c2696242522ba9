"""Every example runs, quickly, and does what it says."""

import importlib.util
import json
import math
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load(name):
    spec = importlib.util.spec_from_file_location(
        f"example_{name}", ROOT / "examples" / f"{name}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_basic_loop():
    loss = load("basic_loop").main(steps=8)
    assert math.isfinite(loss) and loss < 5.5  # below the uniform-bytes loss ln(256) = 5.55


def test_custom_loop_accumulation_clipping():
    stats = load("custom_loop").main(steps=6, accumulation=4)
    assert stats["optimizer_steps"] == 6 and stats["accumulation_steps"] == 4 and stats["scale"] > 0


@pytest.mark.slow
def test_checkpoint_resume_is_bit_identical():
    assert load("checkpoint_resume").main(steps=4) is True


def test_memory_report():
    out = load("memory_report").main()
    acts = out["activations"]
    assert acts["bf16"] < acts["fp32"] and out["breakdown"]["by_category"]["gradients"] > 0


@pytest.mark.slow
def test_benchmark_your_model():
    assert load("benchmark_your_model").main(steps=2) in ("fp32", "bf16", "fp16")


@pytest.mark.slow
def test_overflow_diagnosis():
    out = load("overflow_diagnosis").main()
    assert out == {"module": "big", "keep": ["big"], "fixed_skips": 0, "fallback_precision": "bf16"}


@pytest.mark.slow
def test_hf_gpt2_with_mixed_precision_and_cli(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    model, _ = load("hf_gpt2").factory()
    cfg = model.hf.config  # byte tokens: no special token outside them (transformers warned twice)
    for tok in (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id):
        assert tok is None or 0 <= tok < cfg.vocab_size, (tok, cfg.vocab_size)
    losses = load("hf_gpt2").main(steps=6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    from ampkit.cli import main

    monkeypatch.chdir(ROOT)
    capsys.readouterr()  # drop the example's own prints
    assert (
        main(
            [
                "train",
                "--model",
                "examples.hf_gpt2:factory",
                "--size",
                "tiny",
                "--steps",
                "4",
                "--precision",
                "bf16",
                "--device",
                "cpu",
                "--json",
                "--log_dir",
                str(tmp_path / "hf"),
                "--grad_ckpt_modules",
                "GPT2Block",
            ]
        )
        == 0
    )
    s = json.loads(capsys.readouterr().out)
    assert s["optimizer_steps"] == 4 and math.isfinite(s["final_loss"])


def test_unstable_gpt_as_a_script_shows_the_layer_that_overflows(capsys):
    import runpy

    runpy.run_path(
        str(ROOT / "examples" / "unstable_gpt.py"), run_name="__main__"
    )  # python examples/unstable_gpt.py
    out = capsys.readouterr().out
    assert "fp16 overflows in blocks.0.mlp.0" in out
    losses = {
        ln.split(":")[0]: ln.rsplit(" ", 1)[1]
        for ln in out.splitlines()
        if "loss of one batch" in ln
    }
    assert set(losses) == {"fp32", "bf16", "fp16"} and losses["fp16"] == "nan"
    assert math.isfinite(float(losses["fp32"])) and math.isfinite(float(losses["bf16"]))
