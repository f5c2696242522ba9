"""The ladder keeps a whole one-micro-step window's gradients in bf16 (issue 36: ``stochastic`` is
2 + 0 + 8 bytes per parameter with AdamW, and its gradients 2 more, not 4): every rung and optimizer
steps bitwise as with the fp32 gradients it kept before (``grads.HALF_GRADS = False``, computed in the
same process), a step that reads the gradients for itself gets them in fp32, and the stand-ins are
fp32 again after every boundary (:mod:`ampkit.step.policies.pure.grads`)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.integrations.common import stepped_params
from ampkit.observe.memory import breakdown
from ampkit.step.policies.pure import grads as kept_grads


class Net(torch.nn.Module):  # an embedding over a 1 MiB scratch: stepped in pieces
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(1024, 384)
        self.a, self.norm, self.b = (
            torch.nn.Linear(384, 96),
            torch.nn.LayerNorm(96),
            torch.nn.Linear(96, 7),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.b(self.norm(self.a(self.emb(x).mean(1))))
        return torch.nn.functional.cross_entropy(h.float(), y)


OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}


def engine(
    make: Callable[[Any], torch.optim.Optimizer], **config: Any
) -> tuple[MixedPrecision, torch.nn.Module, torch.optim.Optimizer]:
    """``Net`` (seed 0) and the optimizer ``make`` builds, set up under ``bf16-pure`` with ``config``."""
    torch.manual_seed(0)
    model = Net()
    amp = MixedPrecision("bf16-pure", **config)
    model, o = amp.setup(model, make(model.parameters()))
    return amp, model, o


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 1024, (8, 5), generator=g), torch.randint(0, 7, (8,), generator=g))
        for _ in range(n)
    ]


def train(
    monkeypatch: pytest.MonkeyPatch,
    half: bool,
    masters: str,
    states: str = "fp32",
    opt: str = "adamw-fused",
    steps: int = 3,
    nan_at: int = -1,
    **config: object,
) -> tuple[list[torch.Tensor], list, MixedPrecision, torch.nn.Module, torch.optim.Optimizer]:
    """Train ``steps`` steps with kept bf16 gradients (``half``) or the fp32 ones; returns the
    weights, the gradient dtypes seen at each boundary, the engine, the model and the optimizer."""
    monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
    torch.manual_seed(0)
    model = Net()
    o = OPTIMIZERS[opt](model.parameters())
    amp = MixedPrecision(
        "bf16-pure", masters=masters, state_dtype=states, ladder_scratch_mib=1, **config
    )
    model, o = amp.setup(model, o)
    seen = []
    for i, (x, y) in enumerate(batches(steps)):
        with amp.autocast():
            loss = model(x, y)
        amp.backward(loss * math.nan if i == nan_at else loss)
        seen.append({str(p.grad.dtype) for p in amp.policy.master_params() if p.grad is not None})
        amp.step(o)
    return [p.detach().clone() for p in model.parameters()], seen, amp, model, o


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x.view(-1), y.view(-1)) for x, y in zip(a, b))


def states_of(o: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for st in o.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("states", ["fp32", "bf16"])
@pytest.mark.parametrize("masters", ["split", "kahan", "stochastic"])
def test_kept_bf16_gradients_step_bitwise_as_fp32_ones(monkeypatch, masters, states, opt):
    w_half, seen_half, _, _, o_half = train(monkeypatch, True, masters, states, opt)
    w_ref, seen_ref, _, _, o_ref = train(monkeypatch, False, masters, states, opt)
    assert seen_half == [{"torch.bfloat16"}] * 3  # kept as backward made them
    assert seen_ref == [{"torch.float32"}] * 3
    assert same(w_half, w_ref)
    assert same(states_of(o_half), states_of(o_ref))


def test_a_non_finite_bf16_gradient_skips_the_step(monkeypatch):
    w, _, amp, model, o = train(monkeypatch, True, "stochastic", "bf16", nan_at=1, steps=2)
    w_one, *_ = train(monkeypatch, True, "stochastic", "bf16", steps=1)
    assert amp.stats()["skipped_steps"] == 1
    assert same(w, w_one)  # the NaN step changed nothing
    assert all(bool(torch.isfinite(p.detach().float()).all()) for p in model.parameters())


@pytest.mark.parametrize("keep", [(), ("norm",)], ids=["all-mastered", "keep_fp32-norm"])
@pytest.mark.parametrize("clip", [1e-3, 1e3], ids=["clips", "does-not-clip"])
@pytest.mark.parametrize("opt", ["adamw-fused", "sgd-momentum"])
@pytest.mark.parametrize("masters", ["split", "stochastic"])
def test_clipping_kept_bf16_gradients_is_clip_grad_norm_on_their_upcasts(
    monkeypatch, masters, opt, clip, keep
):
    """``clip_grad_norm``: the total norm from each kept gradient's fp32 upcast and the coefficient
    applied as the step widens them -- the same norm and weights as clipping fp32 gradients, with
    ``keep_fp32`` modules' fp32 gradients clipped in place beside them."""
    cfg = {"clip_grad_norm": clip, "keep_fp32": list(keep)}
    w_half, seen, amp_h, *_ = train(monkeypatch, True, masters, "bf16", opt, steps=3, **cfg)
    w_ref, _, amp_r, *_ = train(monkeypatch, False, masters, "bf16", opt, steps=3, **cfg)
    assert "torch.bfloat16" in seen[0]  # kept through a clipped step
    assert same(w_half, w_ref)


def test_the_clipped_norm_is_the_one_clipping_fp32_gradients_reports(monkeypatch):
    norms = {}
    for half in (True, False):
        monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
        amp, model, o = engine(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            masters="kahan",
            clip_grad_norm=0.1,
        )
        norms[half] = []
        for x, y in batches(3):
            with amp.autocast():
                amp.backward(model(x, y))
            norms[half].append(amp.step(o).grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(norms[True], norms[False]))


def test_accumulation_sums_the_gradients_in_fp32(monkeypatch):
    steps = 4
    cfg = {"accumulation_steps": 2}
    w_half, seen, *_ = train(monkeypatch, True, "stochastic", "bf16", steps=steps, **cfg)
    w_ref, *_ = train(monkeypatch, False, "stochastic", "bf16", steps=steps, **cfg)
    assert same(w_half, w_ref)
    assert seen == [{"torch.float32"}] * steps  # from the first micro-step on


def test_zero_grad_false_keeps_fp32_gradients_after_the_step(monkeypatch):
    monkeypatch.setattr(kept_grads, "HALF_GRADS", True)
    amp, model, o = engine(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), masters="stochastic"
    )
    ((x, y),) = batches(1)
    with amp.autocast():
        amp.backward(model(x, y))
    kept = [p.grad.clone() for p in amp.policy.master_params()]
    amp.step(o, zero_grad=False)
    after = [p.grad for p in amp.policy.master_params()]
    assert all(g.dtype == torch.float32 for g in after)
    assert all(torch.equal(a, k.float()) for a, k in zip(after, kept))


def test_stand_ins_are_fp32_between_steps_and_after_a_discarded_window(monkeypatch):
    _, _, amp, model, o = train(monkeypatch, True, "split", steps=2)
    masters = amp.policy.master_params()
    assert all(p.dtype == torch.float32 and p.grad is None for p in masters)
    ((x, y),) = batches(1, seed=5)
    with amp.autocast():
        amp.backward(model(x, y))
    assert {p.grad.dtype for p in masters} == {torch.bfloat16}
    amp.discard_window()
    assert all(p.dtype == torch.float32 and p.grad is None for p in masters)


def test_integrations_read_fp32_gradients(monkeypatch):
    monkeypatch.setattr(kept_grads, "HALF_GRADS", True)
    amp, model, o = engine(lambda ps: torch.optim.AdamW(ps, lr=1e-2), masters="kahan")
    ((x, y),) = batches(1)
    with amp.autocast():
        amp.backward(model(x, y))
    bf16 = [p.grad.clone() for p in amp.policy.master_params()]
    params = stepped_params(amp, model)  # what Lightning's and HF's clipping read
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in params)
    assert all(torch.equal(p.grad, g.float()) for p, g in zip(params, bf16))


def test_the_gradients_cost_two_bytes_per_parameter(monkeypatch):
    """Persistent plus gradients after a backward: stochastic + bf16 states is 2 + 4 + 2 bytes per
    mastered parameter (the gradients 4 with the fp32 copy)."""
    got = {}
    for half in (True, False):
        monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
        amp, model, o = engine(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            masters="stochastic",
            state_dtype="bf16",
        )
        ((x, y),) = batches(1)
        with amp.autocast():
            amp.backward(model(x, y))
        got[half] = breakdown(model, o, amp)
    n = sum(p.numel() for p in Net().parameters())
    assert got[True].by_category["gradients"] == 2 * n
    assert got[False].by_category["gradients"] == 4 * n


def test_a_gradient_changed_by_hand_in_bf16_is_warned_about(monkeypatch):
    """A ported loop that clips the optimizer's gradients itself would clip bf16 values here: the
    engine says so (once) instead of stepping a silently different run without a word."""
    monkeypatch.setattr(kept_grads, "HALF_GRADS", True)
    amp, model, o = engine(lambda ps: torch.optim.AdamW(ps, lr=1e-2), masters="stochastic")
    (x, y), (x2, y2) = batches(2)
    with amp.autocast():
        amp.backward(model(x, y))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        amp.step(o)  # untouched: no warning
    assert not [w for w in seen if "changed in place" in str(w.message)]
    with amp.autocast():
        amp.backward(model(x2, y2))
    torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], 1e-3)
    with pytest.warns(UserWarning, match="changed in place"):
        amp.step(o)


def test_the_manifest_between_backward_and_step_is_the_one_after(monkeypatch):
    """The stand-ins are bf16 only while they hold kept gradients: the manifest still says fp32."""
    monkeypatch.setattr(kept_grads, "HALF_GRADS", True)
    _, _, amp, model, o = train(monkeypatch, True, "stochastic", steps=1)
    after = amp.manifest().to_dict()
    ((x, y),) = batches(1, seed=3)
    with amp.autocast():
        amp.backward(model(x, y))
    assert {p.grad.dtype for p in amp.policy.master_params()} == {torch.bfloat16}
    assert amp.manifest().to_dict() == after
