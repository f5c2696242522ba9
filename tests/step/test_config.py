import contextlib
import os

import pytest
import torch

from ampkit import ConfigError, MixedPrecision, MixedPrecisionConfig, PrecisionError
from ampkit.step.determinism import apply_determinism


def test_defaults_match_torch_gradscaler():
    cfg = MixedPrecisionConfig()
    gs = torch.amp.GradScaler("cpu")
    assert cfg.init_scale == gs.get_scale()
    assert cfg.growth_factor == gs.get_growth_factor()
    assert cfg.backoff_factor == gs.get_backoff_factor()
    assert cfg.growth_interval == gs.get_growth_interval()
    assert cfg.hysteresis == 1 and cfg.min_scale is None and cfg.max_scale is None


@pytest.mark.parametrize(
    "field,value,fragment",
    [
        ("growth_factor", 0.5, "growth_factor=0.5"),
        ("growth_factor", 1.0, "> 1.0"),
        ("init_scale", 0, "init_scale=0"),
        ("init_scale", float("inf"), "finite"),
        ("init_scale", -1.0, "> 0"),
        ("backoff_factor", 1.0, "0 < backoff_factor < 1"),
        ("backoff_factor", 0.0, "0 < backoff_factor < 1"),
        ("growth_interval", 0, ">= 1"),
        ("hysteresis", 0, ">= 1"),
        ("accumulation_steps", 0, ">= 1"),
        ("clip_grad_norm", -1.0, "> 0"),
        ("min_scale", 0.0, "> 0"),
        ("init_scale", 2.0**-130, "2**-126"),  # below the loss scale's floor
        ("init_scale", 2.0**128, "2**127"),  # infinite as the fp32 scale tensor
    ],
)
def test_invalid_values_name_field_and_range(field, value, fragment):
    with pytest.raises(ConfigError) as e:
        MixedPrecisionConfig(**{field: value})
    assert field in str(e.value) and fragment in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    "field,value",
    [
        ("growth_interval", 2.5),
        ("accumulation_steps", "4"),
        ("dynamic_scaling", 1),
        ("hysteresis", True),
    ],
)
def test_wrong_types_rejected(field, value):
    with pytest.raises(ConfigError, match=field):
        MixedPrecisionConfig(**{field: value})


def test_bounds_must_be_ordered_and_contain_init_scale():
    with pytest.raises(ConfigError, match="max_scale"):
        MixedPrecisionConfig(min_scale=8.0, max_scale=4.0, init_scale=4.0)
    with pytest.raises(ConfigError, match="init_scale"):
        MixedPrecisionConfig(max_scale=1024.0)  # default init 65536 is above the bound
    MixedPrecisionConfig(min_scale=1.0, max_scale=2.0**20)


def test_unknown_precision_in_config():
    with pytest.raises(PrecisionError, match="fp61"):
        MixedPrecisionConfig(precision="fp61")


def test_precision_canonicalised():
    assert MixedPrecisionConfig(precision="16-mixed").precision == "fp16"
    assert MixedPrecisionConfig(precision=torch.bfloat16).precision == "bf16"


def test_roundtrip_and_replace():
    cfg = MixedPrecisionConfig(
        precision="fp16",
        init_scale=1024,
        hysteresis=3,
        min_scale=1.0,
        accumulation_steps=4,
        clip_grad_norm=1.0,
    )
    again = MixedPrecisionConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert isinstance(cfg.init_scale, float)
    assert cfg.replace(hysteresis=2).hysteresis == 2
    with pytest.raises(ConfigError, match="unknown config key"):
        cfg.replace(hysterisis=2)


def test_from_dict_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        MixedPrecisionConfig.from_dict({"init_scal": 2.0})
    assert "init_scal" in str(e.value) and "init_scale" in str(e.value)


def test_from_toml(tmp_path):
    p = tmp_path / "amp.toml"
    p.write_text('[amp]\nprecision = "bf16"\naccumulation_steps = 2\nclip_grad_norm = 1.0\n')
    cfg = MixedPrecisionConfig.from_toml(str(p))
    assert (cfg.precision, cfg.accumulation_steps, cfg.clip_grad_norm) == ("bf16", 2, 1.0)
    p.write_text("precision = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        MixedPrecisionConfig.from_toml(str(p))


# ---------------------------------------------------------------- deterministic


@contextlib.contextmanager
def saved_determinism():
    """Restore torch's global determinism flags and CUBLAS_WORKSPACE_CONFIG afterwards."""
    flags = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        if env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


@pytest.mark.parametrize("value", [False, True, "warn"])
def test_deterministic_choices(value):
    cfg = MixedPrecisionConfig(deterministic=value)
    assert cfg.deterministic is value or cfg.deterministic == value
    assert MixedPrecisionConfig.from_dict(cfg.to_dict()) == cfg
    assert MixedPrecisionConfig().deterministic is False


@pytest.mark.parametrize("value", ["yes", "true", 1, 0, None, "Warn "])
def test_deterministic_rejects_other_values(value):
    with pytest.raises(ConfigError) as e:
        MixedPrecisionConfig(deterministic=value)
    msg = str(e.value)
    assert f"deterministic={value!r}" in msg and "False, True, 'warn'" in msg


def test_apply_determinism_false_changes_nothing():
    with saved_determinism():
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = True
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        apply_determinism(False)
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.parametrize("mode", [True, "warn"])
def test_apply_determinism_sets_the_flags(mode):
    with saved_determinism():
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        apply_determinism(mode)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() == (mode == "warn")
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()  # the fixture restored it


def test_apply_determinism_keeps_a_user_cublas_setting_and_rejects_bad_modes():
    with saved_determinism():
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
        apply_determinism(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        with pytest.raises(ConfigError, match="'sometimes'"):
            apply_determinism("sometimes")


def test_precision_as_lightnings_integers():
    """``MixedPrecision(16)`` is fp16 and ``32`` fp32, as ``--precision 16`` and Lightning's
    ``precision=16`` are; a bool is not a precision."""
    assert MixedPrecision(16).precision.name == "fp16"
    assert MixedPrecision(32).precision.name == "fp32"
    with pytest.raises(ConfigError, match="precision=True"):
        MixedPrecision(True)
