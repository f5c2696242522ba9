import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit import MixedPrecision, PrecisionError
from ampkit.step.fallback import NumericsError

from ..support.helpers import SyncCounter
from ..support.reference_loop import torch_amp_loop
from .test_config import saved_determinism

ACCUM, STEPS = 4, 50
BAD = {
    (3, 1),
    (10, 0),
    (11, 3),
    (27, 2),
    (40, 0),
}  # (optimizer step, micro-step) with non-finite loss


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.LayerNorm(32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 5),
    )


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)
    ]


def make_opt(model, fused):
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=fused)


def reference_loop(precision, fused, data):
    """The hand-written torch.autocast + torch.amp.GradScaler loop users write today
    (tests/support/reference_loop.py)."""
    model = make_model()
    model, scaler, _ = torch_amp_loop(
        model,
        make_opt(model, fused),
        data,
        precision,
        steps=STEPS,
        accum=ACCUM,
        clip=1.0,
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
        scaler_kwargs={"init_scale": 2.0**10, "growth_interval": 5},
        skip_nonfinite=True,
        poison=BAD,
    )
    return model, scaler


def ampkit_loop(precision, fused, data):
    model = make_model()
    opt = make_opt(model, fused)
    amp = MixedPrecision(
        precision,
        device="cpu",
        init_scale=2.0**10,
        growth_interval=5,
        accumulation_steps=ACCUM,
        clip_grad_norm=1.0,
    )
    model, opt = amp.setup(model, opt)
    boundaries = 0
    for step in range(STEPS):
        for micro in range(ACCUM):
            x, y = data[step * ACCUM + micro]
            with amp.autocast():
                loss = F.cross_entropy(model(x), y)
            if (step, micro) in BAD:
                loss = loss * math.inf
            amp.backward(loss)
            result = amp.step(opt)
            boundaries += result.boundary
            assert result.boundary == (micro == ACCUM - 1)
    assert boundaries == STEPS
    return model, amp


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.slow
def test_equivalent_to_hand_written_loop(precision, fused):
    data = batches(STEPS * ACCUM)
    ref, scaler = reference_loop(precision, fused, data)
    got, amp = ampkit_loop(precision, fused, data)
    # Same ops in the same order: bitwise equal parameters.
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(a, b), name
    stats = amp.stats()
    assert stats["optimizer_steps"] == STEPS
    assert stats["skipped_steps"] == len({s for s, _ in BAD})
    if precision == "fp16":
        assert stats["scale"] == scaler.get_scale()
    # and training did something: parameters moved away from the initial ones
    init = make_model()
    assert any(not torch.equal(a, b) for a, b in zip(init.parameters(), got.parameters()))


@pytest.mark.slow
def test_bf16_and_fp16_close_to_fp32_reference():
    """Mixed precision should track the fp32 trajectory within the dtype's precision."""
    data = batches(STEPS * ACCUM)
    ref, _ = ampkit_loop("fp32", False, data)
    for precision, tol in (("fp16", 5e-3), ("bf16", 3e-2)):
        got, _ = ampkit_loop(precision, False, data)
        for a, b in zip(ref.parameters(), got.parameters()):
            rel = (a.double() - b.double()).norm() / a.double().norm()
            assert rel < tol, (precision, float(rel))


def test_clipping_sees_unscaled_gradients():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    amp = MixedPrecision("fp16", device="cpu", init_scale=2.0**12)
    model, opt = amp.setup(model, opt)
    x, y = batches(1)[0]
    # fp32 reference gradient norm
    ref = make_model()
    F.cross_entropy(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    with amp.autocast():
        loss = F.cross_entropy(model(x), y)
    amp.backward(loss)
    res = amp.step(opt, clip_grad_norm=1e9, zero_grad=False)
    assert res.scale.item() == 2.0**12
    # the norm is the unscaled one (a scaled norm would be 4096x larger); fp16 tolerance
    torch.testing.assert_close(res.grad_norm, ref_norm, rtol=5e-3, atol=0)


def test_step_result_skipped_and_scale_backoff():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp16", device="cpu", init_scale=1024.0)
    model, opt = amp.setup(model, opt)
    before = copy.deepcopy(model.state_dict())
    x, y = batches(1)[0]
    with amp.autocast():
        loss = F.cross_entropy(model(x), y) * math.inf
    amp.backward(loss)
    r = amp.step(opt)
    assert r.boundary and r.skipped and r.scale.item() == 1024.0
    assert amp.scaler.get_scale() == 512.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert all(p.grad is None for p in model.parameters())


def _train_counting(precision, fused, steps=6, warmup=3, clip=1.0, opt_factory=None):
    model = make_model()
    opt = opt_factory(model) if opt_factory else make_opt(model, fused)
    amp = MixedPrecision(precision, device="cpu", accumulation_steps=2, clip_grad_norm=clip)
    model, opt = amp.setup(model, opt)
    data = batches(2 * (steps + warmup))
    counts = []
    for i, (x, y) in enumerate(data):
        with SyncCounter() as c:
            with amp.autocast():
                loss = F.cross_entropy(model(x), y)
            amp.backward(loss)
            amp.step(opt)
        if i >= 2 * warmup:
            counts.append(c.count)
    return counts


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.slow
def test_no_host_sync_with_fused_optimizer(precision, clip, monkeypatch):
    """The device path -- what runs on a GPU -- reads nothing on the host. On the CPU a unit-scale
    check (bf16/fp32) reads on the host instead, by design (a CPU read waits for nothing): without
    clipping in one C call or sums (gradcheck.cpu_all_finite), with it the clipped norm
    (gradcheck.cpu_norm_finite); so the device path is forced here to count it."""
    import ampkit.step.boundary as boundary_module
    import ampkit.step.scaler as scaler_module

    monkeypatch.setattr(scaler_module, "cpu_all_finite", lambda *a, **k: None)
    monkeypatch.setattr(boundary_module, "cpu_norm_finite", lambda *a, **k: None)
    counts = _train_counting(precision, fused=True, clip=clip)
    assert counts == [0] * len(counts)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("path", ["native", "sums"])
def test_the_cpu_check_reads_on_the_host_and_steps_like_the_device_path(
    precision, path, monkeypatch
):
    """On the CPU without clipping: on optimizer steps (none between) no host read where the native
    kernel reads every gradient in one C call; else one for the small gradients' fused check and one
    per large gradient's sum; the same parameters as the device path, bitwise."""
    import ampkit.step.scaler as scaler_module
    from ampkit.step.gradcheck import SUM_FROM
    from ampkit.step.policies import native

    if path == "native" and native.library() is None:
        pytest.skip("no C compiler here: the native kernels are not built")
    monkeypatch.setenv("AMPKIT_NO_NATIVE", "0" if path == "native" else "1")
    sizes = [p.numel() for p in make_model().parameters()]
    reads = (
        0
        if path == "native"
        else any(n < SUM_FROM for n in sizes) + sum(n >= SUM_FROM for n in sizes)
    )
    counts = _train_counting(precision, fused=True, clip=None)
    assert counts == [0, reads] * (len(counts) // 2)

    def trained(force_device_path):
        if force_device_path:
            monkeypatch.setattr(scaler_module, "cpu_all_finite", lambda *a, **k: None)
        monkeypatch.setenv("AMPKIT_NO_NATIVE", "0" if path == "native" else "1")
        model = make_model()
        opt = make_opt(model, True)
        amp = MixedPrecision(precision, device="cpu")
        model, opt = amp.setup(model, opt)
        for x, y in batches(8):
            with amp.autocast():
                loss = F.cross_entropy(model(x), y)
            amp.backward(loss)
            amp.step(opt)
        monkeypatch.undo()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(trained(False), trained(True)):
        assert torch.equal(a, b)


def test_non_fused_optimizer_syncs_once_per_optimizer_step():
    # (non-fused AdamW itself reads its step counters with .item(); SGD does not)
    counts = _train_counting(
        "fp16",
        fused=False,
        opt_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
    )
    # one read of found_inf per optimizer step (every 2nd micro-step), as torch.amp.GradScaler
    assert counts == [0, 1] * (len(counts) // 2)


def test_counter_sees_syncs():
    """The counting mode itself works: .item() is seen."""
    with SyncCounter() as c:
        torch.randn(3).sum().item()
    assert c.count == 1


def test_disabled_context_runs_fp32():
    amp = MixedPrecision("bf16", device="cpu")
    model = amp.setup(make_model())
    x = torch.randn(4, 16)
    with amp.autocast():
        assert model(x).dtype == torch.bfloat16
        with amp.disabled():
            assert model(x).dtype == torch.float32


@pytest.mark.parametrize(
    "precision,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_autocast_dtype(precision, dtype):
    amp = MixedPrecision(precision, device="cpu")
    model = amp.setup(make_model())
    with amp.autocast():
        assert model[0](torch.randn(2, 16)).dtype == dtype


def test_tf32_sets_and_restores_matmul_precision():
    amp = MixedPrecision("tf32", device="cpu")
    model = amp.setup(make_model())
    before = torch.get_float32_matmul_precision()
    with amp.autocast():
        assert torch.get_float32_matmul_precision() != "highest"
        assert model(torch.randn(2, 16)).dtype == torch.float32
    assert torch.get_float32_matmul_precision() == before


def test_switch_runtime_and_state_dict_roundtrip():
    data = batches(40)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("fp16", device="cpu", init_scale=256.0)
    model, opt = amp.setup(model, opt)
    for x, y in data[:10]:
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        amp.backward(loss)
        amp.step(opt)
    assert amp.switch("bf16", reason="test").name == "bf16"
    assert amp.precision.compute_dtype == torch.bfloat16
    with amp.autocast():
        assert model(data[0][0]).dtype == torch.bfloat16
    events = amp.stats()["events"]
    assert (
        events[-1]["kind"] == "precision_switch"
        and events[-1]["from"] == "fp16"
        and events[-1]["to"] == "bf16"
    )
    state = amp.state_dict()
    fresh = MixedPrecision("fp16", device="cpu")
    fresh.load_state_dict(state)
    assert fresh.precision.name == "bf16" and fresh.optimizer_steps == 10
    assert fresh.stats()["events"] == events


def test_state_dict_resume_fp16_bitwise():
    data = batches(40)

    def run(chunks):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        amp = MixedPrecision(
            "fp16", device="cpu", init_scale=2.0**14, growth_interval=3, accumulation_steps=2
        )
        model, opt = amp.setup(model, opt)
        state = None
        for lo, hi in chunks:
            if state is not None:  # resume into fresh objects
                model = make_model(seed=99)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
                amp = MixedPrecision("fp16", device="cpu", accumulation_steps=2)
                model, opt = amp.setup(model, opt)
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                amp.load_state_dict(state["amp"])
            for i in range(lo, hi):
                x, y = data[i]
                with amp.autocast():
                    loss = F.cross_entropy(model(x), y) * (math.inf if i in (5, 21) else 1.0)
                amp.backward(loss)
                amp.step(opt)
            state = copy.deepcopy(
                {"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}
            )
        return model, amp

    a, amp_a = run([(0, 40)])
    b, amp_b = run([(0, 20), (20, 40)])
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert amp_a.stats()["scale"] == amp_b.stats()["scale"]
    assert amp_a.stats()["skipped_steps"] == amp_b.stats()["skipped_steps"] == 2


# ---------------------------------------------------------------- bad input


def test_fp8_on_cpu_is_a_precision_error():
    with pytest.raises(PrecisionError, match="fp8 needs an NVIDIA GPU"):
        MixedPrecision("fp8", device="cpu")


def test_unknown_precision_and_override():
    with pytest.raises(PrecisionError, match="fp61"):
        MixedPrecision("fp61")
    with pytest.raises(ampkit.ConfigError, match="unknown config key"):
        MixedPrecision("fp16", init_scal=2.0)
    with pytest.raises(ampkit.ConfigError, match="growth_factor"):
        MixedPrecision("fp16", growth_factor=0.5)


def test_order_errors():
    amp = MixedPrecision("fp16", device="cpu")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="before setup"):
        amp.step(opt)
    with pytest.raises(RuntimeError, match="before setup"):
        amp.backward(torch.ones((), requires_grad=True))
    model, opt = amp.setup(model, opt)
    with pytest.raises(RuntimeError, match="before backward"):
        amp.step(opt)
    other = torch.optim.SGD(make_model().parameters(), lr=0.1)
    x, y = batches(1)[0]
    with amp.autocast():
        loss = F.cross_entropy(model(x), y)
    amp.backward(loss)
    with pytest.raises(ValueError, match="not set up"):
        amp.step(other)
    amp.step(opt)


def test_bad_losses():
    amp = MixedPrecision("fp32", device="cpu")
    model = make_model()
    model = amp.setup(model)
    out = model(torch.randn(3, 16))
    with pytest.raises(ValueError, match="scalar loss"):
        amp.backward(out)
    with pytest.raises(TypeError, match="floating-point"):
        amp.backward(torch.tensor(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        amp.backward(1.5)
    with pytest.raises(ValueError, match="does not require grad"):
        amp.backward(out.sum().detach())


def test_setup_rejects_foreign_optimizer_without_moving_anything():
    amp = MixedPrecision("fp32", device="cpu")
    model = make_model()
    opt = torch.optim.SGD(make_model(1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in the model"):
        amp.setup(model, opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        amp.setup(model, "adam")


def test_switch_inside_accumulation_window_raises():
    amp = MixedPrecision("fp16", device="cpu", accumulation_steps=2)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.setup(model, opt)
    x, y = batches(1)[0]
    with amp.autocast():
        loss = F.cross_entropy(model(x), y)
    amp.backward(loss)
    with pytest.raises(RuntimeError, match="accumulation window"):
        amp.switch("bf16")


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_no_host_sync_cuda(precision):
    torch.manual_seed(0)
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    amp = MixedPrecision(precision, device="cuda", clip_grad_norm=1.0)
    model, opt = amp.setup(model, opt)
    x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 5, (8,), device="cuda")
    for i in range(6):
        with SyncCounter() as c:
            with amp.autocast():
                loss = F.cross_entropy(model(x), y)
            amp.backward(loss)
            amp.step(opt)
        if i >= 2:
            assert c.count == 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        amp.backward(loss)
        amp.step(opt)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_equivalent_to_hand_written_loop_cuda(precision):
    """On CUDA, same op order -> bitwise equal parameters too."""
    torch.manual_seed(0)
    dev = "cuda"
    data = [(x.to(dev), y.to(dev)) for x, y in batches(40)]
    ref = make_model().to(dev)
    got = make_model().to(dev)
    o1 = torch.optim.AdamW(ref.parameters(), fused=True)
    o2 = torch.optim.AdamW(got.parameters(), fused=True)
    torch_amp_loop(
        ref,
        o1,
        data,
        precision,
        steps=len(data),
        clip=1.0,
        device=dev,
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )
    amp = MixedPrecision(precision, device=dev, clip_grad_norm=1.0)
    got, o2 = amp.setup(got, o2)
    for x, y in data:
        with amp.autocast():
            loss = F.cross_entropy(got(x), y)
        amp.backward(loss)
        amp.step(o2)
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- a long overflow burst

TINY = torch.finfo(torch.float32).tiny
BURST_OPTS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
}


def burst(amp, opt_name, bad=200, good=100, when=lambda amp: True):
    """``bad`` steps whose last Linear gets an inf gradient (while ``when(amp)``), then ``good`` finite
    ones. Returns the model, optimizer, the (step, NumericsError) pairs raised, and every step's scale."""
    model = make_model()
    opt = BURST_OPTS[opt_name](model.parameters())
    model, opt = amp.setup(model, opt)
    inject = [False]
    model[5].weight.register_hook(lambda g: torch.full_like(g, math.inf) if inject[0] else g)
    data = batches(bad + good)
    errors, scales = [], []
    for i, (x, y) in enumerate(data):
        inject[0] = i < bad and when(amp)
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        amp.backward(loss)
        try:
            amp.step(opt)
        except NumericsError as e:
            errors.append((i, e))
        if amp.precision.needs_scaler:
            scales.append(amp.scaler.get_scale())
    return model, opt, errors, scales


def assert_all_finite(amp, model, opt):
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(m).all() for m in amp.master_params())
    assert all(
        torch.isfinite(v).all()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.is_floating_point()
    )


@pytest.mark.parametrize("precision", ["fp16", "fp16-pure"])
@pytest.mark.parametrize("opt", list(BURST_OPTS))
@pytest.mark.slow
def test_overflow_burst_without_fallback_ends_in_a_clear_error(precision, opt):
    amp = MixedPrecision(precision, device="cpu")
    model, optimizer, errors, scales = burst(amp, opt)
    assert min(scales) >= TINY > 0  # the scale stays positive at every step
    assert errors and errors[0][0] < 200  # within the burst
    msg = str(errors[0][1])
    assert "exhausted" in msg and "consecutive skipped steps" in msg
    assert (
        "'5'" in msg and "5.weight" in msg and "0.weight" not in msg
    )  # the culprit, not the others
    assert all(i < 200 for i, _ in errors)  # after the burst, training goes on
    assert_all_finite(amp, model, optimizer)
    kinds = [e["kind"] for e in amp.stats()["events"]]
    assert "scale_exhausted" in kinds


@pytest.mark.parametrize("precision", ["fp16", "fp16-pure"])
@pytest.mark.parametrize("opt", list(BURST_OPTS))
@pytest.mark.slow
def test_overflow_burst_with_fallback_falls_back(precision, opt):
    # fp16-only overflow (as a layer out of fp16's range): one fallback, then bf16 trains
    amp = MixedPrecision(precision, device="cpu", fallback=True)
    model, optimizer, errors, scales = burst(
        amp, opt, when=lambda a: a.precision.name.startswith("fp16")
    )
    assert not errors and min(scales) > 0
    fb = [e for e in amp.stats()["events"] if e["kind"] == "fallback"]
    assert [(e["from"], e["to"]) for e in fb] == [(precision, precision.replace("fp16", "bf16"))]
    assert fb[0]["step"] < 200 and fb[0]["nonfinite_params"] == ["5.weight"]
    assert_all_finite(amp, model, optimizer)


@pytest.mark.parametrize("precision", ["fp16", "fp16-pure"])
@pytest.mark.slow
def test_persistent_burst_with_fallback_walks_the_chain_then_raises(precision):
    amp = MixedPrecision(precision, device="cpu", fallback=True)
    model, optimizer, errors, scales = burst(amp, "adamw_fused")
    fb = [(e["from"], e["to"]) for e in amp.stats()["events"] if e["kind"] == "fallback"]
    assert fb == [
        (precision, precision.replace("fp16", "bf16")),
        (precision.replace("fp16", "bf16"), "fp32"),
    ]
    assert (
        errors
        and errors[0][0] < 200
        and "last precision of the fallback chain" in str(errors[0][1])
    )
    assert "'5'" in str(errors[0][1])
    assert min(scales) > 0 and amp.precision.name == "fp32"
    assert_all_finite(amp, model, optimizer)


def test_exhausted_guard_adds_no_sync_in_steady_state():
    # overflowing (above the floor) and finite steps, fallback off, a check every 2 steps
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    amp = MixedPrecision("fp16", device="cpu", fallback_check_every=2)
    model, opt = amp.setup(model, opt)
    for i, (x, y) in enumerate(batches(30)):
        with SyncCounter() as c:
            with amp.autocast():
                loss = F.cross_entropy(model(x), y) * (math.inf if i % 3 == 0 else 1.0)
            amp.backward(loss)
            amp.step(opt)
        assert c.count == 0, i


# ---------------------------------------------------------------- deterministic


@pytest.mark.parametrize("mode", [True, "warn"])
def test_setup_applies_determinism(mode):
    with saved_determinism():
        torch.use_deterministic_algorithms(False)
        amp = MixedPrecision("fp32", device="cpu", deterministic=mode)
        assert not torch.are_deterministic_algorithms_enabled()  # nothing global at construction
        amp.setup(make_model())
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled() == (mode == "warn")
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"]


def test_setup_leaves_determinism_alone_by_default():
    with saved_determinism():
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.benchmark = True
        MixedPrecision("fp32", device="cpu").setup(make_model())
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
