"""The CPU finite check without a scaler (bf16, issue 34 §6: one C call over every gradient where the
native kernels are in use, else read-only sums of the large gradients and one fused check of the small
ones; with clipping, the clip norm): a non-finite value in
any gradient -- first, last, a tiny one, one written after backward, one from an earlier
micro-step -- skips the step, and a finite run matches the hand-written torch.amp loop bit for
bit. (A post-accumulate-grad hook reading each gradient while hot was measured and not kept:
docs/benchmarks.md section 24, "The CPU finite check".)"""

import copy
import math

import pytest
import torch
from torch import nn

from ampkit import MixedPrecision
from ampkit.step.gradcheck import SUM_FROM, cpu_all_finite
from ampkit.step.policies import native


@pytest.fixture(autouse=True, params=["native", "sums"])
def check_path(request, monkeypatch):
    """Every test runs on both forms of the check: the C kernel and the sums (AMPKIT_NO_NATIVE=1)."""
    if request.param == "native":
        if native.library() is None:
            pytest.skip("no C compiler here: the native kernels are not built")
        monkeypatch.delenv("AMPKIT_NO_NATIVE", raising=False)
    else:
        monkeypatch.setenv("AMPKIT_NO_NATIVE", "1")
    return request.param


def net():
    torch.manual_seed(0)
    # 65536 and 32768 elements: checked by sums; the last layer (and the biases) are small
    return nn.Sequential(
        nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 128), nn.GELU(), nn.Linear(128, 4)
    )


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 256, generator=g), torch.randint(0, 4, (16,), generator=g)


def loss_of(model, b):
    x, y = b
    return nn.functional.cross_entropy(model(x), y)


def engine(**kw):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = MixedPrecision("bf16", device="cpu", **kw)
    model, opt = amp.setup(model, opt)
    return amp, model, opt


def poison(param, value, where=0):
    """A hook that writes ``value`` into one element of ``param``'s incoming gradient."""

    def hook(g):
        g = g.clone()
        g.view(-1)[where] = value
        return g

    return param.register_hook(hook)


def test_the_model_has_large_and_small_gradients():
    sizes = [p.numel() for p in net().parameters()]
    assert sum(n >= SUM_FROM for n in sizes) == 2 and sum(n < SUM_FROM for n in sizes) == 4


@pytest.mark.parametrize(
    "index", [0, 2, 5, 4]
)  # the first weight, the last large one, the last bias, a tiny weight
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_value_in_any_gradient_skips_the_step(index, value):
    amp, model, opt = engine()
    amp.backward(loss_of(model, batch(0)))
    amp.step(opt)  # one good step first: the optimizer has state to keep
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    handle = poison(params[index], value, where=params[index].numel() - 1)
    with amp.autocast():
        loss = loss_of(model, batch(1))
    amp.backward(loss)
    result = amp.step(opt)
    handle.remove()
    assert result.found_inf.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert opt.state_dict()["state"][0]["step"] == state["state"][0]["step"]


def test_host_verdicts_count_exactly_the_skipped_steps():
    """A finite step decided on the host adds nothing to the overflow count (update() skips the
    add of a known 0); each non-finite one adds one, and the result's found_inf says which."""
    amp, model, opt = engine()
    params = list(model.parameters())
    bad_steps = {1, 2, 5}
    seen = []
    for i in range(7):
        handle = poison(params[0], float("nan")) if i in bad_steps else None
        with amp.autocast():
            loss = loss_of(model, batch(i))
        amp.backward(loss)
        seen.append(amp.step(opt).found_inf.item())
        if handle is not None:
            handle.remove()
    assert seen == [1.0 if i in bad_steps else 0.0 for i in range(7)]
    assert amp.stats()["skipped_steps"] == len(bad_steps)
    assert opt.state_dict()["state"][0]["step"] == 7 - len(bad_steps)


@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_a_gradient_changed_after_backward_is_read_again(how):
    amp, model, opt = engine()
    with amp.autocast():
        loss = loss_of(model, batch(0))
    amp.backward(loss)  # finite gradients
    w = model[0].weight
    before = w.detach().clone()
    if how == "in place":
        w.grad[3, 7] = float("nan")
    else:
        g = w.grad.clone()
        g[3, 7] = float("inf")
        w.grad = g
    assert amp.step(opt).found_inf.item() == 1.0
    assert torch.equal(w, before)


@pytest.mark.parametrize("bad_micro", [0, 1])
def test_accumulation_a_nonfinite_micro_step_skips_the_window(bad_micro):
    amp, model, opt = engine(accumulation_steps=2)
    w = model[2].weight
    before = w.detach().clone()
    for i in range(2):
        handle = poison(w, float("nan")) if i == bad_micro else None
        with amp.autocast():
            loss = loss_of(model, batch(i))
        amp.backward(loss)
        if handle is not None:
            handle.remove()
        result = amp.step(opt)
    assert result.boundary and result.found_inf.item() == 1.0
    assert torch.equal(w, before)


def test_with_clipping_the_norm_is_the_check():
    amp, model, opt = engine(clip_grad_norm=1.0)
    w = model[0].weight
    before = w.detach().clone()
    handle = poison(w, float("inf"))
    with amp.autocast():
        loss = loss_of(model, batch(0))
    amp.backward(loss)
    handle.remove()
    assert amp.step(opt).found_inf.item() == 1.0 and torch.equal(w, before)


@pytest.mark.parametrize("bad", [False, True])
def test_with_clipping_the_cpu_step_is_decided_on_the_host(bad):
    """With clipping on the CPU the norm is read on the host (free there): the fused optimizer is
    called exactly as a plain loop calls it, with no found_inf to read and correct its step count
    for; a non-finite gradient still skips the step and leaves every parameter as it was."""
    amp, model, opt = engine(clip_grad_norm=1.0)
    seen = []
    step = opt.step

    def spy(*a, **k):
        seen.append(getattr(opt, "found_inf", None))
        return step(*a, **k)

    opt.step = spy
    before = [p.detach().clone() for p in model.parameters()]
    handle = poison(model[2].weight, float("nan"), where=5) if bad else None
    with amp.autocast():
        loss = loss_of(model, batch(0))
    amp.backward(loss)
    if handle is not None:
        handle.remove()
    result = amp.step(opt)
    assert result.found_inf.item() == float(bad)
    assert seen == ([] if bad else [None])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)) is bad


def raw_loop(steps, accumulation, clip):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    for s in range(steps):
        for k in range(accumulation):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(model, batch(s * accumulation + k)) / accumulation
            loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("accumulation,clip", [(1, None), (2, None), (1, 1.0)])
def test_bitwise_the_hand_written_loop(accumulation, clip):
    amp, model, opt = engine(accumulation_steps=accumulation, clip_grad_norm=clip)
    for s in range(3):
        for k in range(accumulation):
            with amp.autocast():
                loss = loss_of(model, batch(s * accumulation + k))
            amp.backward(loss)
            amp.step(opt)
    ref = raw_loop(3, accumulation, clip)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert amp.stats()["skipped_steps"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_native_check_agrees_with_isfinite(dtype, check_path):
    """Random tensors of many sizes (block edges of the kernel's loops) with the dtype's edge values
    -- largest finite, subnormal, +-inf, NaN -- at random places: the C kernel says non-finite exactly
    where torch.isfinite does, and cpu_all_finite gives the same verdict on either path."""
    g = torch.Generator().manual_seed(1)
    info = torch.finfo(dtype)
    for size in (1, 7, 511, 512, 513, 1023, 1024, 1025, 4096 + 3, 70_000):
        for value in (
            info.max,
            -info.max,
            info.tiny / 8,
            float("inf"),
            -float("inf"),
            float("nan"),
            None,
        ):
            t = torch.randn(size, generator=g).to(dtype)
            if value is not None:
                t[int(torch.randint(0, size, (1,), generator=g))] = value
            want = not bool(torch.isfinite(t).all())
            if check_path == "native":
                assert native.any_nonfinite([torch.zeros(5, dtype=dtype), t]) is want
            p = nn.Parameter(torch.zeros(size, dtype=dtype))
            p.grad = t
            assert cpu_all_finite(torch.optim.SGD([p], lr=0.1), allow_fp16=True) is (not want)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_native_check_split_over_threads_agrees_with_isfinite(threads, check_path):
    """Several tensors of mixed dtypes and odd sizes in one call, large enough to be cut into one
    slice per thread (slice edges fall inside tensors), with 0-3 edge values (NaN, +-inf, a
    subnormal, the largest finite) at random places: the verdict is torch.isfinite's."""
    if check_path != "native":
        pytest.skip("the C kernel only")
    g = torch.Generator().manual_seed(2)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    for trial in range(60):
        tensors = []
        for _ in range(int(torch.randint(1, 6, (1,), generator=g))):
            dtype = dtypes[int(torch.randint(0, 4, (1,), generator=g))]
            size = int(torch.randint(1, 50_000, (1,), generator=g))
            tensors.append(torch.randn(size, generator=g).to(dtype))
        for _ in range(trial % 4):
            t = tensors[int(torch.randint(0, len(tensors), (1,), generator=g))]
            info = torch.finfo(t.dtype)
            values = [float("nan"), float("inf"), -float("inf"), info.tiny / 8, info.max]
            t[int(torch.randint(0, t.numel(), (1,), generator=g))] = values[
                int(torch.randint(0, 5, (1,), generator=g))
            ]
        want = not all(bool(torch.isfinite(t).all()) for t in tensors)
        assert native.any_nonfinite(tensors, threads=threads) is want


def test_without_a_compiler_the_sums_decide(monkeypatch, tmp_path, check_path):
    """No C compiler (a "compiler" that always fails, in a fresh cache): no kernel, and the check
    falls back to the sums with the same verdicts, every dtype."""
    if check_path != "native":
        pytest.skip("once is enough")
    monkeypatch.setattr(native, "_state", {})  # as in a fresh process
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for value in (None, float("nan"), float("inf"), torch.finfo(dtype).max):
            t = torch.randn(SUM_FROM + 3, dtype=dtype)
            if value is not None:
                t[-1] = value
            assert native.any_nonfinite([t]) is None
            p = nn.Parameter(torch.zeros_like(t))
            p.grad = t
            assert cpu_all_finite(torch.optim.SGD([p], lr=0.1), allow_fp16=True) is (
                value is None or math.isfinite(value)
            )
