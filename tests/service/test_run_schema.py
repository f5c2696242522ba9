"""A run request and ``ampkit train`` are one schema (issue 35 item 5): every RunSpec field travels
to the run as a ``[train]`` key of its ``run.toml`` (:mod:`ampkit.service.runfile`), and what the
service accepts, training accepts, with the same types, choices, lower bounds and defaults; where
they differ it is on purpose, listed with the reason (``SERVICE_DEFAULTS``, ``SERVICE_CAPS``,
``TRAIN_ONLY``, ``SERVICE_ONLY``). The probes go the way a run goes: the request, its run file, the
train command's ``--config`` reader and the engine's config."""

from __future__ import annotations

import math
import typing

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError  # noqa: E402

from ampkit.cli import build_parser  # noqa: E402
from ampkit.cli.config_file import NOT_FROM_FILE  # noqa: E402
from ampkit.cli.flags import ENGINE_FIELDS, engine_config  # noqa: E402
from ampkit.cli.invocation import parse_invocation, subparser  # noqa: E402
from ampkit.service.runfile import (  # noqa: E402
    SERVICE_CAPS,
    SERVICE_DEFAULTS,
    SERVICE_ONLY,
    TRAIN_ONLY,
    dumps_toml,
    run_tables,
    train_key,
)
from ampkit.service.schemas import RunSpec  # noqa: E402
from ampkit.step.config import MixedPrecisionConfig  # noqa: E402

PARSER = build_parser()
TRAIN = subparser(PARSER, "train")
FIELDS = RunSpec.model_fields


def _train(spec: dict, tmp_path):
    """``(args, config)`` of ``ampkit train --config run.toml`` for ``spec``, or the ValueError."""
    path = tmp_path / "run.toml"
    path.write_text(dumps_toml(run_tables(spec, str(tmp_path))))
    argv = ["train", "--config", str(path)]
    try:
        inv = parse_invocation(PARSER, PARSER.parse_args(argv), argv)
        return inv.args, engine_config(inv.args, inv.flags_given, inv.file.amp)
    except ValueError as e:
        return e


def _service_accepts(name: str, value) -> bool:
    try:
        RunSpec(**{name: value})
    except ValidationError:
        return False
    return True


def _kind(name: str) -> type:
    ann = FIELDS[name].annotation
    kind = next((a for a in typing.get_args(ann) if a is not type(None)), ann)  # Optional[X] -> X
    return typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Annotated else kind


def _bounds(name: str) -> dict[str, float]:
    out = {}
    for m in FIELDS[name].metadata:
        for k in ("gt", "ge", "lt", "le"):
            if getattr(m, k, None) is not None:
                out[k] = getattr(m, k)
    return out


NUMBERS = [n for n in FIELDS if n not in SERVICE_ONLY and _kind(n) in (int, float)]


def _probes(name: str) -> list:
    """Values on each side of the field's bounds (the service's, and the 64-bit integer range), and
    a value of the other type."""
    kind, b = _kind(name), _bounds(name)
    step = (lambda v, d: v + d) if kind is int else (lambda v, d: math.nextafter(v, d * math.inf))
    out = [0, 1, -1, 0.5, 1.5, True, 2**63, -(2**63) - 1]
    for k in ("gt", "ge", "le", "lt"):
        if k in b:
            out += [b[k], step(b[k], -1), step(b[k], 1)]
    return [
        kind(v) if kind is float and not isinstance(v, bool) and abs(v) < 1e300 else v for v in out
    ]


@pytest.mark.parametrize("name", NUMBERS)
def test_every_number_the_service_takes_trains_and_only_its_caps_are_tighter(name, tmp_path):
    """A value the service accepts is one training accepts (no run refused at start); a value only
    training accepts is above a listed cap (never below a lower bound, never another type)."""
    assert NUMBERS, "no number fields found"
    capped_above = []
    for value in _probes(name):
        ok = _service_accepts(name, value)
        trained = _train({**RunSpec().model_dump(), name: value}, tmp_path)
        train_ok = not isinstance(trained, ValueError)
        assert train_ok or not ok, (
            f"{name}={value!r}: the service accepts it, ampkit train refuses: {trained}"
        )
        if train_ok and not ok:
            upper = _bounds(name).get("le", _bounds(name).get("lt"))
            assert upper is not None and value > upper, (
                f"{name}={value!r}: ampkit train accepts it, the service refuses it (a lower bound or type differs)"
            )
            capped_above.append(value)
    assert bool(capped_above) == (name in SERVICE_CAPS), (
        f"{name}: SERVICE_CAPS must list exactly the fields whose upper bound training does not have"
    )


def test_choices_are_the_same_names():
    size = next(a for a in TRAIN._actions if a.dest == "size")
    assert typing.get_args(FIELDS["size"].annotation) == tuple(size.choices)
    for choice in size.choices:
        assert _service_accepts("size", choice)
    assert not _service_accepts("size", "huge")


def test_an_empty_request_trains_like_ampkit_train_but_for_the_listed_defaults(tmp_path):
    args, config = _train(RunSpec().model_dump(), tmp_path)
    plain = PARSER.parse_args(["train"])
    differ = {k for k, v in vars(plain).items() if k != "config" and getattr(args, k) != v}
    assert differ == set(SERVICE_DEFAULTS), (
        "a RunSpec default differs from ampkit train's: list it with a reason"
    )
    for name, (value, why) in SERVICE_DEFAULTS.items():
        assert FIELDS[name].default == value == getattr(args, train_key(name)) and why
    assert config == engine_config(plain, frozenset(), {})


def test_every_train_option_is_a_run_field_an_amp_key_or_excluded_with_a_reason():
    dests = {a.dest for a in TRAIN._actions if a.option_strings and a.dest not in NOT_FROM_FILE}
    carried = {train_key(f) for f in FIELDS if f not in SERVICE_ONLY}
    assert carried <= dests, f"RunSpec fields that are no ampkit train option: {carried - dests}"
    through_amp = set(ENGINE_FIELDS) - carried
    assert dests - carried - through_amp == set(TRAIN_ONLY)
    assert all(why for why in TRAIN_ONLY.values()) and all(why for why in SERVICE_ONLY.values())
    defaults = MixedPrecisionConfig().to_dict()
    for name in sorted(through_amp):  # each engine field a run may set in its amp dict
        assert RunSpec(amp={name: defaults[name]}).amp == {name: defaults[name]}, name
