"""The precision registry: one frozen row per precision, asked by every other module (issue 35).

``fp8-rowwise`` is the proof that adding a precision is adding a row: it is fp8 with torchao's
``rowwise`` recipe, and nothing outside ``step/precision.py`` names it.
"""

import dataclasses

import pytest
import torch

from ampkit import MixedPrecision, PrecisionError
from ampkit.step.config import ConfigError
from ampkit.step.fallback import resolve_chain
from ampkit.step.hardware import DeviceInfo
from ampkit.step.precision import (
    CANONICAL,
    NAMES,
    PLAN_PRECISIONS,
    REFERENCE,
    REGISTRY,
    parse_precision,
    precision_row,
    resolve_precision,
)

from ..support.helpers import train_tiny_gpt

CPU = DeviceInfo(type="cpu", name="cpu", bf16=True, fp16=True)


def test_every_row_is_frozen_named_and_consistent():
    for name, row in REGISTRY.items():
        assert row.name == name and parse_precision(name) == name and name in CANONICAL
        with pytest.raises(dataclasses.FrozenInstanceError):
            row.name = "x"  # type: ignore[misc]
        assert row.family in ("full", "autocast", "pure", "fp8")
        assert row.opt_level in ("O0", "O1", "O2", "-")
        assert row.lightning_name in ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
        assert row.accelerate_name in ("no", "bf16", "fp16", "fp8")
        # the successors end in the reference, without a cycle
        seen, nxt = {name}, row.successor
        while nxt is not None:
            assert nxt in REGISTRY and nxt not in seen
            seen.add(nxt)
            nxt = REGISTRY[nxt].successor
        assert REFERENCE in seen
        if row.twin is not None:  # twins differ only by the scaler: same dtypes' sizes, one scales
            twin = REGISTRY[row.twin]
            assert twin.twin == name and twin.needs_scaler != row.needs_scaler
            assert twin.keeps_masters == row.keeps_masters
        for form in (row.o1_form, row.o2_form):
            assert form is None or form in REGISTRY
        if row.o2_form is not None:
            assert REGISTRY[row.o2_form].keeps_masters
        if row.hardware is not None or row.min_capability is not None:
            assert row.requirement  # the sentence that says what the device lacks
    assert set(PLAN_PRECISIONS) <= set(NAMES) and PLAN_PRECISIONS[0] == REFERENCE


def test_precision_carries_its_row_and_the_old_api_still_answers():
    p = resolve_precision("bf16-true", CPU)
    assert (
        p.row is REGISTRY["bf16-pure"] and p.is_pure and p.family == "pure" and not p.reduced_matmul
    )
    assert resolve_precision("tf32", CPU).reduced_matmul
    assert precision_row("16-mixed").lightning_name == "16-mixed"
    with pytest.raises(PrecisionError, match="depends on the device"):
        precision_row("auto")


def test_fp8_rowwise_is_a_name_with_its_own_row():
    row = precision_row("FP8_rowwise")
    assert row.name == "fp8-rowwise" and row.fp8_recipe == "rowwise" and row.family == "fp8"
    # the places that went wrong quietly for a new name: Lightning reported fp32, the activation
    # estimate tried to follow torchao's casts, the fallback went straight to fp32
    assert row.lightning_name == "bf16-mixed" and not row.measures_activations
    assert resolve_chain(True, "fp8-rowwise", CPU) == ("fp8-rowwise", "bf16", "fp32")
    with pytest.raises(PrecisionError, match="fp8-rowwise needs an NVIDIA GPU") as e:
        resolve_precision("fp8-rowwise", CPU)
    assert "fp8_emulate=True" in str(e.value)
    p = resolve_precision("fp8-rowwise", CPU, emulate_fp8=True)
    assert (p.param_dtype, p.compute_dtype, p.needs_scaler) == (
        torch.float32,
        torch.bfloat16,
        False,
    )


def test_activations_refuses_an_fp8_row_naming_it():
    from ampkit.observe.memory import activations

    model = torch.nn.Linear(16, 16)
    p = resolve_precision("fp8-rowwise", CPU, emulate_fp8=True)
    with pytest.raises(PrecisionError, match="does not measure fp8-rowwise"):
        activations(model, torch.randn(2, 16), p)


_train = train_tiny_gpt


def test_fp8_rowwise_trains_on_cpu_and_its_recipe_reaches_torchao():
    float8 = pytest.importorskip("torchao.float8")
    model, amp, losses = _train("fp8-rowwise", steps=4)
    assert amp.precision.name == "fp8-rowwise" and all(torch.isfinite(torch.tensor(losses)))
    converted = [r["name"] for r in amp.fp8_report() if r["converted"]]
    assert converted
    want = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"), emulate=True)
    tensorwise = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    for name in converted:
        got = model.get_submodule(name).config
        assert got == want and got.cast_config_input != tensorwise.cast_config_input
    assert (
        amp.state_dict()["precision"] == "fp8-rowwise"
        and amp.policy.describe()["recipe"] == "rowwise"
    )
    # the same training as fp8 with fp8_recipe="rowwise", bit for bit (same process, same seed)
    _, _, same = _train("fp8", steps=4, fp8_recipe="rowwise")
    assert losses == same


def test_fp8_rowwise_reaches_every_surface_that_takes_a_name():
    from ampkit import MixedPrecisionConfig
    from ampkit.cli import build_parser
    from ampkit.cli.flags import with_opt_level

    assert MixedPrecisionConfig(precision="fp8_rowwise").precision == "fp8-rowwise"
    assert (
        build_parser().parse_args(["train", "--precision", "fp8-rowwise"]).precision
        == "fp8-rowwise"
    )
    assert with_opt_level("fp8-rowwise", "O1")[0] == "fp8-rowwise"
    with pytest.raises(ValueError, match="conflicting flags"):
        with_opt_level("fp8-rowwise", "O2")


def test_lightning_reads_fp8_rowwise_as_bf16_mixed_not_fp32():
    pytest.importorskip("lightning")
    pytest.importorskip("torchao.float8")
    from ampkit.integrations.lightning import AmpkitPrecision

    assert AmpkitPrecision("fp8-rowwise", fp8_emulate=True).precision == "bf16-mixed"
    assert AmpkitPrecision("bf16-true").precision == "bf16-true"


@pytest.mark.parametrize("precision", ["bf16", "fp32", "fp16", "auto"])
@pytest.mark.parametrize(
    "rung",
    [
        {"masters": "split"},
        {"masters": "stochastic", "state_dtype": "bf16"},
        {"state_dtype": "bf16"},
    ],
)
def test_a_rung_on_a_precision_without_the_ladder_is_refused_at_construction(precision, rung):
    """Issue 35: a memory-ladder rung on bf16 (or any form without the ladder) was silently ignored
    (fp32 masters trained instead); now the engine refuses it, naming where the ladder lives."""
    with pytest.raises(ConfigError, match="memory-ladder rung.*bf16-pure"):
        MixedPrecision(precision, device="cpu", **rung)


def test_the_ladder_rungs_still_build_and_a_fallback_out_of_them_is_no_refusal():
    for spec in ("bf16-pure", "bf16-true", "O2"):
        MixedPrecision(spec, device="cpu", masters="split")
    amp = MixedPrecision("bf16-pure", device="cpu", masters="stochastic", state_dtype="bf16")
    model = torch.nn.Linear(4, 4)
    amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    amp.switch("bf16")  # the fallback's move: no refusal
    assert amp.precision.name == "bf16"


def test_the_opt_level_combination_is_read_from_the_rows():
    """``--amp_opt_level`` with a precision (issue 35 item 5): O0/O1/O2 and what each makes of a
    precision come from the rows' ``opt_level``, ``o1_form`` and ``o2_form``, nowhere else."""
    from ampkit.cli import build_parser
    from ampkit.cli.flags import with_opt_level
    from ampkit.cli.invocation import subparser
    from ampkit.step.config import canonical_precision
    from ampkit.step.precision import OPT_LEVELS, PrecisionError, opt_level_form

    level_flag = next(
        a for a in subparser(build_parser(), "train")._actions if a.dest == "amp_opt_level"
    )
    assert tuple(level_flag.choices) == OPT_LEVELS
    for level in OPT_LEVELS:  # the level alone is its precision alias
        assert (
            opt_level_form(None, level)
            == canonical_precision(level)
            == with_opt_level(None, level)[0]
        )
    for name, row in REGISTRY.items():
        assert opt_level_form(name, "O0") == "fp32"
        for level, form in (("O1", row.o1_form), ("O2", row.o2_form)):
            if form is None:
                with pytest.raises(PrecisionError, match=f"with {level} give one of"):
                    opt_level_form(name, level)
            else:
                assert opt_level_form(name, level) == form == with_opt_level(name, level)[0]
                assert REGISTRY[form].opt_level in (level, "-"), (name, level)
        if row.opt_level in ("O1", "O2"):  # a row at a level is its own form there
            assert (row.o1_form if row.opt_level == "O1" else row.o2_form) == name
