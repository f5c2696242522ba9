"""The contract every precision family keeps (:class:`~ampkit.step.policies.base.PrecisionPolicy`):
``setup`` (the policy's ``prepare``) -> steps -> the engine's state dict into a fresh engine, model
and optimizer -> the same steps as an uninterrupted run, bitwise -> ``release`` gives back a plain
fp32 model. One tiny model, every form that runs on a CPU (fp8 through torchao's emulation)."""

import copy

import pytest
import torch
from torch import nn

from ampkit import MixedPrecision
from ampkit.step.policies import policy_for

#: (precision, engine keywords): every family, every rung of the memory ladder
FORMS = [
    ("fp32", {}),
    ("tf32", {}),
    ("bf16", {}),
    ("fp16", {}),
    ("bf16-pure", {}),
    ("bf16-pure", {"masters": "split"}),
    ("bf16-pure", {"masters": "kahan"}),
    ("bf16-pure", {"masters": "stochastic"}),
    ("bf16-pure", {"masters": "stochastic", "state_dtype": "bf16"}),
    ("bf16-pure", {"state_dtype": "bf16"}),
    ("fp16-pure", {}),
    ("fp8", {"fp8_emulate": True}),
]
IDS = [p + "".join(f"-{v}" for v in kw.values() if v is not True) for p, kw in FORMS]


def _model():
    torch.manual_seed(0)
    # 16-multiple shapes: torchao's float8 linear needs them
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)


def _engine(precision, kw):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = MixedPrecision(precision, device="cpu", **kw)
    model, opt = amp.setup(model, opt)
    return amp, model, opt


def _steps(amp, model, opt, start, n):
    for i in range(start, start + n):
        x, y = _batch(i)
        with amp.autocast():
            loss = nn.functional.mse_loss(model(x).float(), y)
        amp.backward(loss)
        amp.step(opt)


def _weights(amp, model):
    """The fp32 weights the engine holds (masters where it keeps them) and the model's own."""
    full = {k: v.detach().clone() for k, v in amp.full_precision_state_dict().items()}
    return full, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("precision", "kw"), FORMS, ids=IDS)
def test_every_family_keeps_the_contract(precision, kw):
    if precision == "fp8":
        pytest.importorskip("torchao")
    dtypes = {n: p.dtype for n, p in _model().named_parameters()}

    amp, model, opt = _engine(precision, kw)  # uninterrupted: 5 steps
    assert amp.policy.precision.name == precision
    _steps(amp, model, opt, 0, 5)
    want = _weights(amp, model)

    amp, model, opt = _engine(precision, kw)  # 3 steps, then everything through state dicts
    _steps(amp, model, opt, 0, 3)
    saved = copy.deepcopy(
        {
            "amp": amp.state_dict(),
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "rng": torch.get_rng_state(),
        }
    )
    _steps(amp, model, opt, 3, 1)  # the old engine runs on; the saved state must not follow it
    amp, model, opt = _engine(precision, kw)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    torch.set_rng_state(saved["rng"])
    assert amp.optimizer_steps == 3
    _steps(amp, model, opt, 3, 2)
    got = _weights(amp, model)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            assert torch.equal(g[k], w[k]), f"{precision} {kw}: {k} differs after the round trip"
    assert amp.optimizer_steps == 5

    amp.policy.release()  # the model is plain fp32 again and holds the engine's weights; no hook left
    assert {n: p.dtype for n, p in model.named_parameters()} == dtypes
    assert all(type(m).__module__.startswith("torch.nn") for m in model.modules())
    for m in model.modules():
        assert not (
            m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        )
    for k, v in model.state_dict().items():
        assert torch.equal(v, got[0][k]), (
            f"{precision} {kw}: released {k} is not the engine's fp32 weight"
        )


def test_one_policy_for():
    """``policy_for`` is the engine's family picker; the FSDP2 mapping is ``fsdp_policy`` (its old
    name ``ampkit.distributed.policy_for`` is the same function, kept working)."""
    import ampkit.distributed as dist
    from ampkit.distributed import fsdp

    assert dist.policy_for is dist.fsdp_policy is fsdp.fsdp_policy
    assert fsdp.policy_for.__name__ == "fsdp_policy"
    assert policy_for.__module__ == "ampkit.step.policies"
