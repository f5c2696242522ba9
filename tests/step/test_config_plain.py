"""The config without magic: the class's own ``__init__`` (no wrapper assigned onto it), flags and
type checks from resolved type hints, and every field type through the one TOML module."""

import argparse
import dataclasses
import inspect
import math
import typing
from typing import Optional, Union

import pytest

from ampkit import ConfigError, MixedPrecisionConfig
from ampkit.step import config as config_module
from ampkit.step import tomlio
from ampkit.step.config import UnknownConfigKeyError, fields_help, hint_kind, read_toml


def test_init_is_written_in_the_class_not_patched_on():
    init = MixedPrecisionConfig.__init__
    assert init is vars(MixedPrecisionConfig)["__init__"]  # defined in the class body
    assert not hasattr(
        init, "__wrapped__"
    )  # not a functools.wraps wrapper assigned after the class
    assert init.__code__.co_filename == config_module.__file__  # in the source, not generated text
    assert "MixedPrecisionConfig.__init__ =" not in inspect.getsource(config_module)


def test_help_shows_every_field_then_the_aliases():
    params = list(inspect.signature(MixedPrecisionConfig).parameters.values())
    assert [p.name for p in params[:-1]] == [
        f.name for f in dataclasses.fields(MixedPrecisionConfig)
    ]
    assert params[0].default == "auto" and params[-1].kind is inspect.Parameter.VAR_KEYWORD


def test_constructor_keywords_positions_aliases_and_errors_unchanged():
    assert MixedPrecisionConfig("fp16", 1024.0) == MixedPrecisionConfig(
        precision="fp16", init_scale=1024.0
    )
    assert MixedPrecisionConfig(min_loss_scale=2.0).min_scale == 2.0
    assert MixedPrecisionConfig(enabled=False).precision == "fp32"
    assert MixedPrecisionConfig(precision="fp16", scaling_strategy="ADAPTIVE").hysteresis == 2
    with pytest.raises(UnknownConfigKeyError, match="did you mean 'min_scale'"):
        MixedPrecisionConfig(min_scal=1.0)
    with pytest.raises(TypeError, match="multiple values for argument 'precision'"):
        MixedPrecisionConfig("fp16", precision="bf16")
    with pytest.raises(TypeError, match="at most"):
        MixedPrecisionConfig(*range(100))
    with pytest.raises(ConfigError, match="growth_interval=0"):
        MixedPrecisionConfig(growth_interval=0)
    cfg = MixedPrecisionConfig(precision="fp16")
    assert dataclasses.replace(cfg, hysteresis=3) == cfg.replace(hysteresis=3)


def test_field_info_is_read_from_resolved_hints():
    hints = typing.get_type_hints(MixedPrecisionConfig)
    by_name = {f.name: f for f in fields_help()}
    assert by_name["min_scale"].hint == hints["min_scale"] == Optional[float]
    assert (
        by_name["min_scale"].kind,
        by_name["min_scale"].optional,
        by_name["min_scale"].toggle,
    ) == (float, True, False)
    assert (by_name["fallback"].kind, by_name["fallback"].toggle) == (bool, True)
    assert (by_name["growth_interval"].kind, by_name["growth_interval"].optional) == (int, False)
    assert by_name["keep_fp32"].kind is object


@pytest.mark.parametrize(
    "hint,expected",
    [
        (Optional[float], (float, True, False)),
        (Union[bool, str], (bool, False, True)),
        (int, (int, False, False)),
        (Optional[int], (int, True, False)),
        (tuple, (object, False, False)),
        (Union[None, str], (str, True, False)),
    ],
)
def test_hint_kind_reads_types_not_text(hint, expected):
    assert hint_kind(hint) == expected


def test_flag_of_an_optional_float_hint_parses_floats_and_none(monkeypatch):
    """A field whose (resolved) hint is Optional[float] yields a float flag that accepts none; the
    annotation text is not read (here it says nothing useful)."""
    from ampkit.cli.flags import add_engine_flags

    real = fields_help()
    fake = [
        dataclasses.replace(f, annotation="?") if f.name == "clip_grad_norm" else f for f in real
    ]
    monkeypatch.setattr("ampkit.cli.flags.fields_help", lambda: fake)
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert p.parse_args(["--clip_grad_norm", "1e-3"]).clip_grad_norm == 1e-3
    assert p.parse_args(["--clip_grad_norm", "none"]).clip_grad_norm is None
    with pytest.raises(SystemExit):
        p.parse_args(["--clip_grad_norm", "abc"])


def test_every_field_type_round_trips_through_toml(tmp_path):
    cfg = MixedPrecisionConfig(
        precision="fp16",
        init_scale=1e-3,
        growth_factor=3.5,
        hysteresis=2,
        min_scale=1e-3,
        max_scale=None,
        consecutive_hysteresis=True,
        dynamic_scaling=False,
        clip_grad_norm=0.25,
        keep_fp32=("lm_head", '*."q"\n'),
        fallback="fp16,bf16,fp32",
        deterministic="warn",
        fallback_recover_after=None,
    )
    path = tomlio.write(str(tmp_path / "c.toml"), tomlio.dumps({"amp": cfg.to_dict()}))
    assert MixedPrecisionConfig.from_toml(path) == cfg
    strings = {
        "q": 'say "hi"\n\tthen \\ leave',
        "l": [1.0, 1e-3, -0.0, math.inf],
        "b": False,
        "n": None,
    }
    back = read_toml(tomlio.write(str(tmp_path / "s.toml"), tomlio.dumps({"t": strings})))["t"]
    assert back == {k: v for k, v in strings.items() if v is not None}


def test_toml_write_is_atomic_and_sets_the_mode(tmp_path, monkeypatch):
    path = tmp_path / "run.toml"
    path.write_text("[amp]\nprecision = 'fp16'\n")

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tomlio.os, "fsync", full_disk)
    with pytest.raises(OSError):
        tomlio.write(str(path), "[amp]\nprecision = 'bf16'\n")
    assert path.read_text() == "[amp]\nprecision = 'fp16'\n" and [
        p.name for p in tmp_path.iterdir()
    ] == ["run.toml"]
    monkeypatch.undo()
    tomlio.write(str(path), "[amp]\n", mode=0o600)
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text() == "[amp]\n"


def test_bad_toml_is_a_config_error_naming_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[amp\n")
    with pytest.raises(ConfigError, match="bad.toml.*is not valid TOML"):
        read_toml(str(bad))
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_toml(str(bad))


# A run file as the service wrote it before ampkit.step.tomlio (the hand-written writer), sealed.
OLD_RUN_FILE = (
    "# ampkit run file: written by ampkit serve; its last line is the sha256 of the lines above it\n"
    '[train]\nmodel = "gpt"\nsteps = 4\ndata = "/r/texts.json"\nlr = 0.0003\n\n[amp]\n'
    'precision = "fp16"\nkeep_fp32 = ["lm_head", "a\\"b"]\nclip_grad_norm = 1.0\n'
    "# end sha256=b0351b0b691522468aa52dea9115e2c41e80bb9b76c85cd8a685e647fe69081c\n"
)


def test_run_files_written_before_still_load_and_new_ones_seal_the_same_way(tmp_path):
    from ampkit.service.runfile import check_run_file, write_run_file

    old = tmp_path / "old.toml"
    old.write_text(OLD_RUN_FILE)
    data = read_toml(str(old))
    assert data["train"]["lr"] == 3e-4 and data["amp"]["keep_fp32"] == ["lm_head", 'a"b']
    assert MixedPrecisionConfig.from_toml(str(old)).keep_fp32 == ("lm_head", 'a"b')
    old.write_text(OLD_RUN_FILE.replace("steps = 4", "steps = 5"))
    with pytest.raises(ConfigError, match="damaged"):
        read_toml(str(old))
    path = write_run_file(
        {"model": "gpt", "steps": 4, "amp": {"precision": "fp16"}}, str(tmp_path / "run")
    )
    check_run_file(str(tmp_path / "run"))
    assert (
        read_toml(path)["train"]["steps"] == 4
        and (tmp_path / "run" / "run.toml").stat().st_mode & 0o777 == 0o600
    )


@pytest.mark.parametrize("keep", ["nothing", "half of the head line", "the head line only"])
def test_a_run_file_cut_before_its_first_setting_is_refused_not_read_as_an_empty_config(
    tmp_path, keep
):
    """A run file cut to 0 bytes or inside its head line is still valid TOML (nothing in it, or a
    comment): read as a config it would train every default (100 steps of gpt instead of the
    run's 40 of mlp). It is refused as a damaged run file, as a cut further down is."""
    from ampkit.step.config import RUN_FILE_HEAD, seal_run_file

    whole = seal_run_file('model = "mlp"\nsteps = 40\n')
    cut = {"nothing": "", "half of the head line": RUN_FILE_HEAD[:30]}.get(keep, RUN_FILE_HEAD)
    assert whole.startswith(cut)
    path = tmp_path / "run.toml"
    path.write_text(cut)
    with pytest.raises(ConfigError, match=r"run.toml.* is (damaged|empty)"):
        read_toml(str(path))
    path.write_text("\n  \n")  # only blank lines: nothing a run could be read from
    with pytest.raises(ConfigError, match="empty"):
        read_toml(str(path))
    path.write_text(f"{RUN_FILE_HEAD[:30]}\nsteps = 4\n")  # a user's file that merely starts alike
    assert read_toml(str(path)) == {"steps": 4}


def test_tune_recommendation_with_quotes_reads_back():
    """The tune file's values are written by the TOML writer (a model spelling with quotes once broke it)."""
    from ampkit.choose.recommend import Recommendation

    rec = Recommendation(
        precision="bf16-pure:split",
        step_ms=1.0,
        speedup_vs_fp32=1.5,
        loss_gap=0.0,
        tolerance=0.01,
        batch_size=8,
        accumulation_steps=1,
        why_not={},
        model='pkg.mod:make"it"',
        size="tiny",
    )
    back = tomlio.loads(rec.to_toml().encode())
    assert back["amp"] == rec.config and back["train"] == {
        "model": 'pkg.mod:make"it"',
        "size": "tiny",
        "batch_size": 8,
    }
