"""Recipes from PyTorch's "Automatic Mixed Precision examples" (https://pytorch.org/docs/stable/notes/amp_examples.html)
and Hugging Face's ``num_items_in_batch`` loss, each hand-written with ``torch.autocast`` +
``torch.amp.GradScaler`` and ported to ampkit's step: the parameters must be bitwise equal.

* "Working with Multiple Models, Losses, and Optimizers": ``scaler.scale(loss0).backward(retain_graph=True)``;
  ``scaler.scale(loss1).backward()`` into one step -> ``amp.backward(loss0, retain_graph=True,
  micro_step_done=False)``; ``amp.backward(loss1)``.
* "Gradient Penalty": ``torch.autograd.grad(scaler.scale(loss), ...)``, unscaled by hand with
  ``1. / scaler.get_scale()`` -> ``amp.scale(loss)`` and ``amp.get_scale()``.
* A loss already normalised over the accumulation window (the sum over the window's items divided
  by their count, HF ``Trainer``'s ``num_items_in_batch``) -> ``amp.backward(loss, normalized=True)``.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision

from ..support.reference_loop import DTYPES

PRECISIONS = ["fp32", "bf16", "fp16"]


def make_model(seed=0, width=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.GELU(), torch.nn.Linear(width, 4)
    )


def batches(n, seed=1, size=6):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g))
        for _ in range(n)
    ]


def torch_autocast(precision):
    dtype = DTYPES[precision]
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def assert_bitwise(ref, got):
    for (name, a), b in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(a, b), name


SCALER = {"init_scale": 2.0**10, "growth_interval": 3}
POISON = 3  # the iteration whose first loss is multiplied by inf (fp16 skips it and backs off)


# ---------------------------------------------------------------- multiple losses into one step
def two_models():
    models = torch.nn.ModuleList([make_model(0), make_model(1)])
    opts = [
        torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
        torch.optim.AdamW(models[1].parameters(), lr=1e-2),
    ]
    return models, opts


def multiple_losses_torch(precision, data, accum):
    models, (opt0, opt1) = two_models()
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **SCALER)
    for i, (x, y) in enumerate(data):
        with torch_autocast(precision):
            out0, out1 = models[0](x), models[1](x)
            loss0 = F.cross_entropy(2 * out0 + 3 * out1, y)
            loss1 = F.cross_entropy(3 * out0 - 5 * out1, y)
        if i // accum == POISON and precision == "fp16":
            loss0 = loss0 * math.inf
        scaler.scale(loss0 / accum).backward(retain_graph=True)
        scaler.scale(loss1 / accum).backward()
        if (i + 1) % accum == 0:
            scaler.unscale_(opt0)  # the recipe's explicit unscale of one optimizer
            scaler.step(opt0)
            scaler.step(opt1)
            scaler.update()
            opt0.zero_grad(set_to_none=True)
            opt1.zero_grad(set_to_none=True)
    return models, scaler


def multiple_losses_ampkit(precision, data, accum):
    models, opts = two_models()
    amp = MixedPrecision(precision, device="cpu", accumulation_steps=accum, **SCALER)
    models, *opts = amp.setup(models, *opts)
    for i, (x, y) in enumerate(data):
        with amp.autocast():
            out0, out1 = models[0](x), models[1](x)
            loss0 = F.cross_entropy(2 * out0 + 3 * out1, y)
            loss1 = F.cross_entropy(3 * out0 - 5 * out1, y)
        if i // accum == POISON and precision == "fp16":
            loss0 = loss0 * math.inf
        amp.backward(loss0, retain_graph=True, micro_step_done=False)
        amp.backward(loss1)
        assert amp.step().boundary == ((i + 1) % accum == 0)
    return models, amp


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("accum", [1, 2])
def test_multiple_losses_into_one_step_bitwise(precision, accum):
    data = batches(8 * accum)
    ref, scaler = multiple_losses_torch(precision, data, accum)
    got, amp = multiple_losses_ampkit(precision, data, accum)
    assert_bitwise(ref, got)
    assert amp.optimizer_steps == 8
    if precision == "fp16":
        assert amp.stats()["skipped_steps"] == 1 and amp.get_scale() == scaler.get_scale()


def test_summing_the_losses_is_not_the_same_computation():
    """Why the recipe needs two backward passes: one backward of ``loss0 + loss1`` rounds differently."""
    data = batches(8)
    ref, _ = multiple_losses_torch("fp16", data, 1)
    models, opts = two_models()
    amp = MixedPrecision("fp16", device="cpu", **SCALER)
    models, *opts = amp.setup(models, *opts)
    for i, (x, y) in enumerate(data):
        with amp.autocast():
            out0, out1 = models[0](x), models[1](x)
            loss0 = F.cross_entropy(2 * out0 + 3 * out1, y)
            loss1 = F.cross_entropy(3 * out0 - 5 * out1, y)
        amp.backward((loss0 * math.inf if i == POISON else loss0) + loss1)
        amp.step()
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), models.parameters()))


def test_an_open_micro_step_must_be_finished_before_step():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu", accumulation_steps=2)
    model, opt = amp.setup(model, opt)
    x, y = batches(1)[0]
    amp.backward(F.cross_entropy(model(x), y), micro_step_done=False)
    assert amp.stats()["pending_micro_steps"] == 1
    with pytest.raises(RuntimeError, match="micro_step_done"):
        amp.step(opt)
    amp.backward(
        F.cross_entropy(model(x), y)
    )  # same micro-step: the window still has room for one more
    assert amp.stats()["pending_micro_steps"] == 1 and not amp.step(opt).boundary
    amp.backward(F.cross_entropy(model(x), y))
    assert amp.step(opt).boundary
    amp.backward(F.cross_entropy(model(x), y), micro_step_done=False)
    amp.discard_window()  # drops the open micro-step too
    amp.backward(F.cross_entropy(model(x), y))
    amp.backward(F.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match="window"):
        amp.backward(F.cross_entropy(model(x), y))


# ---------------------------------------------------------------- gradient penalty through amp.scale
def penalty_torch(precision, data):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **SCALER)
    for i, (x, y) in enumerate(data):
        with torch_autocast(precision):
            loss = F.cross_entropy(model(x), y)
        if i == POISON and precision == "fp16":
            loss = loss * math.inf
        scaled_grad_params = torch.autograd.grad(
            outputs=scaler.scale(loss), inputs=model.parameters(), create_graph=True
        )
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with torch_autocast(precision):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, scaler


def penalty_ampkit(precision, data):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp = MixedPrecision(precision, device="cpu", **SCALER)
    model, opt = amp.setup(model, opt)
    for i, (x, y) in enumerate(data):
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        if i == POISON and precision == "fp16":
            loss = loss * math.inf
        scaled_grad_params = torch.autograd.grad(
            amp.scale(loss), model.parameters(), create_graph=True
        )
        inv_scale = 1.0 / amp.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with amp.autocast():
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            loss = loss + grad_norm.sqrt()
        amp.backward(loss)
        amp.step(opt)
    return model, amp


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gradient_penalty_bitwise(precision):
    data = batches(8)
    ref, scaler = penalty_torch(precision, data)
    got, amp = penalty_ampkit(precision, data)
    assert_bitwise(ref, got)
    assert amp.get_scale() == scaler.get_scale()  # 1.0 without loss scaling
    if precision == "fp16":
        assert amp.stats()["skipped_steps"] == 1


def test_scale_is_the_loss_scale_only():
    amp = MixedPrecision("fp16", device="cpu", init_scale=8.0)
    model = make_model()
    amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = torch.tensor(3.0, requires_grad=True)
    assert amp.scale(loss).item() == 24.0 and amp.get_scale() == 8.0
    assert [t.item() for t in amp.scale([loss, loss * 2])] == [24.0, 48.0]
    bf16 = MixedPrecision(
        "bf16", device="cpu", accumulation_steps=4
    )  # no division by the window either
    assert bf16.scale(loss) is loss and bf16.get_scale() == 1.0


# ---------------------------------------------------------------- a loss normalised over the window
def normalized_torch(model, precision, data, accum, clip):
    """HF-style: each micro-batch's summed loss divided by the window's item count; no further division."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **SCALER)
    for start in range(0, len(data), accum):
        window = data[start : start + accum]
        num_items = sum(len(y) for _, y in window)
        for x, y in window:
            with torch_autocast(precision):
                loss = F.cross_entropy(model(x), y, reduction="sum") / num_items
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model


def normalized_ampkit(model, precision, data, accum, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = MixedPrecision(
        precision, device="cpu", accumulation_steps=accum, clip_grad_norm=clip, **SCALER
    )
    model, opt = amp.setup(model, opt)
    for start in range(0, len(data), accum):
        window = data[start : start + accum]
        num_items = sum(len(y) for _, y in window)
        for j, (x, y) in enumerate(window):
            with amp.autocast():
                loss = F.cross_entropy(model(x), y, reduction="sum") / num_items
            amp.backward(loss, normalized=True)
            amp.step(opt, flush=j == len(window) - 1)  # the last, short window too, not rescaled
    return model, amp


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("accum", [1, 3])
def test_normalized_loss_bitwise(precision, accum):
    # batch sizes vary (HF's num_items_in_batch exists for that); 10 micro-batches: a short last window
    data = [
        b
        for i, size in enumerate([5, 7, 6, 3, 8, 6, 4, 7, 5, 6])
        for b in batches(1, seed=i, size=size)
    ]
    base = make_model()
    ref = normalized_torch(copy.deepcopy(base), precision, data, accum, clip=0.5)
    got, amp = normalized_ampkit(copy.deepcopy(base), precision, data, accum, clip=0.5)
    assert_bitwise(ref, got)
    assert amp.optimizer_steps == math.ceil(len(data) / accum)


def test_normalized_and_plain_losses_do_not_mix_in_a_window():
    model = make_model()
    amp = MixedPrecision("fp32", device="cpu", accumulation_steps=2)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    amp.backward(F.cross_entropy(model(x), y), normalized=True)
    with pytest.raises(ValueError, match="normalized"):
        amp.backward(F.cross_entropy(model(x), y))
    amp.backward(F.cross_entropy(model(x), y), normalized=True)
    assert amp.step(opt).boundary
    amp.backward(F.cross_entropy(model(x), y))  # a new window may take the other kind
