"""Step semantics against real, hand-written training loops (issue: bitwise parity).

The references are the loops of nanoGPT's ``train.py`` (decay/no-decay parameter groups, loss
divided by the accumulation steps inside autocast, ``clip_grad_norm_(model.parameters())``) and
timm's ``train_one_epoch`` with ``NativeScaler`` (a short last accumulation window whose losses
are divided by its own length). Ported to ampkit they must give bitwise the same parameters.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision
from ampkit.models.builtin import build
from ampkit.models.data import TextBatches

from ..support.reference_loop import torch_amp_loop

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
ACCUM, STEPS, CLIP = 4, 5, 0.5


def nanogpt_optimizer(model, fused):
    """nanoGPT's ``configure_optimizers``: 2-D weights decay, biases and norms do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), fused=fused)


def gpt_and_data():
    torch.manual_seed(0)
    model = build("gpt", "tiny")
    data = TextBatches(batch_size=4, block_size=model.config.block_size, seed=0)
    return model, [data(i) for i in range(ACCUM * STEPS)]


def nanogpt_loop(model, data, precision, fused):
    """nanoGPT train.py's inner loop: the shared hand-written loop (tests/support/reference_loop.py)
    with its optimizer."""
    return torch_amp_loop(
        model, nanogpt_optimizer(model, fused), data, precision, steps=STEPS, accum=ACCUM, clip=CLIP
    )[0]


def nanogpt_on_ampkit(model, data, precision, fused):
    optimizer = nanogpt_optimizer(model, fused)
    amp = MixedPrecision(precision, device="cpu", accumulation_steps=ACCUM, clip_grad_norm=CLIP)
    model, optimizer = amp.setup(model, optimizer)
    for it in range(STEPS):
        for micro_step in range(ACCUM):
            x, y = data[it * ACCUM + micro_step]
            with amp.autocast():
                loss = model(x, y)
            amp.backward(loss)
            amp.step(optimizer)
    return model


def assert_bitwise(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs by up to {(p - q).abs().max().item():.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_nanogpt_decay_groups_bitwise(precision, fused):
    base, data = gpt_and_data()
    ref = nanogpt_loop(copy.deepcopy(base), data, precision, fused)
    got = nanogpt_on_ampkit(copy.deepcopy(base), data, precision, fused)
    assert not torch.equal(ref.lm_head.weight, base.lm_head.weight)  # it trained
    assert_bitwise(ref, got)


def test_clip_order_is_model_order_not_group_order():
    """The parameters ampkit clips are model.parameters(), whatever the optimizer's grouping."""
    base, _ = gpt_and_data()
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(base, nanogpt_optimizer(base, fused=False))
    clipped = amp._clip_order.params([opt])  # the list handed to clip_grad_norm_
    assert [id(p) for p in clipped] == [id(p) for p in model.parameters()]
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert grouped != [id(p) for p in clipped]  # the groups really are in another order


# ---------------------------------------------------------------------------- window guards


def tiny_setup(accum=4, precision="fp32"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision(precision, device="cpu", accumulation_steps=accum)
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def loss_of(model, i):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
    return F.cross_entropy(model(x), y)


def test_more_backward_calls_than_the_window_raise_before_touching_grads():
    model, opt, amp = tiny_setup(accum=4)
    for i in range(4):
        amp.backward(loss_of(model, i))
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"backward\(\) called 5 times in a window of 4"):
        amp.backward(loss_of(model, 4))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    result = amp.step(opt)  # the window of 4 still steps normally
    assert result.boundary and amp.optimizer_steps == 1


def test_step_once_after_a_micro_batch_loop():
    """Calling step() once after exactly accumulation_steps backward() calls is a boundary."""
    model, opt, amp = tiny_setup(accum=3)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        amp.backward(loss_of(model, i))
        (loss_of(ref, i) / 3).backward()
    assert amp.step(opt).boundary
    ref_opt.step()
    assert_bitwise(ref, model)


# ---------------------------------------------------------------------------- the short last window (timm)


def conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )


def image_loader(n=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        for _ in range(n)
    ]


def timm_epoch(model, loader, precision, accum_steps, clip):
    """timm ``train_one_epoch`` with ``NativeScaler`` (need_update, last_accum_steps)."""
    dtype = DTYPES[precision]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    last_accum_steps = len(loader) % accum_steps
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    for batch_idx, (inp, target) in enumerate(loader):
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = F.cross_entropy(model(inp), target)
        if accum_steps > 1:
            loss /= accum_steps
        scaler.scale(loss).backward()
        if need_update:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return model


def timm_on_ampkit(model, loader, precision, accum_steps, clip, mode):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp = MixedPrecision(
        precision, device="cpu", accumulation_steps=accum_steps, clip_grad_norm=clip
    )
    model, optimizer = amp.setup(model, optimizer)
    last_accum_steps = len(loader) % accum_steps
    for batch_idx, (inp, target) in enumerate(loader):
        if (
            mode == "set_window"
            and last_accum_steps
            and batch_idx == len(loader) - last_accum_steps
        ):
            amp.set_window(last_accum_steps)
        with amp.autocast():
            loss = F.cross_entropy(model(inp), target)
        amp.backward(loss)
        amp.step(optimizer, flush=mode == "flush" and batch_idx == len(loader) - 1)
    assert amp.optimizer_steps == -(-len(loader) // accum_steps)
    return model


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_timm_short_last_window_set_window_bitwise(precision):
    base, loader = conv_model(), image_loader(10)
    ref = timm_epoch(copy.deepcopy(base), loader, precision, 4, clip=1.0)
    got = timm_on_ampkit(copy.deepcopy(base), loader, precision, 4, 1.0, "set_window")
    assert_bitwise(ref, got)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_timm_short_last_window_flush_is_the_mean(precision):
    base, loader = conv_model(), image_loader(10)
    ref = timm_epoch(copy.deepcopy(base), loader, precision, 4, clip=100.0)
    got = timm_on_ampkit(copy.deepcopy(base), loader, precision, 4, 100.0, "flush")
    # A different rounding path (sum/4 * 4/2 vs sum/2): equal to within a few ulps of the dtype.
    for p, q in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    # Without flush the last two micro-batches would be left unstepped: a real difference.
    unflushed = timm_on_ampkit_unflushed(copy.deepcopy(base), loader, precision)
    assert not all(
        torch.allclose(p, q, rtol=1e-5, atol=1e-6)
        for p, q in zip(ref.parameters(), unflushed.parameters())
    )


def timm_on_ampkit_unflushed(model, loader, precision):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp = MixedPrecision(precision, device="cpu", accumulation_steps=4, clip_grad_norm=100.0)
    model, optimizer = amp.setup(model, optimizer)
    for inp, target in loader:
        with amp.autocast():
            loss = F.cross_entropy(model(inp), target)
        amp.backward(loss)
        amp.step(optimizer)
    return model


def test_flush_on_an_empty_window_is_a_no_op_and_set_window_validates():
    model, opt, amp = tiny_setup(accum=4)
    assert not amp.step(opt, flush=True).boundary
    with pytest.raises(ValueError, match="1..accumulation_steps"):
        amp.set_window(5)
    amp.backward(loss_of(model, 0))
    with pytest.raises(RuntimeError, match="before the window's first backward"):
        amp.set_window(2)
    result = amp.step(opt, flush=True)
    assert result.boundary and amp.optimizer_steps == 1
    # After a short window the size is back to accumulation_steps.
    for i in range(3):
        amp.backward(loss_of(model, i))
        assert not amp.step(opt).boundary
    amp.backward(loss_of(model, 3))
    assert amp.step(opt).boundary
