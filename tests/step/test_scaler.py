import copy
import math
import random

import pytest
import torch

from ampkit import LossScaler


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def poison(model, kind):
    """Make one gradient element non-finite, as an fp16 overflow would."""
    g = next(model.parameters()).grad
    g.view(-1)[3] = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}[kind]


def run_pair(opt_factory, n_steps, p_bad, scaler_kwargs, seed, clip=False):
    rng = random.Random(seed)
    m_ref, m_amp = make_model(seed), make_model(seed)
    o_ref, o_amp = opt_factory(m_ref.parameters()), opt_factory(m_amp.parameters())
    gs = torch.amp.GradScaler("cpu", **scaler_kwargs)
    ls = LossScaler(**scaler_kwargs)
    scales_ref, scales_amp, skipped_ref, skipped_amp = [], [], [], []
    torch.manual_seed(seed + 1)
    for _ in range(n_steps):
        x = torch.randn(5, 8)
        bad = rng.choice(["inf", "-inf", "nan"]) if rng.random() < p_bad else None
        for m, o, s in ((m_ref, o_ref, gs), (m_amp, o_amp, ls)):
            loss = m(x).pow(2).mean()
            s.scale(loss).backward()
            if bad:
                poison(m, bad)
            if clip:
                s.unscale_(o)
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            s.step(o)
            s.update()
            o.zero_grad(set_to_none=True)
        scales_ref.append(gs.get_scale())
        scales_amp.append(ls.get_scale())
        skipped_ref.append(bad is not None)
        skipped_amp.append(bool(ls.found_inf.item() > 0))
    return m_ref, m_amp, scales_ref, scales_amp, skipped_ref, skipped_amp


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, fused=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("clip", [False, True])
def test_matches_torch_gradscaler(opt, clip):
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    m_ref, m_amp, s_ref, s_amp, k_ref, k_amp = run_pair(
        OPTIMIZERS[opt], 300, 0.25, kwargs, seed=7, clip=clip
    )
    assert s_ref == s_amp
    assert k_ref == k_amp
    assert len(set(s_ref)) > 3  # the scale really moved both ways
    for a, b in zip(m_ref.parameters(), m_amp.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_matches_torch_with_non_default_factors():
    kwargs = dict(init_scale=3.0e4, growth_factor=3.0, backoff_factor=0.25, growth_interval=5)
    *_, s_ref, s_amp, k_ref, k_amp = run_pair(OPTIMIZERS["adamw"], 400, 0.15, kwargs, seed=3)
    assert s_ref == s_amp and k_ref == k_amp


class DeepSpeedReference:
    """DeepSpeed's DynamicLossScaler.update_scale, transcribed from its documented semantics."""

    def __init__(
        self, init_scale, scale_factor, scale_window, hysteresis, consecutive, min_scale=0.0
    ):
        self.cur_scale, self.scale_factor, self.scale_window = (
            init_scale,
            scale_factor,
            scale_window,
        )
        self.delayed_shift = self.cur_hysteresis = hysteresis
        self.consecutive_hysteresis, self.min_scale = consecutive, min_scale
        self.cur_iter, self.last_overflow_iter = 0, -1

    def update_scale(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def drive(scaler, overflows):
    """Run the scaler over a sequence of overflow flags with a real parameter and optimizer."""
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scales = []
    for bad in overflows:
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("hysteresis", [1, 2, 3, 5])
@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_hysteresis_matches_deepspeed(hysteresis, consecutive, seed):
    rng = random.Random(seed)
    overflows = [rng.random() < 0.3 for _ in range(400)]
    ref = DeepSpeedReference(2.0**12, 2.0, 4, hysteresis, consecutive, min_scale=1.0)
    expected = []
    for o in overflows:
        ref.update_scale(o)
        expected.append(ref.cur_scale)
    ls = LossScaler(
        2.0**12,
        2.0,
        0.5,
        4,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=1.0,
    )
    got = drive(ls, overflows)
    assert got == expected
    assert len(set(got)) > 2


def test_hysteresis_spends_budget_before_backing_off():
    ls = LossScaler(1024.0, 2.0, 0.5, 100, hysteresis=3)
    # overflow 1 and 2 spend the budget; 3rd and later back off every time
    assert drive(ls, [True, True, True, True]) == [1024.0, 1024.0, 512.0, 256.0]


def test_hysteresis_one_is_torch():
    rng = random.Random(5)
    overflows = [rng.random() < 0.3 for _ in range(200)]
    gs_like = drive(LossScaler(256.0, 2.0, 0.5, 3), overflows)
    ds = DeepSpeedReference(256.0, 2.0, 3, 1, False)
    ref = []
    for o in overflows:
        ds.update_scale(o)
        ref.append(ds.cur_scale)
    assert gs_like == ref


def test_min_max_bounds():
    ls = LossScaler(8.0, 2.0, 0.5, 1, min_scale=2.0, max_scale=32.0)
    assert drive(ls, [True] * 4) == [4.0, 2.0, 2.0, 2.0]
    assert drive(ls, [False] * 6) == [4.0, 8.0, 16.0, 32.0, 32.0, 32.0]


def test_constant_scale_still_skips():
    ls = LossScaler(128.0, dynamic=False)
    p = torch.nn.Parameter(torch.randn(3))
    before = p.detach().clone()
    opt = torch.optim.SGD([p], lr=0.1)
    ls.scale(p.sum()).backward()
    p.grad[1] = math.nan
    ls.step(opt)
    ls.update()
    assert torch.equal(p.detach(), before)  # skipped
    assert int(ls.overflow_count) == 1
    assert drive(ls, [False, True, False] * 5) == [128.0] * 15


def test_unscale_is_exact_and_found_inf_reported():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(100))
    opt = torch.optim.SGD([p], lr=0.1)
    ls = LossScaler(2.0**14)
    w = torch.randn(100, dtype=torch.float64)
    ls.scale((p * w.float()).sum()).backward()
    found = ls.unscale_(opt)
    assert found.item() == 0.0
    # The gradient of sum(p*w) is w; unscaling a power-of-two scale is exact.
    torch.testing.assert_close(p.grad.double(), w.float().double(), rtol=0, atol=0)


def test_order_errors_teach_usage():
    ls = LossScaler()
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(RuntimeError, match="before any scale"):
        ls.update()
    ls.scale(p.sum()).backward()
    ls.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        ls.unscale_(opt)
    ls.step(opt)
    with pytest.raises(RuntimeError, match="update"):
        ls.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        ls.unscale_(opt)
    ls.update()


def test_fp16_grads_rejected_with_hint():
    p = torch.nn.Parameter(torch.randn(3).half())
    opt = torch.optim.SGD([p], lr=0.1)
    ls = LossScaler()
    ls.scale(p.float().sum()).backward()
    with pytest.raises(ValueError, match="fp16-pure"):
        ls.unscale_(opt)


def test_state_dict_roundtrip_continues_identically():
    rng = random.Random(11)
    seq = [rng.random() < 0.3 for _ in range(60)]
    a = LossScaler(2.0**8, 2.0, 0.5, 3, hysteresis=2, min_scale=1.0)
    drive(a, seq[:30])
    state = a.state_dict()
    b = LossScaler(hysteresis=2)
    b.load_state_dict(copy.deepcopy(state))
    assert b.state_dict() == state
    assert drive(a, seq[30:]) == drive(b, seq[30:])


def test_loads_torch_gradscaler_state_dict():
    gs = torch.amp.GradScaler("cpu", init_scale=2.0**9, growth_interval=7)
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for bad in [False, False, True, False]:
        gs.scale(p.sum()).backward()
        if bad:
            p.grad[0] = math.inf
        gs.step(opt)
        gs.update()
        opt.zero_grad()
    ls = LossScaler()
    ls.load_state_dict(gs.state_dict())
    sd = ls.state_dict()
    assert sd["scale"] == gs.get_scale() and sd["growth_interval"] == 7
    assert sd["_growth_tracker"] == gs.state_dict()["_growth_tracker"]
    # and continues exactly like the GradScaler would
    seq = [False] * 10 + [True] + [False] * 10
    assert drive(ls, seq) == drive_gs(gs, seq)


def drive_gs(gs, overflows):
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.SGD([p], lr=0.1)
    out = []
    for bad in overflows:
        gs.scale(p.sum()).backward()
        if bad:
            p.grad[0] = math.inf
        gs.step(opt)
        gs.update()
        opt.zero_grad()
        out.append(gs.get_scale())
    return out


def test_empty_state_dict_error():
    with pytest.raises(RuntimeError, match="disabled"):
        LossScaler().load_state_dict({})


def test_invalid_construction():
    with pytest.raises(ValueError, match="growth_factor"):
        LossScaler(growth_factor=0.5)
    with pytest.raises(ValueError, match="init_scale"):
        LossScaler(init_scale=0)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"max_scale": float("inf")}, "max_scale"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "max_scale"),
        ({"min_scale": 1.0, "max_scale": 2.0}, "init_scale"),
        ({"init_scale": 2.0**-127}, "init_scale"),
    ],
)
def test_scaler_validates_its_own_knobs(kwargs, name, monkeypatch):
    """The scaler checks its arguments itself (no MixedPrecisionConfig is built), with a ConfigError naming the knob."""
    import ampkit.step.config as config

    def boom(*a, **k):
        raise AssertionError("LossScaler built a MixedPrecisionConfig to check its arguments")

    monkeypatch.setattr(config.MixedPrecisionConfig, "__post_init__", boom)
    LossScaler(
        init_scale=8.0, min_scale=1.0, max_scale=16.0, hysteresis=2
    )  # valid: no config involved
    with pytest.raises(config.ConfigError, match=f"invalid {name}="):
        LossScaler(**kwargs)


def test_device_tensors_are_the_scalers_state():
    ls = LossScaler(init_scale=4.0)
    assert ls.device_tensors() == ()
    ls.scale(torch.ones(()))
    tensors = ls.device_tensors()
    assert len(tensors) == 5 and all(t.device.type == "cpu" for t in tensors)
    assert tensors[0] is ls.scale_tensor and float(tensors[0]) == 4.0


def test_state_lives_on_device_and_is_lazy():
    ls = LossScaler()
    assert ls.scale_tensor is None
    ls.scale(torch.ones((), requires_grad=True))
    assert ls.scale_tensor.device.type == "cpu" and ls.scale_tensor.dtype == torch.float32


@pytest.mark.cuda
def test_matches_torch_gradscaler_cuda():
    rng = random.Random(2)
    dev = "cuda"
    torch.manual_seed(0)
    m1 = torch.nn.Linear(8, 8).to(dev)
    m2 = copy.deepcopy(m1)
    o1 = torch.optim.AdamW(m1.parameters(), fused=True)
    o2 = torch.optim.AdamW(m2.parameters(), fused=True)
    gs, ls = torch.amp.GradScaler("cuda", growth_interval=3), LossScaler(growth_interval=3)
    for _ in range(100):
        x = torch.randn(4, 8, device=dev)
        bad = rng.random() < 0.3
        for m, o, s in ((m1, o1, gs), (m2, o2, ls)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = m(x).float().pow(2).mean()
            s.scale(loss).backward()
            if bad:
                m.weight.grad[0, 0] = math.inf
            s.step(o)
            s.update()
            o.zero_grad()
        assert gs.get_scale() == ls.get_scale()
    assert ls.scale_tensor.device.type == "cuda"
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- the positive floor

TINY = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal fp32


def test_scale_never_reaches_zero_and_matches_torch_above_the_floor():
    overflows = [True] * 200 + [False] * 10
    ref = drive_gs(torch.amp.GradScaler("cpu"), overflows)
    got = drive(LossScaler(), overflows)
    assert 0.0 in ref  # torch halves 65536 down to 0.0 after 166 overflows
    assert all(s > 0 for s in got) and min(got) == TINY == 2.0**-126
    above = [i for i, s in enumerate(ref) if s > TINY]
    assert len(above) > 100 and [got[i] for i in above] == [ref[i] for i in above]


@pytest.mark.parametrize("hysteresis", [1, 3])
@pytest.mark.parametrize("opt", ["sgd", "adamw", "adamw_fused"])
def test_floor_keeps_weights_finite_after_a_long_burst(hysteresis, opt):
    torch.manual_seed(0)
    model = make_model()
    o = OPTIMIZERS[opt](model.parameters())
    ls = LossScaler(hysteresis=hysteresis)
    for i in range(300):
        loss = model(torch.randn(5, 8)).pow(2).mean()
        ls.scale(loss).backward()
        if i < 200:
            poison(model, "inf")
        ls.step(o)
        ls.update()
        o.zero_grad(set_to_none=True)
        assert ls.get_scale() >= TINY
    assert ls.get_scale() >= TINY
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(
        torch.isfinite(v).all() for s in o.state.values() for v in s.values() if torch.is_tensor(v)
    )


def test_floor_with_min_scale_and_new_scale():
    ls = LossScaler(
        1.0, 2.0, 0.5, 100, min_scale=2.0**-130
    )  # a min_scale below the floor is raised to it
    assert min(drive(ls, [True] * 140)) == TINY
    assert ls.floor == TINY
    ls.update(new_scale=0.0)
    assert ls.get_scale() == TINY
    assert LossScaler(min_scale=4.0).floor == 4.0


def test_floor_adds_no_sync():
    from ..support.helpers import SyncCounter

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    ls = LossScaler(init_scale=2.0**-125)
    with SyncCounter() as c:
        for _ in range(3):
            ls.scale(model(torch.randn(5, 8)).pow(2).mean()).backward()
            poison(model, "nan")
            ls.step(opt)
            ls.update()
            opt.zero_grad(set_to_none=True)
    assert c.count == 0 and ls.get_scale() == TINY


def test_loads_a_subnormal_torch_scale_at_the_floor():
    ls = LossScaler()
    ls.load_state_dict(
        {
            "scale": 2.0**-140,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 0,
        }
    )
    assert ls.get_scale() == TINY


def test_a_loaded_state_counts_its_skips_and_growth_before_first_use():
    """stats() right after load_state_dict (no step yet) reports the saved skips, not 0."""
    torch.manual_seed(0)
    src = LossScaler(init_scale=2.0**20, growth_interval=100)
    g = torch.randn(8)
    for bad in (True, False, True, False, False):
        p = torch.nn.Parameter(torch.randn(8))
        opt = torch.optim.SGD([p], lr=0.1)
        p.grad = g.clone() * (float("inf") if bad else 1.0)
        src.step(opt)
        src.update()
    fresh = LossScaler()
    assert fresh.overflow_count is None and fresh.growth_tracker is None
    fresh.load_state_dict(src.state_dict())
    assert fresh.overflow_count is not None and float(fresh.overflow_count) == 2.0
    assert int(src.growth_tracker) == 2


def make_wide_model(seed=0):
    """Weights on both sides of gradcheck.SUM_FROM: the large one is checked by a read-only sum."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 4),
    )


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize(
    "bad", ["finite-overflowing-sum", "inf", "-inf", "nan", "inf-and-minus-inf", "last-tensor"]
)
@pytest.mark.parametrize("wide", [False, True], ids=["small-tensors", "a-large-tensor"])
def test_unit_scale_check_on_cpu_is_exact(opt, bad, wide):
    """A unit scale only checks; on the CPU the check is decided on the host (large gradients by a
    read-only sum, small ones by one fused call). A gradient whose *sum* overflows while every
    element is finite must still step; any inf/NaN anywhere must skip; a finite step must equal the
    plain loop's bitwise."""
    from ampkit.step.gradcheck import SUM_FROM

    build = make_wide_model if wide else make_model
    torch.manual_seed(3)
    ref, amp = build(3), build(3)
    assert wide == any(p.numel() >= SUM_FROM for p in amp.parameters())
    o_ref, o_amp = OPTIMIZERS[opt](ref.parameters()), OPTIMIZERS[opt](amp.parameters())
    ls = LossScaler(1.0, dynamic=False)
    x = torch.randn(5, 8)
    for m in (ref, amp):
        ls.scale(m(x).pow(2).mean()).backward() if m is amp else m(x).pow(2).mean().backward()
    for m in (ref, amp):
        grads = [p.grad for p in m.parameters()]
        big = max(grads, key=lambda g: g.numel())  # with wide=True, the summed one
        if bad == "finite-overflowing-sum":
            big.fill_(3e38)  # every element finite, their fp32 sum is inf
        elif bad == "inf-and-minus-inf":
            big.view(-1)[0], big.view(-1)[1] = math.inf, -math.inf
        elif bad == "last-tensor":
            grads[-1].view(-1)[-1] = math.nan
        else:
            (big if wide else grads[1]).view(-1)[2] = {
                "inf": math.inf,
                "-inf": -math.inf,
                "nan": math.nan,
            }[bad]
    grads_before = [p.grad.clone() for p in amp.parameters()]
    before = [p.detach().clone() for p in amp.parameters()]
    ls.step(o_amp)
    ls.update()
    for g, g0 in zip((p.grad for p in amp.parameters()), grads_before):
        assert torch.equal(g, g0) or (g.isnan() == g0.isnan()).all()  # read-only
    skipped = bad != "finite-overflowing-sum"
    assert ls.found_inf.item() == float(skipped)
    assert int(ls.overflow_count) == int(skipped)
    if skipped:
        assert all(torch.equal(p.detach(), b) for p, b in zip(amp.parameters(), before))
    else:
        o_ref.step()
        for p, q in zip(ref.parameters(), amp.parameters()):
            assert torch.equal(p.detach(), q.detach()) or (p.isnan() == q.isnan()).all()
        assert not all(torch.equal(p.detach(), b) for p, b in zip(amp.parameters(), before))


def test_unit_scale_check_on_cpu_reads_half_gradients_in_fp32():
    """bf16 gradients of 3e38 sum past bf16's range in their own dtype; summed in fp32 the check
    settles it exactly (a finite step), and one inf still skips."""
    p = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=1e-40)
    ls = LossScaler(1.0, dynamic=False)
    for value, skipped in ((1e30, False), (math.inf, True)):
        p.grad = torch.full_like(p, 1e30)
        p.grad[5] = value
        ls.step(opt)
        ls.update()
        assert ls.found_inf.item() == float(skipped)


def test_found_inf_is_fp32_under_a_float64_default_dtype() -> None:
    """torch's convention (a 0-d fp32 found_inf) holds whatever the default dtype: the CPU check's
    verdict was made in the default dtype (float64 under ``torch.set_default_dtype``)."""
    from ampkit import MixedPrecision

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = torch.nn.Linear(8, 4).float()
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        amp = MixedPrecision("bf16")
        model, opt = amp.setup(model, opt)
        with amp.autocast():
            loss = model(torch.randn(2, 8, dtype=torch.float32)).float().pow(2).mean()
        amp.backward(loss)
        result = amp.step(opt)
    finally:
        torch.set_default_dtype(before)
    assert result.found_inf is not None and result.found_inf.dtype == torch.float32
