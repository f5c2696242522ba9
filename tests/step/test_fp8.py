"""fp8 through torchao's float8, emulated on CPU (fp8_emulate=True) so every test runs in CI."""

import copy
import io
import sys

import pytest
import torch

from ampkit import ConfigError, MixedPrecision, PrecisionError
from ampkit.models.builtin import builtin

from ..support.helpers import train_tiny_gpt

pytest.importorskip("torchao.float8")

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]


def gpt():
    torch.manual_seed(0)
    return builtin("gpt", "tiny", batch_size=4, seed=0)


train = train_tiny_gpt


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.slow
def test_fp8_trains_close_to_bf16(recipe):
    model, amp, losses = train("fp8", fp8_recipe=recipe)
    _, _, ref = train("bf16")
    converted = [r["name"] for r in amp.fp8_report() if r["converted"]]
    assert converted and all(
        type(model.get_submodule(n)).__name__ == "Float8Linear" for n in converted
    )
    assert losses[-1] < losses[0]  # it learns
    assert (
        abs(losses[-1] - ref[-1]) / ref[-1] < 0.05
    )  # and stays near bf16 (fp8 has 3-4 significant bits)


def test_report_filter_first_last_shapes_and_keep_fp32():
    model, amp, _ = train("fp8", steps=1, keep_fp32=("blocks.1.mlp.*",))
    report = {r["name"]: r for r in amp.fp8_report()}
    assert (
        not report["blocks.0.attn.qkv"]["converted"]
        and "first" in report["blocks.0.attn.qkv"]["reason"]
    )
    assert not report["lm_head"]["converted"] and "last" in report["lm_head"]["reason"]
    assert (
        not report["blocks.1.mlp.0"]["converted"]
        and "keep_fp32" in report["blocks.1.mlp.0"]["reason"]
    )
    assert report["blocks.0.mlp.0"]["converted"]
    odd = torch.nn.Sequential(
        torch.nn.Linear(16, 16),
        torch.nn.Linear(16, 24),
        torch.nn.Linear(24, 16),
        torch.nn.Linear(16, 16),
    )
    amp2 = MixedPrecision("fp8", device="cpu", fp8_emulate=True)
    amp2.setup(odd, torch.optim.SGD(odd.parameters(), lr=0.1))
    assert "not a multiple of 16" in {r["name"]: r for r in amp2.fp8_report()}["1"]["reason"]


def test_state_dict_keys_and_weights_only_round_trip():
    plain, _ = gpt()
    model, amp, _ = train("fp8", steps=2)
    state = model.state_dict()
    assert list(state) == list(plain.state_dict())
    buf = io.BytesIO()
    torch.save({"model": state, "amp": amp.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh, amp2, _ = train("fp8", steps=0)
    fresh.load_state_dict(loaded["model"])
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )


def test_clear_errors():
    with pytest.raises(PrecisionError, match="fp8_emulate=True"):
        MixedPrecision("fp8", device="cpu")
    with pytest.raises(ConfigError, match="tensorwise, rowwise, rowwise_with_gw_hp"):
        MixedPrecision("fp8", device="cpu", fp8_emulate=True, fp8_recipe="blockwise")


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    model, _ = gpt()
    amp = MixedPrecision("fp8", device="cpu", fp8_emulate=True)
    with pytest.raises(ImportError, match=r'pip install "ampkit\[fp8\]"'):
        amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_fallback_fp8_to_bf16_reverts_the_modules():
    model, amp, _ = train("fp8", steps=2, fallback=True)
    assert amp._fallback.chain[:2] == ("fp8", "bf16")
    weights = copy.deepcopy(model.state_dict())
    amp.switch("bf16")
    assert (
        not any(type(m).__name__ == "Float8Linear" for m in model.modules())
        and amp.fp8_report() == []
    )
    assert all(torch.equal(a, b) for a, b in zip(weights.values(), model.state_dict().values()))


def test_cli_fp8_emulated_and_compile(tmp_path, capsys):
    import json

    from ampkit.cli import main

    assert (
        main(
            [
                "train",
                "--model",
                "gpt",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--batch-size",
                "2",
                "--steps",
                "2",
                "--precision",
                "fp8",
                "--fp8_emulate",
                "--fp8_recipe",
                "rowwise",
                "--json",
                "--no-progress",
                "--log_dir",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["precision"] == "fp8"
    assert (
        main(
            [
                "train",
                "--model",
                "gpt",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--precision",
                "fp8",
                "--steps",
                "1",
                "--log_dir",
                str(tmp_path / "r2"),
            ]
        )
        == 2
    )
    assert "fp8_emulate" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_keeps_state_dict_keys_and_trains():
    model, batches = gpt()
    keys = list(model.state_dict())
    amp = MixedPrecision("fp32", device="cpu", compile=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = amp.setup(model, opt)
    losses = []
    for i in range(3):
        with amp.autocast():
            loss = model(*batches(i))
        amp.backward(loss)
        amp.step(opt)
        losses.append(loss.item())
    assert list(model.state_dict()) == keys and losses[-1] < losses[0]
