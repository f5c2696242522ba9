"""depth: a stack's peak from 1- and 2-block copies, checked against the full model's estimate at
several depths, batches and precisions; plan_precision's answers against the exact search."""

import pytest
import torch

from ampkit.plan.depth import (
    DepthError,
    DepthFit,
    Stack,
    measure_depths,
    stack_for,
)
from ampkit.plan.depth_plan import plan_precision, plan_precisions
from ampkit.plan.session import Measure, Session

TOLERANCE = (
    0.001  # stated: the extrapolated peak is within 0.1% of the full estimate (measured: 0 bytes)
)


def tokens(length):
    def batch_of(b):
        g = torch.Generator().manual_seed(b)
        x = torch.randint(0, 256, (b, length), generator=g)
        return x, torch.roll(x, 1, 1)

    return batch_of


def gpt_small_at(depth):
    """The built-in gpt small (4 blocks of width 128, 128 tokens) with ``depth`` blocks."""
    st = stack_for("gpt", "small")
    return Stack(st.name, depth, st.factory)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16-pure"])
@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.slow
def test_the_extrapolated_peak_is_the_full_estimate(precision, ckpt):
    batch_of = tokens(128)
    dfit = measure_depths(gpt_small_at(4), precision, batch_of, activation_checkpointing=ckpt)
    small = measure_depths(
        gpt_small_at(4), precision, batch_of, activation_checkpointing=ckpt, batches=(2, 4, 5)
    )
    for depth in (3, 6):
        with Session(
            gpt_small_at(depth).factory(depth), "adamw", precision, activation_checkpointing=ckpt
        ) as s:
            for b in (
                2,
                7,
                40,
            ):  # 40: activations dominate; 2 (measured itself): the optimizer's phase can
                m = s.measure(batch_of(b))  # hold the peak
                got = (small if b == 2 else dfit).peak(depth, b)
                assert abs(got - m.peak_bytes) <= TOLERANCE * m.peak_bytes, (
                    depth,
                    b,
                    got,
                    m.peak_bytes,
                )
                parts = (small if b == 2 else dfit).parts(depth, b)
                for k in (
                    "parameters",
                    "gradients",
                    "master_weights",
                    "optimizer_state",
                    "activations",
                ):
                    assert parts[k] == m.parts[k], (depth, b, k)


@pytest.mark.slow
def test_hf_gpt2_config_extrapolates_by_its_layer_count():
    pytest.importorskip("transformers")
    byte = {"n_layer": 5, "n_embd": 64, "n_head": 2, "n_positions": 64, "vocab_size": 256}
    st = stack_for("gpt2", overrides=byte)
    assert st is not None and st.depth == 5
    batch_of = tokens(64)
    dfit = measure_depths(st, "bf16", batch_of)
    with Session(st.factory(5), "adamw", "bf16") as s:
        for b in (3, 11):
            m = s.measure(batch_of(b))
            assert abs(dfit.peak(5, b) - m.peak_bytes) <= TOLERANCE * m.peak_bytes
    two = st.factory(2)()
    assert len(two.hf.transformer.h) == 2 and two.config.n_embd == 64  # the other overrides kept


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
@pytest.mark.slow
def test_plan_by_depth_is_the_exact_search(precision):
    """The plan's answers by depth extrapolation are those of the full model's exact search: B fits,
    B + 1 does not, with and without activation checkpointing; the peak at the batch too."""
    st, batch_of = gpt_small_at(4), tokens(128)
    factory = st.factory(4)
    with Session(factory, "adamw", precision) as s:
        one, two = s.measure(batch_of(2)).peak_bytes, s.measure(batch_of(3)).peak_bytes
    budget = one + int(9.5 * (two - one))  # about 11 samples
    by_depth = plan_precision(factory, batch_of, budget, precision, 6, stack=st)
    exact = plan_precision(factory, batch_of, budget, precision, 6)
    assert (by_depth.method, exact.method) == ("depth", "measured")
    assert by_depth.largest == exact.largest >= 8
    assert by_depth.largest_checkpointed == exact.largest_checkpointed > exact.largest
    assert by_depth.peak_bytes == exact.peak_bytes and by_depth.parts == exact.parts
    if (
        precision != "fp32"
    ):  # --verify once is enough here (tests/cli/test_plan.py runs it through the CLI)
        return
    verified = plan_precision(factory, batch_of, budget, precision, 6, stack=st, verify=True)
    assert verified.method == "depth, verified" and verified.verified is True
    assert verified.largest == exact.largest


@pytest.mark.slow
def test_answers_below_the_measured_batches_are_the_exact_search_too():
    """A budget for 2 samples and the peak at batch 2: the batches under 4 are measured at both depths
    (added to the fit's own batches 4 and 5, not measured again) -- the full model's answers."""
    st, batch_of = gpt_small_at(4), tokens(128)
    factory = st.factory(4)
    with Session(factory, "adamw", "bf16") as s:
        one, two = s.measure(batch_of(2)).peak_bytes, s.measure(batch_of(3)).peak_bytes
    budget = one + (two - one) // 2  # batch 2 fits, 3 does not
    by_depth = plan_precision(factory, batch_of, budget, "bf16", 2, stack=st)
    exact = plan_precision(factory, batch_of, budget, "bf16", 2)
    assert by_depth.method == "depth" and by_depth.largest == exact.largest == 2
    assert by_depth.largest_checkpointed == exact.largest_checkpointed
    assert by_depth.peak_bytes == exact.peak_bytes == one and by_depth.parts == exact.parts
    rows = plan_precisions(
        factory, batch_of, budget, ["bf16", "fp16"], 2, stack=st
    )  # the twin from those fits
    assert (
        rows[0] == by_depth and rows[1].method == "depth, as bf16"
    )  # (its shift at batches 1-3: the test below)
    assert (rows[1].largest, rows[1].largest_checkpointed) == (2, by_depth.largest_checkpointed)
    assert 0 <= rows[1].peak_bytes - by_depth.peak_bytes <= 64  # at most the loss scaler's scalars


@pytest.mark.slow
def test_a_twin_takes_the_first_rows_answers_only_where_its_check_measure_agrees():
    """plan_precisions: fp16's parts on the 1-block copy are bf16's, so its row comes from bf16's fits
    shifted by its own per-phase difference (said in its method; that those are fp16's own fits: the
    test below); fp32 after bf16 differs there and is planned on its own."""
    st, batch_of = gpt_small_at(4), tokens(128)
    factory = st.factory(4)
    with Session(factory, "adamw", "bf16") as s:
        one, two = s.measure(batch_of(2)).peak_bytes, s.measure(batch_of(3)).peak_bytes
    budget = one + int(9.5 * (two - one))
    bf16, fp16, fp32 = plan_precisions(
        factory, batch_of, budget, ["bf16", "fp16", "fp32"], 6, stack=st
    )
    assert (bf16.precision, bf16.method) == ("bf16", "depth")
    assert (fp16.precision, fp16.method) == ("fp16", "depth, as bf16")
    assert (fp16.largest, fp16.largest_checkpointed) == (bf16.largest, bf16.largest_checkpointed)
    assert 0 <= fp16.peak_bytes - bf16.peak_bytes <= 64  # the loss scaler's scalars, if at the peak
    assert (fp32.precision, fp32.method) == ("fp32", "depth") and fp32.largest < bf16.largest


@pytest.mark.parametrize("first,twin", [("bf16", "fp16"), ("bf16-pure", "fp16-pure")])
@pytest.mark.slow
def test_a_twins_shifted_fits_are_its_own_fits_at_every_depth_and_batch(first, twin):
    """The twin's fits (the first's, shifted per phase by the difference measured on the 1-block copy)
    predict exactly what its own 2 x 2 measures predict, at other depths and batches, with and without
    checkpointing: the loss scaler's scalars are the same bytes everywhere."""
    from ampkit.plan.depth import measure_both
    from ampkit.plan.depth_rungs import twin_fits

    st, batch_of = gpt_small_at(4), tokens(128)
    fits = measure_both(st, first, batch_of, (False, True))
    own = measure_both(st, twin, batch_of, (False, True))
    label, shifted = twin_fits(st, twin, batch_of, fits, "adamw")
    assert label == twin and any(
        any(f.offsets) for f in shifted.values()
    )  # fp16 does differ, by a few bytes
    for c in (False, True):
        for depth in (1, 4, 12):
            for b in (4, 5, 9, 40):
                assert shifted[c].peak(depth, b) == own[c].peak(depth, b), (c, depth, b)
                assert shifted[c].parts(depth, b) == own[c].parts(depth, b), (c, depth, b)
    if first != "bf16":
        return
    # and at the batches under 4 (a small budget's answers), measured into both fits
    small = measure_both(st, first, batch_of, (False,), batches=(1, 2, 3, 4, 5))
    own_small = measure_both(st, twin, batch_of, (False,), batches=(1, 2, 3, 4, 5))
    label, shifted_small = twin_fits(st, twin, batch_of, small, "adamw")
    for depth in (1, 4, 12):
        for b in (1, 2, 3):
            assert shifted_small[False].peak(depth, b) == own_small[False].peak(depth, b), (
                depth,
                b,
            )


def fake_measure(peak, timeline, phases, parts_total):
    parts = {
        "parameters": parts_total,
        "gradients": 0,
        "master_weights": 0,
        "optimizer_state": 0,
        "activations": 0,
        "temporaries": peak - parts_total,
    }
    return Measure("fp32", peak, parts, {}, tuple(timeline), tuple(phases))


def test_depth_fit_refuses_what_it_cannot_reproduce():
    ok = {
        (d, b): fake_measure(100 * d + 10 * b, [50, 100 * d + 10 * b, 60], (1, 2), 40)
        for d in (1, 2)
        for b in (2, 3)
    }
    dfit = DepthFit(ok)
    assert dfit.peak(12, 5) == 100 * 12 + 10 * 5  # each phase affine in depth and batch
    assert dfit.largest(12, 1250, 1 << 16) == 5 and dfit.largest(12, 100, 1 << 16) == 1
    bad = dict(ok)
    bad[(2, 3)] = fake_measure(999, [50, 230, 60], (1, 2), 40)  # a peak that no phase shows
    with pytest.raises(DepthError, match="is not the peak measured"):
        DepthFit(bad)
    with pytest.raises(DepthError, match="2 depths x 2 or more batches"):
        DepthFit({k: v for k, v in ok.items() if k != (2, 3)})


def test_the_phases_can_change_which_holds_the_peak():
    """At 1-2 blocks the optimizer step holds the peak; deeper, the backward does: each phase is
    extrapolated, then the maximum taken (extrapolating the peak itself would miss)."""

    def m(d, b):
        backward, step = 30 * d + 5 * b, 80 + 10 * d
        return fake_measure(max(backward, step), [10, backward, step], (1, 2), 5)

    dfit = DepthFit({(d, b): m(d, b) for d in (1, 2) for b in (2, 3)})
    for depth in (3, 8, 24):
        assert dfit.peak(depth, 2) == m(depth, 2).peak_bytes


def test_stack_for_knows_stacks_and_nothing_else():
    assert stack_for("gpt", "large").depth == 12 and stack_for("gpt", "tiny").depth == 2
    assert stack_for("mlp", "small") is None and stack_for("tests.some:factory") is None
    assert stack_for("gpt", "huge") is None  # the CLI reports an unknown size itself
    with torch.device("meta"):
        assert len(stack_for("gpt", "medium").factory(1)().blocks) == 1


@pytest.mark.slow
def test_ladder_rungs_planned_from_their_precisions_fits_are_their_own_plans():
    """A rung (bf16-pure:split, :stochastic+bf16) planned with bf16-pure differs from it only in its
    masters and optimizer state: measured on the 1- and 2-block copies at batch 4 and shifted, its
    answers are those of its own full depth plan, with and without checkpointing, at two budgets (one
    with answers below the measured batches, measured in bf16-pure and shifted too)."""
    st, batch_of = gpt_small_at(4), tokens(128)
    factory = st.factory(4)
    with Session(factory, "adamw", "bf16-pure") as s:
        one, two = s.measure(batch_of(2)).peak_bytes, s.measure(batch_of(3)).peak_bytes
    rungs = ["bf16-pure:split", "bf16-pure:stochastic+bf16"]
    for budget in (one + int(9.5 * (two - one)), one + (two - one) // 2):
        rows = plan_precisions(factory, batch_of, budget, ["bf16-pure", *rungs], 2, stack=st)
        assert [r.method for r in rows] == [
            "depth",
            "depth, rung of bf16-pure",
            "depth, rung of bf16-pure",
        ]
        for rung, row in zip(rungs, rows[1:]):
            own = plan_precision(factory, batch_of, budget, rung, 2, stack=st)
            assert (row.largest, row.largest_checkpointed) == (
                own.largest,
                own.largest_checkpointed,
            ), rung
            assert abs(row.peak_bytes - own.peak_bytes) <= TOLERANCE * own.peak_bytes, rung
            for k in ("parameters", "master_weights", "optimizer_state", "activations"):
                assert row.parts[k] == own.parts[k], (rung, k)
            assert (row.largest_in_backward, row.largest_in_backward_checkpointed) == (
                own.largest_in_backward,
                own.largest_in_backward_checkpointed,
            ), rung
