"""What only a GPU can show: memory estimates vs the CUDA allocator, a real out-of-memory error
recovered mid-run, batch_size="auto" on the device, fp8 on tensor cores. Skipped without CUDA."""

import gc

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import builtin
from ampkit.plan.estimate import estimate
from ampkit.train.trainer import Trainer

pytestmark = pytest.mark.cuda


def _clean():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _setup(size, precision, batch, **amp_kwargs):
    torch.manual_seed(0)
    model, data = builtin("gpt", size, batch_size=batch, device=torch.device("cuda"))
    amp = MixedPrecision(precision, device="cuda", **amp_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = amp.setup(model, opt)
    return model, opt, amp, data


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-pure"])
def test_estimate_within_10_percent_of_cuda_peak(precision):
    _clean()
    model, opt, amp, data = _setup("medium", precision, 8)
    for i in range(2):  # the second step is measured (the first creates the optimizer state)
        if i == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with amp.autocast():
            loss = model(*data(i))
        amp.backward(loss)
        amp.step(opt)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    predicted = estimate(
        lambda: builtin("gpt", "medium", batch_size=1)[0],
        data(0),
        precision=precision,
        device="cuda",
    ).peak_bytes
    assert abs(predicted - measured) / measured < 0.10, (predicted, measured)


def test_real_out_of_memory_is_recovered_by_rebatching(tmp_path):
    """A memory cap that holds micro-batch 16 but not 32: a real torch.OutOfMemoryError at the
    first window, one oom_rebatch, and the run finishes with the effective batch kept."""
    _clean()
    factory = lambda: builtin("gpt", "medium", batch_size=1)[0]  # noqa: E731
    _, data = builtin("gpt", "medium", batch_size=32)
    x, y = data(0)
    half = estimate(factory, (x[:16], y[:16]), device="cuda").peak_bytes
    full = estimate(factory, (x, y), device="cuda").peak_bytes
    assert full > 1.4 * half
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (half + full) / 2 / total))
    try:
        model, opt, amp, data = _setup("medium", "fp32", 32)
        t = Trainer(model, opt, amp, data, progress=False, log_dir=str(tmp_path), tensorboard=False)
        summary = t.fit(3)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        _clean()
    assert summary.optimizer_steps == 3
    assert t.split == 2 and summary.micro_batch == 16 and amp.config.accumulation_steps == 2
    assert any("out of memory" in n for n in summary.notes)


def test_auto_batch_on_cuda(tmp_path):
    _clean()
    model, opt, amp, data = _setup("medium", "bf16", 64)
    big = Trainer(model, opt, amp, data, progress=False, tensorboard=False, batch_size="auto")
    big.fit(1)  # the device's free memory: the whole batch fits an H100-class GPU
    assert big.auto_batch.split == 1 and big.auto_batch.budget_bytes > 0
    del big, model, opt, amp, data
    _clean()
    model, opt, amp, data = _setup("medium", "bf16", 64)
    capped = Trainer(
        model,
        opt,
        amp,
        data,
        progress=False,
        tensorboard=False,
        batch_size="auto",
        memory_budget="1GiB",
    )
    s = capped.fit(2)
    assert capped.auto_batch.split > 1 and capped.auto_batch.predicted_bytes <= 2**30
    assert torch.cuda.max_memory_allocated() <= 1.1 * 2**30
    assert s.optimizer_steps == 2 and s.micro_batch == 64 // capped.auto_batch.split


def test_fp8_trains_like_bf16_on_tensor_cores():
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 tensor cores need compute capability 8.9+ (Ada, Hopper)")
    losses = {}
    for precision in ("bf16", "fp8"):
        _clean()
        model, opt, amp, data = _setup("medium", precision, 8)
        out = []
        for i in range(30):
            with amp.autocast():
                loss = model(*data(i))
            amp.backward(loss)
            amp.step(opt)
            out.append(loss.detach().float())
        losses[precision] = torch.stack(out[-5:]).mean().item()
    assert losses["fp8"] == pytest.approx(losses["bf16"], rel=0.05)
