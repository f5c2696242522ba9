import pytest
import torch

from ampkit import ConfigError, MixedPrecisionConfig, PrecisionError


def test_defaults_match_torch_gradscaler():
    cfg = MixedPrecisionConfig()
    gs = torch.amp.GradScaler("cpu")
    assert cfg.init_scale == gs.get_scale()
    assert cfg.growth_factor == gs.get_growth_factor()
    assert cfg.backoff_factor == gs.get_backoff_factor()
    assert cfg.growth_interval == gs.get_growth_interval()
    assert cfg.hysteresis == 1 and cfg.min_scale is None and cfg.max_scale is None


@pytest.mark.parametrize("field,value,fragment", [
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
])
def test_invalid_values_name_field_and_range(field, value, fragment):
    with pytest.raises(ConfigError) as e:
        MixedPrecisionConfig(**{field: value})
    assert field in str(e.value) and fragment in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("field,value", [("growth_interval", 2.5), ("accumulation_steps", "4"),
                                         ("dynamic_scaling", 1), ("hysteresis", True)])
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
    cfg = MixedPrecisionConfig(precision="fp16", init_scale=1024, hysteresis=3, min_scale=1.0,
                               accumulation_steps=4, clip_grad_norm=1.0)
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
