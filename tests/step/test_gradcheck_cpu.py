"""The CPU finite check without a scaler (bf16, issue 34 §6: one C call over every gradient where the
native kernels are in use, else read-only sums of the large gradients and one fused check of the small
ones; with clipping, the clip norm): a non-finite value in
any gradient -- first, last, a tiny one, one written after backward, one from an earlier
micro-step -- skips the step, and a finite run matches the hand-written torch.amp loop bit for
bit. (A post-accumulate-grad hook reading each gradient while hot was measured and not kept:
docs/benchmarks.md section 24, "The CPU finite check".)"""

import copy

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
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
