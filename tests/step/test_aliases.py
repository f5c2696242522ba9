"""Config names from other tools (the seed guides, DeepSpeed, torch.autocast) are accepted by every
config reader through one table (ampkit.step.aliases); other unknown keys get a "did you mean"."""

import enum
import functools
import importlib.util

import pytest
import torch

from ampkit import MixedPrecision, MixedPrecisionConfig
from ampkit.cli.flags import ALIASES
from ampkit.step.aliases import (
    FLAG_ALIASES,
    KEY_ALIASES,
    PRECISION_ALIASES,
    SCALING_STRATEGIES,
    SHOWN_PRECISION_ALIASES,
)
from ampkit.step.config import ConfigError, UnknownConfigKeyError, canonical_precision, fields_help
from ampkit.step.precision import REGISTRY, parse_precision

FIELDS = {f.name for f in fields_help()}
# a value of the right type for every field an alias may name
VALUES = {
    "min_scale": 4.0,
    "max_scale": 2.0**20,
    "growth_interval": 7,
    "init_scale": 256.0,
    "autocast_cache": False,
    "precision": "fp16",
    "growth_factor": 4.0,
    "backoff_factor": 0.25,
    "accumulation_steps": 3,
    "clip_grad_norm": 0.5,
    "fallback": True,
}


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
    cfg = MixedPrecisionConfig(
        mixed_precision_dtype=torch.float16,
        min_loss_scale=1.0,
        max_loss_scale=2.0**24,
        loss_scale_window=500,
        mixed_precision_autocast_cache_enabled=False,
        mixed_precision_grad_scaler_growth_factor=3.0,
        automatic_fallback="fp16,fp32",
    )
    assert (
        cfg.precision,
        cfg.min_scale,
        cfg.max_scale,
        cfg.growth_interval,
        cfg.autocast_cache,
        cfg.growth_factor,
        cfg.fallback,
    ) == ("fp16", 1.0, 2.0**24, 500, False, 3.0, "fp16,fp32")


class ScalingStrategy(enum.Enum):  # as the seed guides spell it
    CONSTANT = "constant"
    DYNAMIC = "dynamic"
    ADAPTIVE = "adaptive"


@pytest.mark.parametrize(
    "spelling",
    [lambda s: s, lambda s: s.name, lambda s: f"ScalingStrategy.{s.name}", lambda s: s.value],
)
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
    amp = MixedPrecision(
        "fp16", device="cpu", scaling_strategy="CONSTANT", init_scale=2.0**8, loss_scale_window=1
    )
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
    assert (
        "unknown config key 'min_scal' (did you mean 'min_scale'?)" in msg
        and "valid keys: precision" in msg
    )
    with pytest.raises(TypeError, match="did you mean 'min_loss_scale', an alias of 'min_scale'"):
        MixedPrecisionConfig(min_loss_scal=1.0)  # also a TypeError, as an unexpected keyword was
    with pytest.raises(ConfigError, match="'zzz'; valid keys"):
        MixedPrecision("fp16", zzz=1)


def test_alias_and_field_with_different_values_is_an_error_same_value_is_fine():
    with pytest.raises(
        ConfigError, match="min_loss_scale=1.0 and min_scale=2.0 both set min_scale"
    ):
        MixedPrecisionConfig.from_dict({"min_scale": 2.0, "min_loss_scale": 1.0})
    assert (
        MixedPrecisionConfig.from_dict({"min_scale": 2.0, "min_loss_scale": 2.0}).min_scale == 2.0
    )
    with pytest.raises(
        ConfigError, match="scaling_strategy='SOMETIMES'.*CONSTANT, DYNAMIC, ADAPTIVE"
    ):
        MixedPrecisionConfig(scaling_strategy="SOMETIMES")


def test_toml_amp_table_accepts_aliases(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[amp]\ndtype = "fp16"\nloss_scale_window = 50\nscaling_strategy = "ADAPTIVE"\n'
    )
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


# ---- one table, every surface (issue 35 item 5): precision spellings and config-key aliases ----


@functools.lru_cache(maxsize=1)
def _parser():
    from ampkit.cli import build_parser

    return build_parser()


def _train_config(argv, tmp_path=None, toml=None):
    from ampkit.cli.flags import engine_config
    from ampkit.cli.invocation import parse_invocation

    if toml is not None:
        path = tmp_path / "c.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    parser = _parser()
    inv = parse_invocation(parser, parser.parse_args(["train", *argv]), ["train", *argv])
    return engine_config(inv.args, inv.flags_given, inv.file.amp)


@pytest.mark.parametrize("alias", sorted(PRECISION_ALIASES))
def test_every_surface_takes_every_precision_alias(alias, tmp_path):
    """Python API, command line, TOML ([amp] and [train]), the service's run field and its brief's
    ``dtype``, and a run's file read back by ``ampkit train``: each alias is the same precision."""
    expected = canonical_precision(PRECISION_ALIASES[alias])
    for spelling in (alias, alias.upper()):
        assert MixedPrecisionConfig(precision=spelling).precision == expected
        assert MixedPrecisionConfig(dtype=spelling).precision == expected  # a key alias with it
        assert _train_config(["--precision", spelling]).precision == expected
        assert _train_config(["--mixed_precision", spelling]).precision == expected
    assert _train_config([], tmp_path, f'[amp]\nprecision = "{alias}"\n').precision == expected
    assert (
        _train_config([], tmp_path, f'[train]\nmixed_precision = "{alias}"\n').precision == expected
    )
    if importlib.util.find_spec("fastapi") is None:
        return
    from ampkit.service.runfile import dumps_toml, run_tables
    from ampkit.service.schemas import MixedPrecisionBody, RunSpec

    spec = RunSpec(precision=alias).model_dump()
    assert MixedPrecisionBody(dtype=alias).dtype == alias
    run_file = dumps_toml(run_tables(spec, str(tmp_path)))
    assert _train_config([], tmp_path, run_file).precision == expected


def test_each_rows_lightning_and_accelerate_names_come_back_through_the_table():
    """The other direction (a row's name in Lightning / Accelerate) is read back by the alias
    table to a precision that computes in the same dtype (Lightning: and stores the same weights)."""
    for row in REGISTRY.values():
        back = REGISTRY[parse_precision(row.lightning_name)]
        assert (back.param_dtype, back.compute_dtype) == (row.param_dtype, row.compute_dtype), (
            row.name
        )
        assert REGISTRY[parse_precision(row.accelerate_name)].compute_dtype == row.compute_dtype, (
            row.name
        )
    assert all(
        parse_precision(a) for a in SHOWN_PRECISION_ALIASES
    )  # what an error lists is in the table
    assert not set(PRECISION_ALIASES) & set(REGISTRY)  # an alias never shadows a name


@pytest.mark.parametrize("alias", sorted(KEY_ALIASES))
def test_every_surface_takes_every_config_key_alias(alias, tmp_path):
    """The [amp] table and the service's ``amp`` dict take every key alias (the run's own fields
    -- precision, accumulation_steps, init_scale -- are refused in ``amp``, naming the field);
    ``ampkit train`` takes the flag aliases as flags and [train] keys."""
    field, value = KEY_ALIASES[alias], VALUES[KEY_ALIASES[alias]]
    direct = MixedPrecisionConfig(**{field: value})
    text = (
        f"{value}".lower()
        if isinstance(value, bool)
        else f'"{value}"'
        if isinstance(value, str)
        else f"{value}"
    )
    assert getattr(_train_config([], tmp_path, f"[amp]\n{alias} = {text}\n"), field) == getattr(
        direct, field
    )
    if alias in FLAG_ALIASES:
        flag = [f"--{alias}"] if isinstance(value, bool) else [f"--{alias}", str(value)]
        assert getattr(_train_config(flag), field) == getattr(direct, field)
        assert getattr(
            _train_config([], tmp_path, f"[train]\n{alias} = {text}\n"), field
        ) == getattr(direct, field)
    if importlib.util.find_spec("fastapi") is None:
        return
    from ampkit.service.schemas import RunSpec

    if field in ("precision", "accumulation_steps", "init_scale"):
        with pytest.raises(ValueError, match=f"{field} as the run's own field"):
            RunSpec(amp={alias: value})
    else:
        assert RunSpec(amp={alias: value}).amp == {field: getattr(direct, field)}
