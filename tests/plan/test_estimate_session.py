"""estimate_session: one warmed-up model measured at several batch sizes, the affine memory model
(Curve) and the batch search (fit / largest_batch) checked against fresh estimates."""

import pytest
import torch

from ampkit.models.builtin import build, builtin
from ampkit.plan.estimate import estimate, largest_batch
from ampkit.plan.session import Curve, Session, fit


def gpt_batch(b):
    return builtin("gpt", "tiny", batch_size=b, seed=0)[1](0)


def gpt():
    return build("gpt", "tiny")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.slow
def test_a_session_measures_what_fresh_estimates_report(precision):
    with Session(gpt, "adamw", precision) as s:
        measures = {
            b: s.measure(gpt_batch(b)) for b in (3, 1, 5)
        }  # any order: each step starts from the same state
    for b, m in measures.items():
        e = estimate(gpt, gpt_batch(b), precision=precision)
        assert m.peak_bytes == e.peak_bytes and m.parts == e.parts, b


@pytest.mark.slow
def test_the_curve_from_two_measures_predicts_every_batch_exactly():
    with Session(gpt, "adamw", "bf16") as s:
        m2, m3, m7 = s.measure(gpt_batch(2)), s.measure(gpt_batch(3)), s.measure(gpt_batch(7))
    curve = Curve(2, m2, 3, m3)
    assert curve.ok and curve.agrees(7, m7)
    for b in (5, 9):
        assert curve.peak(b) == estimate(gpt, gpt_batch(b), precision="bf16").peak_bytes
    assert curve.peak(5) > curve.peak(3) > curve.peak(2)


def exhaustive(factory, batch_of, budget, precision, top=64):
    """The reference: a bisection over fresh estimates for the last batch in [1, top] that fits."""

    def fits(b):
        return estimate(factory, batch_of(b), precision=precision).peak_bytes <= budget

    if not fits(1):
        return 0
    lo, hi = 1, top + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure"])
@pytest.mark.slow
def test_largest_batch_is_the_exhaustive_answer(precision):
    one = estimate(gpt, gpt_batch(1), precision=precision).peak_bytes
    two = estimate(gpt, gpt_batch(2), precision=precision).peak_bytes
    budget = one + int(4.5 * (two - one))  # about 5 samples
    b, at = largest_batch(gpt, gpt_batch, budget, precision)
    assert b == exhaustive(gpt, gpt_batch, budget, precision) >= 4
    assert at.peak_bytes <= budget < estimate(gpt, gpt_batch(b + 1), precision=precision).peak_bytes
    assert largest_batch(gpt, gpt_batch, one - 1, precision)[0] == 0  # not even one sample


class AllPairs(torch.nn.Module):
    """A loss over every pair of samples (a B x B matrix): memory is not affine in the batch."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        h = self.proj(x)
        sim = (h @ h.T).repeat(1, 64)  # B x 64B: quadratic in B
        return sim.float().logsumexp(1).mean()


@pytest.mark.slow
def test_fit_still_answers_when_memory_is_not_affine():
    def batch_of(b):
        return (torch.randn(b, 64),)

    with Session(AllPairs, "adamw", "fp32") as s:
        m1, m2 = s.measure(batch_of(1)), s.measure(batch_of(2))
        m6 = s.measure(batch_of(6))
    assert not Curve(1, m1, 2, m2).agrees(6, m6)  # the affine model misses here
    assert Curve(1, m1, 2, m2).peak(6) < m6.peak_bytes
    budget = estimate(AllPairs, batch_of(20), precision="fp32").peak_bytes + 1
    with Session(AllPairs, "adamw", "fp32") as s:
        b, m, seen = fit(s, batch_of, budget, 1 << 10)
    assert b == exhaustive(AllPairs, batch_of, budget, "fp32", top=40) == 20
    assert m.peak_bytes <= budget < seen[b + 1].peak_bytes


@pytest.mark.slow
def test_a_plan_row_builds_the_model_twice_and_measures_a_handful_of_batches(monkeypatch):
    """The cost of `ampkit plan` per precision: two sessions (with and without activation
    checkpointing), and when the memory is affine 4 measures each -- not a bisection of estimates."""
    import argparse

    from ampkit.cli import plan as plan_cli
    from ampkit.plan import session as estimate_session

    counts = {"sessions": 0, "measures": 0}
    enter, measure = estimate_session.Session.__enter__, estimate_session.Session.measure

    def counting_enter(self):
        counts["sessions"] += 1
        return enter(self)

    def counting_measure(self, batch):
        counts["measures"] += 1
        return measure(self, batch)

    monkeypatch.setattr(estimate_session.Session, "__enter__", counting_enter)
    monkeypatch.setattr(estimate_session.Session, "measure", counting_measure)
    args = argparse.Namespace(
        model="gpt",
        size="tiny",
        model_config=None,
        data=None,
        block_size=None,
        memory="8MiB",
        precisions="fp32,bf16",
        batch_size=4,
        json=True,
        workers=1,
    )  # counted in this process (forked workers count in theirs)
    monkeypatch.setattr(
        plan_cli, "_stack", lambda args: None
    )  # the full model measured (a user's model)
    rows = plan_cli.plan_rows(args)
    assert counts["sessions"] == 4 and counts["measures"] <= 2 * (5 + 5)
    for r in rows:  # the answers are the exhaustive ones
        assert r["method"] == "measured"
        assert r["largest_batch"] == exhaustive(gpt, gpt_batch, 8 * 2**20, r["precision"])
    monkeypatch.undo()
    monkeypatch.setattr(estimate_session.Session, "__enter__", counting_enter)
    depths = []
    monkeypatch.setattr(
        estimate_session.Session,
        "measure",
        lambda self, batch: (depths.append(len(self.model.blocks)), measure(self, batch))[1],
    )
    by_depth = plan_cli.plan_rows(args)  # gpt is a stack of blocks: 1- and 2-block copies only
    assert max(depths) == 2 and len(depths) <= 2 * 2 * (2 * 2)
    assert [r["largest_batch"] for r in by_depth] == [r["largest_batch"] for r in rows]
    assert [r["largest_batch_activation_checkpointing"] for r in by_depth] == [
        r["largest_batch_activation_checkpointing"] for r in rows
    ]
    assert [r["peak_bytes"] for r in by_depth] == [r["peak_bytes"] for r in rows]


@pytest.mark.parametrize("precision", ["fp32", "bf16-pure", "fp8"])
@pytest.mark.slow
def test_checkpointing_switched_in_a_session_measures_what_a_fresh_session_does(precision):
    if precision == "fp8":
        pytest.importorskip("torchao")
    with Session(gpt, "adamw", precision) as s:
        plain = s.measure(gpt_batch(4))
        s.checkpointing(True)
        on = s.measure(gpt_batch(5))
        s.checkpointing(False)
        off = s.measure(gpt_batch(4))
    with Session(gpt, "adamw", precision, activation_checkpointing=True) as s:
        fresh = s.measure(gpt_batch(5))
    assert (on.peak_bytes, on.parts, on.timeline) == (fresh.peak_bytes, fresh.parts, fresh.timeline)
    assert on.parts["activations"] < plain.parts["activations"]
    assert (off.peak_bytes, off.parts, off.timeline) == (
        plain.peak_bytes,
        plain.parts,
        plain.timeline,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-pure", "fp16-pure", "fp8"])
@pytest.mark.slow
def test_the_cheap_warm_up_leaves_what_a_training_step_leaves(precision, monkeypatch):
    """The warm-up that only sums the parameters measures the same steps as a real warm-up step."""
    from ampkit.plan import session as estimate_session

    if precision == "fp8":
        pytest.importorskip("torchao")
    got = {}
    for mode in ("step", "cheap"):
        monkeypatch.setattr(estimate_session, "WARM_UP", mode)
        with Session(gpt, "adamw", precision) as s:
            got[mode] = [s.measure(gpt_batch(b)) for b in (4, 2)]
        with Session(gpt, "adamw", precision, activation_checkpointing=True) as s:
            got[mode].append(s.measure(gpt_batch(3)))
    for a, b in zip(got["step"], got["cheap"]):
        assert (a.peak_bytes, a.parts, a.by_dtype, a.timeline, a.phases) == (
            b.peak_bytes,
            b.parts,
            b.by_dtype,
            b.timeline,
            b.phases,
        )
