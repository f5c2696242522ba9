"""bf16-pure's memory ladder (step/policies/ladder.py): bytes per parameter, the stall, exactness, resume."""

from __future__ import annotations

import io

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.observe.memory import breakdown
from ampkit.step.config import ConfigError
from ampkit.step.policies.pure.ladder import (
    bytes_per_param,
    join_split,
    kahan_join,
    kahan_split,
    split_fp32,
)
from ampkit.step.policies.pure.rounding import BLOCK

RUNGS = [
    ("fp32", "fp32", 14),
    ("split", "fp32", 12),
    ("kahan", "fp32", 12),
    ("stochastic", "fp32", 10),
    ("stochastic", "bf16", 6),
    ("none", "fp32", 6),
]


def _amp(masters: str, state_dtype: str = "fp32", **kw) -> MixedPrecision:
    return MixedPrecision(
        "bf16-pure", masters=masters, state_dtype=state_dtype, allow_stall=masters == "none", **kw
    )


def _mlp(seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.LayerNorm(width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 4),
    )


def _opt(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adagrad(params, lr=0.05)


def _train(amp: MixedPrecision, model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        amp.backward(loss)
        amp.step(opt)


def test_split_round_trip_is_exact_and_rounds_to_nearest() -> None:
    x = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    ties = torch.tensor(
        [1.0 + 2**-8, -(1.0 + 2**-8), 1.0 + 3 * 2**-8, 3.0 + 2**-7]
    )  # exact half-way values
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1e-40, -1e-40])])  # zeros, subnormals
    hi, rem = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16)
    split_fp32(x.clone(), hi, rem)
    back = join_split(hi, rem, torch.empty_like(x))
    assert torch.equal(
        back.view(torch.int32), x.view(torch.int32)
    )  # bitwise, -0.0 and subnormals included
    # round to nearest: within half a bf16 spacing; ties go away from zero
    assert torch.equal(
        hi[:-8], x[:-8].to(torch.bfloat16)
    )  # random values: no ties, the same as RNE
    assert hi[-8:-4].float().tolist() == [1.0 + 2**-7, -(1.0 + 2**-7), 1.0 + 4 * 2**-8, 3.0 + 2**-6]


def _ties_away_reference(x: torch.Tensor) -> torch.Tensor:
    """bf16 of finite fp32 ``x`` rounded to nearest, ties away from zero, chosen in fp64 between the
    two bf16 neighbours (toward zero / away from zero); a tie or an overflow past bf16's max goes away."""
    bits = x.view(torch.int32)
    down = (bits & -0x10000).view(torch.float32)  # the high 16 bits: toward zero
    up = (down.view(torch.int32) + 0x10000).view(
        torch.float32
    )  # the next bf16 away from zero (maybe inf)
    xd, dd = x.double(), down.double()
    ud = torch.where(
        up.isinf(), torch.sign(xd) * 2.0**128, up.double()
    )  # inf's place one spacing past max
    pick_up = (xd - dd).abs() >= (ud - xd).abs()
    return torch.where(pick_up, up, down).to(torch.bfloat16)


def test_split_and_kahan_edge_cases_across_blocks() -> None:
    """Several blocks of the bit-level passes; ties of both signs, values near bf16's max that round
    to inf, infs, zeros of both signs, subnormals, random normals over 60 decades; vs an fp64 reference."""
    g = torch.Generator().manual_seed(3)
    n = 2 * BLOCK + 123
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)
    big = torch.tensor(
        [3.3961776e38, 3.3895314e38, 3.4028235e38, 3.3963e38], dtype=torch.float32
    )  # max_bf16 ..
    ties = (
        torch.randint(0x00800000, 0x7F000000, (64,), generator=g, dtype=torch.int32) & -0x10000
        | 0x8000
    )
    special = torch.cat(
        [
            big,
            -big,
            ties.view(torch.float32),
            -ties.view(torch.float32),
            torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-45, -1e-45, float("inf"), -float("inf")]),
        ]
    )
    k = (
        special.numel() // 2
    )  # the first half just before a block boundary, the rest at random after it
    idx = torch.cat(
        [
            torch.arange(BLOCK - k, BLOCK),
            BLOCK + torch.randperm(n - BLOCK, generator=g)[: special.numel() - k],
        ]
    )
    x[idx] = special
    hi, rem = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_fp32(x.clone(), hi, rem)
    back = join_split(hi, rem, torch.empty(n))
    assert torch.equal(
        back.view(torch.int32), x.view(torch.int32)
    )  # exact, -0.0/subnormals/inf included
    finite = x.isfinite()
    assert torch.equal(
        hi[finite].view(torch.int16), _ties_away_reference(x[finite]).view(torch.int16)
    )
    assert torch.equal(hi[~finite].float(), x[~finite])
    assert hi[idx[:4]].isinf().tolist() == [
        True,
        False,
        True,
        True,
    ]  # a tie past max, max, above: inf, exact back
    # kahan: the bf16 RNE weight + the bf16 of the exact rounding error
    comp = torch.empty(n, dtype=torch.bfloat16)
    kahan_split(x.clone(), hi, comp, torch.empty(n))
    assert torch.equal(hi.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    ok = finite & hi.float().isfinite()
    err = (x[ok].double() - hi[ok].double()).to(torch.bfloat16)
    assert torch.equal(comp[ok].view(torch.int16), err.view(torch.int16))
    joined = kahan_join(hi, comp, torch.empty(n), torch.empty(n))
    assert torch.equal(joined[ok], hi[ok].float() + comp[ok].float())
    normal = ok & (x.abs() > 1e-30)  # the compensation itself a normal number
    rel = (joined[normal].double() - x[normal].double()).abs() / x[normal].double().abs()
    assert rel.max() < 2.0**-15  # the compensation carries ~16 of the 24 bits


@pytest.mark.parametrize("masters,state_dtype,expected", RUNGS)
def test_bytes_per_parameter_from_live_tensors(
    masters: str, state_dtype: str, expected: int
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = _amp(masters, state_dtype)
    with pytest.warns(UserWarning, match="stall") if masters == "none" else _null():
        model, opt = amp.setup(model, opt)
    for _ in range(2):
        with amp.autocast():
            loss = model(torch.randn(4, 256)).float().pow(2).mean()
        amp.backward(loss)
        amp.step(opt)
    cats = breakdown(model, opt, amp).by_category
    n = sum(p.numel() for p in model.parameters())
    live = cats["parameters"] + cats["optimizer_state"] + cats["master_weights"]
    assert abs(live / n - expected) <= 0.05, (masters, state_dtype, live / n)
    assert bytes_per_param(masters, state_dtype) == expected


def _null():
    import contextlib

    return contextlib.nullcontext()


def _stall_run(masters: str):
    """1000 weights at 1.0, gradient 1, fused AdamW lr 1e-3, 100 steps."""
    w = torch.nn.Parameter(torch.ones(1000))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.AdamW([w], lr=1e-3, fused=True)
    if masters == "ref":
        amp = None
    else:
        amp = _amp(masters)
        model, opt = amp.setup(model, opt)
    for _ in range(100):
        if amp is None:
            model.w.sum().backward()
            opt.step()
            opt.zero_grad()
        else:
            amp.backward(model.w.float().sum())
            amp.step(opt)
    return model, amp


def test_scalar_stall() -> None:
    ref = _stall_run("ref")[0].w.detach()
    assert float(ref[0]) < 0.91  # fp32 moves by ~lr per step
    for masters in ("split", "kahan"):
        model, amp = _stall_run(masters)
        assert torch.equal(model.w.detach(), ref.to(torch.bfloat16)), masters
        fp32 = amp.full_precision_state_dict()["w"]
        if masters == "split":
            assert torch.equal(fp32, ref)  # the exact fp32 value is available
        else:  # bf16 + bf16 compensation: within 1/20 of the weight's bf16 spacing (2**-8 here) after 100 steps
            assert float((fp32 - ref).abs().max()) < 0.05 * 2**-8
    model, _ = _stall_run("stochastic")
    w = model.w.detach().float()
    assert abs(float(w.mean()) - float(ref.mean())) < 2e-3  # unbiased in the mean
    assert float(w.std()) > 0  # (really rounded stochastically, not to nearest)
    with pytest.warns(UserWarning, match="stall"):
        model, _ = _stall_run("none")
    assert bool((model.w.detach() == 1.0).all())  # the stall


def test_split_equals_fp32_masters_bitwise_and_kahan_close() -> None:
    runs = {}
    for masters in ("fp32", "split", "kahan", "stochastic"):
        model, amp = _mlp(), _amp(masters)
        opt = _opt("adamw", model.parameters())
        model, opt = amp.setup(model, opt)
        _train(amp, model, opt, 6, seed=1)
        runs[masters] = amp.full_precision_state_dict()
    ref = runs["fp32"]
    assert all(torch.equal(runs["split"][k], ref[k]) for k in ref)
    assert max(float((runs["kahan"][k] - ref[k]).abs().max()) for k in ref) < 1e-4
    assert max(float((runs["stochastic"][k] - ref[k]).abs().max()) for k in ref) < 0.1


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd", "adagrad"])
@pytest.mark.parametrize("masters,state_dtype", [(m, s) for m, s, _ in RUNGS] + [("split", "bf16")])
def test_resume_is_bitwise(masters: str, state_dtype: str, opt_kind: str) -> None:
    def fresh():
        model, amp = _mlp(), _amp(masters, state_dtype)
        opt = _opt(opt_kind, model.parameters())
        with pytest.warns(UserWarning) if masters == "none" else _null():
            model, opt = amp.setup(model, opt)
        return model, opt, amp

    model, opt, amp = fresh()
    _train(amp, model, opt, 3, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    _train(amp, model, opt, 3, seed=2)
    straight = amp.full_precision_state_dict()

    model2, opt2, amp2 = fresh()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)  # as the Trainer's checkpoints load
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    amp2.load_state_dict(ck["amp"])
    _train(amp2, model2, opt2, 3, seed=2)
    resumed = amp2.full_precision_state_dict()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q)


def test_switch_between_rungs_and_precisions() -> None:
    model, amp = _mlp(), _amp("split")
    opt = _opt("adamw", model.parameters())
    model, opt = amp.setup(model, opt)
    _train(amp, model, opt, 2, seed=1)
    exact = amp.full_precision_state_dict()
    amp.switch("fp32")  # the exact fp32 masters come back into the model
    assert all(torch.equal(p.detach(), exact[n]) for n, p in model.named_parameters())
    _train(amp, model, opt, 1, seed=2)
    amp.switch("bf16-pure", masters="stochastic", state_dtype="bf16")
    assert amp.config.masters == "stochastic" and next(model.parameters()).dtype == torch.bfloat16
    _train(amp, model, opt, 2, seed=3)
    assert any(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values())
    amp.switch("bf16-pure", masters="kahan", state_dtype="fp32")
    assert all(v.dtype == torch.float32 for s in opt.state.values() for v in s.values())
    _train(amp, model, opt, 2, seed=4)
    assert [e.data["to"] for e in amp.events] == ["fp32", "bf16-pure", "fp32", "bf16-pure"]
    assert all(torch.isfinite(v).all() for v in amp.full_precision_state_dict().values())


def test_lr_scheduler_after_setup_and_keep_fp32() -> None:
    model, amp = _mlp(), _amp("split", keep_fp32=["1"])
    opt = _opt("adamw", model.parameters())
    model, opt = amp.setup(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    norm_before = model[1].weight.detach().clone()
    _train(amp, model, opt, 2, seed=1)
    sched.step()
    assert model[1].weight.dtype == torch.float32 and not torch.equal(
        model[1].weight.detach(), norm_before
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_bad_rungs_are_refused() -> None:
    with pytest.raises(ConfigError, match="stall.*allow_stall"):
        MixedPrecision("bf16-pure", masters="none")
    with pytest.raises(ConfigError, match="masters='halves'.*split"):
        MixedPrecision("bf16-pure", masters="halves")
    with pytest.raises(ConfigError, match="state_dtype='fp8'.*bf16"):
        MixedPrecision("bf16-pure", state_dtype="fp8")
    with pytest.raises(
        ConfigError, match="bf16-pure"
    ):  # refused when the engine is built (was: at setup)
        MixedPrecision("fp16-pure", masters="split")
