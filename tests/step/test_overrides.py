import pytest
import torch

from ampkit import MixedPrecision
from ampkit.step.overrides import apply_fp32_overrides, match_modules

from ..support.unstable_model import Unstable, train_unstable


def train(amp_kwargs, steps=40):
    amp, _, _, losses = train_unstable(steps, "fp16", **amp_kwargs)
    return amp, losses


@pytest.mark.slow
def test_overflowing_layer_skips_without_override_and_trains_with_it():
    amp, losses = train({})
    assert amp.stats()["skipped_steps"] == 40  # every step overflows in fp16
    assert not torch.isfinite(losses).any()
    amp, losses = train({"keep_fp32": ["big"], "init_scale": 1024.0})
    assert amp.stats()["skipped_steps"] == 0
    assert torch.isfinite(losses).all()
    assert losses[-5:].mean() < 0.6 * losses[:5].mean()  # it learns
    assert amp.overridden_modules == ["big"]


def test_overridden_module_runs_fp32_inputs_and_outputs():
    model = Unstable()
    seen = {}
    model.big.register_forward_hook(lambda m, a, o: seen.update(inp=a[0].dtype, out=o.dtype))
    model.head.register_forward_hook(lambda m, a, o: seen.update(head=o.dtype))
    amp = MixedPrecision("fp16", device="cpu", keep_fp32=["big"])
    model = amp.setup(model)
    with amp.autocast():
        model(torch.randn(4, 16))
        assert torch.is_autocast_enabled("cpu")  # restored after the overridden module
    assert seen == {"inp": torch.float32, "out": torch.float32, "head": torch.float16}


def test_fp32_override_matches_fp32_reference_for_that_layer():
    torch.manual_seed(0)
    model = Unstable(gain=1.0)
    x = torch.randn(4, 32).bfloat16()  # a half input, as the previous layer under autocast produces
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model.big(x)
    apply_fp32_overrides(model, ["big"], "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.big(x)
    ref = torch.nn.functional.linear(
        x.float(), model.big.weight, model.big.bias
    )  # fp32 op, fp32 weights
    assert plain.dtype == torch.bfloat16 and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert (plain.float() - ref).abs().max() > 0  # without the override the op ran in bf16


@pytest.mark.parametrize(
    "patterns,expected",
    [
        (["big"], {"big": ["big"]}),
        (["*.weight_never", "head"], None),
        ([torch.nn.LayerNorm], {"torch.nn.modules.normalization.LayerNorm": ["norm"]}),
        (["LayerNorm"], {"LayerNorm": ["norm"]}),
        (["torch.nn.Linear"], {"torch.nn.Linear": ["big", "head", "inp"]}),
        (["b*"], {"b*": ["big"]}),
    ],
)
def test_pattern_matching(patterns, expected):
    model = Unstable()
    if expected is None:
        with pytest.raises(ValueError, match="matches no module"):
            match_modules(model, patterns)
    else:
        got = match_modules(model, patterns)
        assert {k: sorted(v) for k, v in got.items()} == expected


def test_nested_globs_on_gpt():
    from ampkit.models.builtin import build

    model = build("gpt", "tiny")
    got = match_modules(model, ["*.ln_*", "lm_head"])
    assert sorted(got["*.ln_*"]) == [
        "blocks.0.ln_1",
        "blocks.0.ln_2",
        "blocks.1.ln_1",
        "blocks.1.ln_2",
    ]
    assert got["lm_head"] == ["lm_head"]


def test_unmatched_pattern_lists_close_names_before_setup_changes_anything():
    model = Unstable()
    amp = MixedPrecision("fp16", device="cpu", keep_fp32=["bigg"])
    with pytest.raises(ValueError) as e:
        amp.setup(model)
    assert "'bigg'" in str(e.value) and "big" in str(e.value)
    assert not model.big._forward_pre_hooks


def test_bad_pattern_types():
    with pytest.raises(ValueError, match="keep_fp32"):
        MixedPrecision("fp16", device="cpu", keep_fp32=[3])
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        MixedPrecision("fp16", device="cpu", keep_fp32=[int])


def test_state_dict_keys_unchanged():
    model = Unstable()
    keys = list(model.state_dict())
    MixedPrecision("fp16", device="cpu", keep_fp32=["big", "norm"]).setup(model)
    assert list(model.state_dict()) == keys
