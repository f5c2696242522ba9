"""The ladder's bf16 gradients (:mod:`ampkit.step.policies.pure.grads`) where not every kept
gradient is stepped: a step of one of two optimizers, a trainable parameter no optimizer holds, an
optimizer's state loaded between backward and step. Each is compared bitwise with the fp32
gradients (``grads.HALF_GRADS = False``) computed in the same process."""

from __future__ import annotations

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.step.policies.pure import grads as kept_grads

from .test_ladder_grads import Net, batches, engine, same, states_of


def _grads(amp: MixedPrecision) -> list[torch.Tensor]:
    """Every master's gradient as fp32 (zeros-free: None is kept as an empty tensor)."""
    return [
        torch.empty(0) if p.grad is None else p.grad.float().clone()
        for p in amp.policy.master_params()
    ]


def _two_optimizers(monkeypatch: pytest.MonkeyPatch, half: bool) -> dict[str, list]:
    """A GAN-style loop: two optimizers over parts of the model, one stepped (and clipped) per
    backward; the other's gradients stay for its own next step."""
    monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
    torch.manual_seed(0)
    model = Net()
    first = [p for n, p in model.named_parameters() if n.startswith(("emb", "a."))]
    rest = [p for n, p in model.named_parameters() if not n.startswith(("emb", "a."))]
    o1 = torch.optim.AdamW(first, lr=1e-2, fused=True)
    o2 = torch.optim.SGD(rest, lr=0.1, momentum=0.9)
    amp = MixedPrecision("bf16-pure", masters="split", state_dtype="bf16", ladder_scratch_mib=1)
    model, o1, o2 = amp.setup(model, o1, o2)
    for i, (x, y) in enumerate(batches(4)):
        with amp.autocast():
            amp.backward(model(x, y))
        amp.step(o1 if i % 2 == 0 else o2, clip_grad_norm=0.05)
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "states": states_of(o1) + states_of(o2),
        "grads": _grads(amp),
    }


def test_clipping_one_of_two_optimizers_leaves_the_others_gradients_as_they_are(monkeypatch):
    """``amp.step(o1, clip_grad_norm=...)`` clips ``o1``'s gradients only (torch clips the
    parameters it is given): ``o2``'s kept gradients, made fp32 after the boundary, are their
    plain upcasts, not times ``o1``'s coefficient."""
    half, ref = _two_optimizers(monkeypatch, True), _two_optimizers(monkeypatch, False)
    assert same(half["grads"], ref["grads"])
    assert same(half["weights"], ref["weights"])
    assert same(half["states"], ref["states"])


def _outside(monkeypatch: pytest.MonkeyPatch, half: bool) -> dict[str, list]:
    """``b`` is trainable but in no optimizer (its gradient sums up, as torch leaves it)."""
    monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
    torch.manual_seed(0)
    model = Net()
    o = torch.optim.AdamW(
        [p for n, p in model.named_parameters() if not n.startswith("b.")], lr=1e-2, fused=True
    )
    amp = MixedPrecision("bf16-pure", masters="stochastic", ladder_scratch_mib=1)
    model, o = amp.setup(model, o)
    stepped = {id(p) for g in o.param_groups for p in g["params"]}
    dtypes = []
    for x, y in batches(3):
        with amp.autocast():
            amp.backward(model(x, y))
        dtypes.append(
            {
                p.grad.dtype
                for p in amp.policy.master_params()
                if id(p) in stepped and p.grad is not None
            }
        )
        amp.step(o, clip_grad_norm=0.05)
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "states": states_of(o),
        "grads": _grads(amp),
        "dtypes": dtypes,
    }


def test_a_parameter_no_optimizer_holds(monkeypatch):
    """Its gradient is not clipped (not a stepped parameter) and sums in fp32 over the steps, as
    with fp32 gradients; the stepped parameters' gradients stay bf16 every step (a gradient left
    on one master does not turn every other one fp32)."""
    half, ref = _outside(monkeypatch, True), _outside(monkeypatch, False)
    assert same(half["grads"], ref["grads"])
    assert same(half["weights"], ref["weights"])
    assert same(half["states"], ref["states"])
    assert half["dtypes"] == [{torch.bfloat16}] * 3


@pytest.mark.parametrize("states", ["fp32", "bf16"])
def test_optimizer_state_loaded_between_backward_and_step(monkeypatch, states):
    """``optimizer.load_state_dict`` casts the states to its parameters' dtype: the stand-ins are
    fp32 for it (their kept gradients turn fp32 first), and the step goes on as with fp32 ones."""
    out = {}
    for half in (True, False):
        monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
        amp, model, o = engine(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            masters="split",
            state_dtype=states,
            ladder_scratch_mib=1,
        )
        (x0, y0), (x1, y1), (x2, y2) = batches(3)
        with amp.autocast():
            amp.backward(model(x0, y0))
        amp.step(o)
        saved = o.state_dict()
        with amp.autocast():
            amp.backward(model(x1, y1))
        o.load_state_dict(saved)
        amp.step(o)
        with amp.autocast():
            amp.backward(model(x2, y2))
        amp.step(o)
        out[half] = [p.detach().clone() for p in model.parameters()], states_of(o)
    assert same(out[True][0], out[False][0])
    assert same(out[True][1], out[False][1])


def test_a_kept_gradient_replaced_by_hand_is_warned_about(monkeypatch):
    """``p.grad = p.grad / 3`` on the optimizer's parameters computes in bf16 there (in fp32 with
    fp32 gradients), as an in-place change does: warned about the same way."""
    monkeypatch.setattr(kept_grads, "HALF_GRADS", True)
    amp, model, o = engine(lambda ps: torch.optim.AdamW(ps, lr=1e-2), masters="split")
    ((x, y),) = batches(1)
    with amp.autocast():
        amp.backward(model(x, y))
    for p in amp.policy.master_params():
        p.grad = p.grad / 3
    with pytest.warns(UserWarning, match="changed"):
        amp.step(o)


def test_fp32_gradients_of_bf16_parameters_are_summed_as_before(monkeypatch):
    """``param.grad_dtype = torch.float32`` (torch accumulates a bf16 parameter's gradient in fp32)
    gives fp32 half gradients: they go onto the fp32 stand-ins as before, not kept (a bf16
    stand-in refuses an fp32 gradient)."""
    out = {}
    for half in (True, False):
        monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
        amp, model, o = engine(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
            masters="kahan",
            ladder_scratch_mib=1,
        )
        model.a.weight.grad_dtype = torch.float32
        for x, y in batches(2):
            with amp.autocast():
                amp.backward(model(x, y))
            amp.step(o, clip_grad_norm=0.05)
        out[half] = [p.detach().clone() for p in model.parameters()], states_of(o)
    assert same(out[True][0], out[False][0])
    assert same(out[True][1], out[False][1])


@pytest.mark.parametrize("rung", [{"masters": "split"}, {"masters": "fp32", "state_dtype": "bf16"}])
def test_a_channels_last_weight_on_a_ladder_rung_is_refused_before_anything_changes(rung):
    """The ladder steps each weight as flat memory: a channels_last conv weight is refused at
    setup with what to do (it failed inside, with the model half cast, or at the first step)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3)).to(memory_format=torch.channels_last)
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("bf16-pure", **rung)
    with pytest.raises(ValueError, match=r"\['0.weight'\] are not contiguous.*contiguous_format"):
        amp.setup(model, o)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert o.param_groups[0]["params"][0] is model[0].weight


def test_a_clip_with_no_kept_gradient_leaves_no_coefficient_behind(monkeypatch):
    """A clipped step whose gradients were all fp32 (summed into those ``zero_grad=False`` left)
    then an unclipped one with kept bf16 gradients: the second is not clipped by the first's
    coefficient."""
    out = {}
    for half in (True, False):
        monkeypatch.setattr(kept_grads, "HALF_GRADS", half)
        amp, model, o = engine(lambda ps: torch.optim.SGD(ps, lr=0.1), masters="split")
        for (x, y), kw in zip(
            batches(4), [{"zero_grad": False}, {"clip_grad_norm": 1e-3}, {}, {"zero_grad": False}]
        ):
            with amp.autocast():
                amp.backward(model(x, y))
            amp.step(o, **kw)
        out[half] = [p.detach().clone() for p in model.parameters()], _grads(amp)
    assert same(out[True][0], out[False][0])
    assert same(out[True][1], out[False][1])
