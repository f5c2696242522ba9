"""Config names from other tools (the seed guides, DeepSpeed, torch.autocast) are accepted by every
config reader through one table (ampkit.step.aliases); other unknown keys get a "did you mean"."""

import enum

import pytest
import torch

from ampkit import MixedPrecision, MixedPrecisionConfig
from ampkit.cli.flags import ALIASES
from ampkit.step.aliases import KEY_ALIASES, SCALING_STRATEGIES
from ampkit.step.config import ConfigError, UnknownConfigKeyError, fields_help

FIELDS = {f.name for f in fields_help()}
# a value of the right type for every field an alias may name
VALUES = {"min_scale": 4.0, "max_scale": 2.0**20, "growth_interval": 7, "init_scale": 256.0, "autocast_cache": False,
          "precision": "fp16", "growth_factor": 4.0, "backoff_factor": 0.25, "accumulation_steps": 3,
          "clip_grad_norm": 0.5, "fallback": True}


def test_every_alias_names_a_field_and_every_cli_alias_is_in_the_table():
    assert set(KEY_ALIASES.values()) <= FIELDS
    assert not set(KEY_ALIASES) & FIELDS
    for field, spellings in ALIASES.items():  # the CLI's flag aliases are config aliases too
        for s in spellings:
            assert KEY_ALIASES[s] == field


@pytest.mark.parametrize("alias", sorted(KEY_ALIASES))
def test_each_alias_sets_its_field_in_every_python_reader(alias):
    field = KEY_ALIASES[alias]
    value = VALUES[field]
    direct = MixedPrecisionConfig(**{field: value})
    assert MixedPrecisionConfig(**{alias: value}) == direct
    assert MixedPrecisionConfig.from_dict({alias: value}) == direct
    assert MixedPrecisionConfig().replace(**{alias: value}) == direct
    assert MixedPrecision(device="cpu", **{alias: value}).config == direct


def test_seed_guide_names_in_one_config():
    cfg = MixedPrecisionConfig(mixed_precision_dtype=torch.float16, min_loss_scale=1.0, max_loss_scale=2.0**24,
                               loss_scale_window=500, mixed_precision_autocast_cache_enabled=False,
                               mixed_precision_grad_scaler_growth_factor=3.0, automatic_fallback="fp16,fp32")
    assert (cfg.precision, cfg.min_scale, cfg.max_scale, cfg.growth_interval, cfg.autocast_cache,
            cfg.growth_factor, cfg.fallback) == ("fp16", 1.0, 2.0**24, 500, False, 3.0, "fp16,fp32")


class ScalingStrategy(enum.Enum):  # as the seed guides spell it
    CONSTANT = "constant"
    DYNAMIC = "dynamic"
    ADAPTIVE = "adaptive"


@pytest.mark.parametrize("spelling", [lambda s: s, lambda s: s.name, lambda s: f"ScalingStrategy.{s.name}",
                                      lambda s: s.value])
@pytest.mark.parametrize("strategy", list(ScalingStrategy))
def test_scaling_strategy_means_its_fields(strategy, spelling):
    cfg = MixedPrecisionConfig(precision="fp16", scaling_strategy=spelling(strategy))
    for k, v in SCALING_STRATEGIES[strategy.value].items():
        assert getattr(cfg, k) == v
    assert cfg == MixedPrecisionConfig(precision="fp16", **SCALING_STRATEGIES[strategy.value])


def test_constant_strategy_keeps_the_scale_constant_in_training():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp16", device="cpu", scaling_strategy="CONSTANT", init_scale=2.0**8,
                         loss_scale_window=1)
    model, opt = amp.setup(model, opt)
    for _ in range(3):
        with amp.autocast():
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        amp.backward(loss)
        amp.step(opt)
    assert amp.get_scale() == 2.0**8  # growth_interval 1 would have grown a dynamic scale 3 times


def test_unknown_keys_get_did_you_mean_and_the_valid_keys():
    with pytest.raises(UnknownConfigKeyError) as e:
        MixedPrecisionConfig.from_dict({"min_scal": 1.0})
    msg = str(e.value)
    assert "unknown config key 'min_scal' (did you mean 'min_scale'?)" in msg and "valid keys: precision" in msg
    with pytest.raises(TypeError, match="did you mean 'min_loss_scale', an alias of 'min_scale'"):
        MixedPrecisionConfig(min_loss_scal=1.0)  # also a TypeError, as an unexpected keyword was
    with pytest.raises(ConfigError, match="'zzz'; valid keys"):
        MixedPrecision("fp16", zzz=1)


def test_alias_and_field_with_different_values_is_an_error_same_value_is_fine():
    with pytest.raises(ConfigError, match="min_loss_scale=1.0 and min_scale=2.0 both set min_scale"):
        MixedPrecisionConfig.from_dict({"min_scale": 2.0, "min_loss_scale": 1.0})
    assert MixedPrecisionConfig.from_dict({"min_scale": 2.0, "min_loss_scale": 2.0}).min_scale == 2.0
    with pytest.raises(ConfigError, match="scaling_strategy='SOMETIMES'.*CONSTANT, DYNAMIC, ADAPTIVE"):
        MixedPrecisionConfig(scaling_strategy="SOMETIMES")


def test_toml_amp_table_accepts_aliases(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[amp]\ndtype = "fp16"\nloss_scale_window = 50\nscaling_strategy = "ADAPTIVE"\n')
    cfg = MixedPrecisionConfig.from_toml(str(path))
    assert (cfg.precision, cfg.growth_interval, cfg.hysteresis) == ("fp16", 50, 2)


def test_service_amp_dict_accepts_aliases_and_suggests():
    pytest.importorskip("pydantic")
    from ampkit.service.schemas import RunSpec

    spec = RunSpec(amp={"min_loss_scale": 1.0, "automatic_fallback": False, "cache_enabled": False})
    assert spec.amp == {"min_scale": 1.0, "fallback": False, "autocast_cache": False}
    with pytest.raises(ValueError, match="did you mean 'hysteresis'"):
        RunSpec(amp={"hysterisis": 2})
    with pytest.raises(ValueError, match="precision as the run's own field"):
        RunSpec(amp={"dtype": "bf16"})
