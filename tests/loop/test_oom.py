"""Memory-driven batching: surviving an out-of-memory error mid-run (halve the micro-batch,
double the accumulation, redo), and batch_size="auto" (the largest micro-batch that fits)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision
from ampkit.loop.data import split_batch
from ampkit.loop.trainer import Trainer


def model_():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def big(i):  # batches of 16
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 16, generator=g), torch.randint(0, 4, (16,), generator=g)


def small(j):  # the same samples as batches of 8: halves of big(j // 2)
    x, y = big(j // 2)
    h = slice(0, 8) if j % 2 == 0 else slice(8, 16)
    return x[h], y[h]


def loss_fn(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def trainer(model, batches, accum, tmp_path=None):
    amp = MixedPrecision("fp32", device="cpu", accumulation_steps=accum)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.setup(model, opt)
    return Trainer(model, opt, amp, batches, loss_fn=loss_fn, progress=False, fallback=False,
                   log_dir=str(tmp_path) if tmp_path else None, tensorboard=False)


class OOMOnce:
    """A forward hook that raises torch.OutOfMemoryError at the k-th forward call, once."""

    def __init__(self, k):
        self.k, self.calls, self.fired = k, 0, False

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.k and not self.fired:
            self.fired = True
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")


@pytest.mark.slow
def test_oom_mid_run_rebatches_and_matches_the_smaller_batch_run(tmp_path):
    ref = trainer(model_(), small, accum=2)
    ref.fit(6)
    oom = trainer(model_(), big, accum=1, tmp_path=tmp_path)
    hook = OOMOnce(k=4)  # the 4th forward: optimizer step 4's window
    oom.model[0].register_forward_pre_hook(hook)
    summary = oom.fit(6)
    assert hook.fired
    assert summary.optimizer_steps == ref.amp.optimizer_steps == 6  # no step lost, none counted twice
    for p, q in zip(ref.model.parameters(), oom.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-6)
    events = [e for e in _events(tmp_path) if e["kind"] == "oom_rebatch"]
    assert len(events) == 1 and events[0]["micro_batch"] == 8 and events[0]["accumulation_steps"] == 2
    assert oom.split == 2 and oom.amp.config.accumulation_steps == 2


def _events(run_dir):
    from ampkit.observe.monitor import read_jsonl

    return [r for r in read_jsonl(str(run_dir / "log.jsonl")) if r["type"] == "event"]


def test_oom_at_micro_batch_one_is_a_clear_error():
    def ones(i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(1, 16, generator=g), torch.randint(0, 4, (1,), generator=g)

    t = trainer(model_(), ones, accum=1)
    hook = OOMOnce(k=1)
    t.model[0].register_forward_pre_hook(hook)
    with pytest.raises(RuntimeError, match="micro-batch of 1"):
        t.fit(2)


def test_split_batch_keeps_every_sample_once():
    x, y = big(0)
    parts = split_batch((x, y), 4)
    assert len(parts) == 4 and torch.equal(torch.cat([p[0] for p in parts]), x)
    d = split_batch({"x": x, "y": y, "tag": "a"}, 2)
    assert torch.equal(d[1]["y"], y[8:]) and d[0]["tag"] == "a"
    assert copy.deepcopy(parts)[0][0].shape == (4, 16)


# --- batch_size="auto": the largest micro-batch that fits a budget, chosen from the estimate ---

def _gpt_trainer(tmp_path, **kwargs):
    from ampkit.loop.models import builtin

    torch.manual_seed(0)
    model, data = builtin("gpt", "small", batch_size=32)
    amp = MixedPrecision("fp32", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.setup(model, opt)
    return Trainer(model, opt, amp, data, progress=False, log_dir=str(tmp_path), tensorboard=False, **kwargs)


@pytest.mark.slow
def test_auto_batch_fits_the_budget_and_keeps_the_gradient_math(tmp_path):
    from ampkit.loop.estimate import estimate
    from ampkit.loop.models import builtin

    auto = _gpt_trainer(tmp_path / "auto", batch_size="auto", memory_budget="40MiB")
    summary = auto.fit(2)
    choice = auto.auto_batch
    # The estimate at the chosen micro-batch fits; at the next larger divisor of 32 it does not.
    factory = lambda: builtin("gpt", "small", batch_size=1)[0]  # noqa: E731
    x, y = auto.batches(0)
    m = choice.micro_batch
    assert 32 % m == 0 and m < 32
    assert estimate(factory, (x[:m], y[:m])).peak_bytes <= 40 * 2**20 < estimate(factory, (x[:2 * m], y[:2 * m])).peak_bytes
    assert summary.micro_batch == m and any("micro-batch" in n for n in summary.notes)
    assert auto.amp.config.accumulation_steps == 32 // m
    events = [e for e in _events(tmp_path / "auto") if e["kind"] == "auto_batch"]
    assert len(events) == 1 and events[0]["micro_batch"] == m
    # Same parameters as the whole batch in one piece (fp32, accumulation over equal micro-batches).
    whole = _gpt_trainer(tmp_path / "whole")
    whole.fit(2)
    for p, q in zip(whole.model.parameters(), auto.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_auto_batch_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="choose 'auto'"):
        _gpt_trainer(tmp_path, batch_size=8)
    with pytest.raises(ValueError, match="only used with batch_size=.auto."):
        _gpt_trainer(tmp_path, memory_budget="1GiB")
    with pytest.raises(ValueError, match="8XB"):
        _gpt_trainer(tmp_path, batch_size="auto", memory_budget="8XB")
    with pytest.raises(ValueError, match="needs a memory budget on cpu"):
        _gpt_trainer(tmp_path, batch_size="auto").fit(1)
    with pytest.raises(ValueError, match="not even a micro-batch of 1 fits"):
        _gpt_trainer(tmp_path, batch_size="auto", memory_budget="1MiB").fit(1)
