"""The memory-ladder rung is one typed value, parsed once, spelled ``bf16-pure:split`` everywhere
(issue 35 item 2): the Python API, the config and its TOML, ``--precision``, the service, bench rows."""

from __future__ import annotations

import ast
import pathlib

import pytest

from ampkit import MixedPrecision
from ampkit.step.config import ConfigError, MixedPrecisionConfig
from ampkit.step.rung import LADDER, MASTERS, Rung, RungError, join_spec, ladder_specs, split_spec

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "ampkit"


def test_the_rung_value_parses_and_spells_back():
    for rung in (*LADDER, Rung("none")):
        assert Rung.parse(str(rung)) == rung
    assert (
        str(Rung("stochastic", "bf16")) == "stochastic+bf16"
        and Rung().plain
        and Rung("none").stalls
    )
    assert split_spec("bf16-pure:kahan") == ("bf16-pure", Rung("kahan"))
    assert split_spec("BF16-TRUE:split+bf16") == (
        "bf16-pure",
        Rung("split", "bf16"),
    )  # the alias, canonical
    assert split_spec("O2:split") == ("O2", Rung("split"))  # O2 resolves to a pure form later
    assert split_spec("fp16") == ("fp16", None)
    assert join_spec("bf16-pure", Rung("stochastic", "bf16")) == "bf16-pure:stochastic+bf16"
    assert (
        Rung("split").bytes_per_param() == 12 and Rung("stochastic", "bf16").bytes_per_param() == 6
    )


@pytest.mark.parametrize(
    "spec,words",
    [
        ("bf16-pure:halves", ["'bf16-pure:halves'", "split, kahan"]),
        ("bf16-pure:split+fp8", ["<masters>[+bf16]"]),
        ("bf16:split", ["bf16 has no ladder", "bf16-pure:split"]),
        ("fp16-pure:stochastic", ["bf16-pure:stochastic"]),
    ],
)
def test_a_bad_rung_is_refused_naming_the_valid_choices(spec, words):
    for parse in (split_spec, lambda s: MixedPrecisionConfig(precision=s)):
        with pytest.raises(ValueError) as e:
            parse(spec)
        assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(RungError, match="masters='fast'.*fp32, split, kahan, stochastic, none"):
        Rung("fast")  # type: ignore[arg-type]


def test_the_spelling_and_the_separate_fields_are_one_value():
    spelled = MixedPrecisionConfig(precision="bf16-pure:stochastic+bf16")
    fields = MixedPrecisionConfig(precision="bf16-pure", masters="stochastic", state_dtype="bf16")
    assert (
        spelled == fields
        and spelled.precision == "bf16-pure"
        and spelled.spec == "bf16-pure:stochastic+bf16"
    )
    assert spelled.rung == Rung("stochastic", "bf16")
    assert MixedPrecisionConfig(
        precision="bf16-pure:split", masters="split"
    ) == MixedPrecisionConfig(precision="bf16-pure:split")  # saying the same thing twice is fine
    with pytest.raises(
        ConfigError, match="says masters='split', but masters='kahan'.*one of: fp32, split"
    ):
        MixedPrecisionConfig(precision="bf16-pure:split", masters="kahan")
    # a precision with its rung replaces the rung; the old separate fields do not contradict it
    assert fields.replace(precision="bf16-pure:split").spec == "bf16-pure:split"
    assert MixedPrecisionConfig.from_dict(spelled.to_dict()) == spelled
    with pytest.raises(ConfigError, match="allow_stall"):
        MixedPrecisionConfig(precision="bf16-pure:none", allow_stall=False)
    assert MixedPrecisionConfig(
        precision="bf16-pure:none"
    ).allow_stall  # spelling the rung forces it


def test_the_engine_takes_the_spelling_and_the_fields(tmp_path):
    assert MixedPrecision("bf16-pure:split", device="cpu").config.spec == "bf16-pure:split"
    assert (
        MixedPrecision("bf16-pure", device="cpu", masters="kahan").config.spec == "bf16-pure:kahan"
    )
    path = tmp_path / "amp.toml"
    path.write_text('[amp]\nprecision = "bf16-pure:stochastic+bf16"\n')
    assert MixedPrecisionConfig.from_toml(str(path)).rung == Rung("stochastic", "bf16")
    with pytest.raises(ValueError, match="bf16-pure:split"):
        MixedPrecision("bf16:split", device="cpu")


def test_the_cli_and_the_bench_rows_spell_it_the_same():
    from ampkit.choose.bench import RUNGS
    from ampkit.cli import build_parser
    from ampkit.cli.flags import engine_config, precision_list
    from ampkit.cli.invocation import parse_invocation

    argv = ["train", "--precision", "bf16-pure:stochastic+bf16"]
    parser = build_parser()
    inv = parse_invocation(parser, parser.parse_args(argv), argv)
    assert (
        engine_config(inv.args, inv.flags_given, inv.file.amp).spec == "bf16-pure:stochastic+bf16"
    )
    assert precision_list("fp32,bf16-pure:split") == ["fp32", "bf16-pure:split"]
    assert ladder_specs() == RUNGS and all(split_spec(r)[1] in LADDER for r in RUNGS)


def test_the_service_takes_the_spelling():
    pytest.importorskip("pydantic")
    from ampkit.service.schemas import RecommendSpec, RunSpec

    assert RunSpec(precision="bf16-pure:split").precision == "bf16-pure:split"
    assert RecommendSpec(precisions="fp32,bf16-pure:kahan").precisions == "fp32,bf16-pure:kahan"
    with pytest.raises(ValueError, match="bf16-pure:split"):
        RunSpec(precision="bf16:split")


def test_the_list_of_masters_is_spelled_once():
    """No module but ``step/rung.py`` writes the masters out as a list, tuple, set or table."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).as_posix() == "step/rung.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            elts = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and elts:
                names = {e.value for e in elts if isinstance(e, ast.Constant)}
                if len(names & set(MASTERS)) >= 3:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not found, f"the masters spelled again: {found}"
