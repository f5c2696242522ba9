"""``ampkit serve``'s number flags come from one table (ampkit.service.settings), parsed by one
bounded-number parser; ServiceConfig takes the same bounds, so both refuse the same values."""

import argparse
import math

import pytest

from ampkit.cli import build_parser
from ampkit.cli.common import bounded, positive_float, positive_int
from ampkit.service.settings import SERVE_NUMBERS


def _serve():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _outside(b):
    """Values just outside the setting's bounds, and ones that are no finite number."""
    out = ["soon", "inf", "nan"]
    if b.gt is not None:
        out.append(str(b.gt))
    if b.ge is not None:
        out.append(str(b.ge - 1) if b.kind is int else str(b.ge - 1e-3))
    if b.le is not None:
        out.append(str(b.le + 1))
    return out


@pytest.mark.parametrize("name", list(SERVE_NUMBERS))
def test_each_number_flag_is_the_settings_row(name, capsys):
    b, p = SERVE_NUMBERS[name], _serve()
    action = next(a for a in p._actions if a.dest == name)
    assert action.default == b.default and action.help == b.help
    inside = b.le if b.le is not None else (b.ge if b.ge is not None else b.gt + 1)
    assert getattr(p.parse_args([f"--{name}", str(b.kind(inside))]), name) == b.kind(inside)
    for bad in _outside(b):
        with pytest.raises(SystemExit):
            p.parse_args([f"--{name}", bad])
        assert f"--{name}" in capsys.readouterr().err, bad


def test_service_config_takes_the_same_bounds_and_defaults():
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from ampkit.service.schemas import ServiceConfig

    shared = [n for n in SERVE_NUMBERS if n in ServiceConfig.model_fields]
    assert set(shared) == {
        "max_concurrent",
        "queue_cap",
        "max_params",
        "max_seconds",
        "max_gpu_temp",
        "run_memory_gb",
    }
    for name in shared:
        b = SERVE_NUMBERS[name]
        assert ServiceConfig.model_fields[name].default == b.default
        for bad in _outside(b)[1:]:  # the numbers (the text is the CLI's to refuse)
            with pytest.raises(ValidationError):
                ServiceConfig(
                    **{name: b.kind(float(bad)) if math.isfinite(float(bad)) else float(bad)}
                )


def test_service_config_refuses_booleans_and_text_for_its_numbers():
    """``ServiceConfig(max_params=True)`` was a limit of 1 parameter and ``max_concurrent=True`` one
    run: booleans are not numbers there either, as on the command line and in the request models;
    nor is 1 a boolean (``private_docs``)."""
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from ampkit.service.schemas import ServiceConfig

    for name in ("max_concurrent", "queue_cap", "body_cap", "max_params", "max_seconds", "poll_s"):
        for bad in (True, "8"):
            with pytest.raises(ValidationError, match=name):
                ServiceConfig(**{name: bad})
    with pytest.raises(ValidationError, match="private_docs"):
        ServiceConfig(private_docs=1)
    assert ServiceConfig(max_params=2000, max_seconds=60).max_seconds == 60.0  # an int is a number


def test_an_integer_flag_takes_the_exponent_form_its_help_shows(capsys):
    """``ampkit serve --max_params 2e9`` (its help: "default: 2e9") was refused as "not an integer";
    an integral value in exponent form is an integer, a fractional one still is not."""
    count = bounded(int, ge=1, name="count")
    assert count("2e9") == 2_000_000_000 and isinstance(count("2e9"), int)
    assert count("7.5E9") == 7_500_000_000 and count("12") == 12
    for bad in ("2.5e0", "1e-3", "2.0", "nan", "1e400"):
        with pytest.raises(argparse.ArgumentTypeError):
            count(bad)
    assert _serve().parse_args(["--max_params", "7e9"]).max_params == 7_000_000_000


def test_bounded_names_the_value_and_the_range():
    seconds = bounded(float, gt=0, le=3600, unit="seconds")
    assert seconds("1e-3") == 1e-3 and seconds("3600") == 3600.0
    with pytest.raises(
        argparse.ArgumentTypeError, match="3601.0 must be > 0 and at most 3600 seconds"
    ):
        seconds("3601")
    with pytest.raises(argparse.ArgumentTypeError, match="'soon' is not a number of seconds"):
        seconds("soon")
    with pytest.raises(argparse.ArgumentTypeError, match="must be > 0"):
        seconds("inf")
    with pytest.raises(argparse.ArgumentTypeError, match="'2.5' is not an integer"):
        positive_int("2.5")
    with pytest.raises(argparse.ArgumentTypeError, match="0 must be >= 1"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="0.0 must be > 0"):
        positive_float("0")


@pytest.mark.parametrize(
    "env, said",
    [
        ({}, "a new token for 'default' is written to"),
        ({"AMPKIT_TOKEN": "t"}, "tokens: AMPKIT_TOKEN (owner 'default')"),
        ({"AMPKIT_TOKENS": "alice:a,bob:b"}, "tokens: AMPKIT_TOKENS (owners alice, bob)"),
    ],
)
def test_serve_says_where_its_tokens_come_from(env, said, tmp_path, monkeypatch, capsys):
    """The banner listed every source ("tokens: AMPKIT_TOKENS / AMPKIT_TOKEN / tokens.json")
    whichever was used, so a first start did not say that it had just written a token, or where."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from ampkit.cli import main
    from ampkit.service import server

    for k in ("AMPKIT_TOKEN", "AMPKIT_TOKENS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(server, "serve", lambda *a, announce, **kw: announce())
    assert main(["serve", "--data_dir", str(tmp_path / "svc")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert said in out, out
    (tmp_path / "svc" / "tokens.json").write_text('{"x": "carol"}')
    monkeypatch.delenv("AMPKIT_TOKEN", raising=False)
    monkeypatch.delenv("AMPKIT_TOKENS", raising=False)
    assert main(["serve", "--data_dir", str(tmp_path / "svc")]) == 0
    assert "tokens.json (owners carol)" in " ".join(capsys.readouterr().out.split())
