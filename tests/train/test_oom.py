"""Memory-driven batching: surviving an out-of-memory error mid-run (halve the micro-batch,
double the accumulation, redo), and batch_size="auto" (the largest micro-batch that fits)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision
from ampkit.models.data import split_batch
from ampkit.train.trainer import Trainer


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


LR = 1e-2
EPS32 = torch.finfo(torch.float32).eps


def recording(trainer):
    """``trainer.grads``: the gradients each optimizer step is given."""
    params = list(trainer.model.parameters())
    trainer.grads = []

    def keep(optimizer, args, kwargs):
        trainer.grads.append([p.grad.clone() for p in params])

    trainer.optimizer.register_step_pre_hook(keep)
    return trainer


def assert_same_sgd_run(a, b, n_terms):
    """Two fp32 runs of plain SGD took the same steps up to rounding: each gradient element is a
    sum of ``n_terms`` per-sample (per-token) terms, which the two runs add in other orders (other
    micro-batches).

    Any order of an n-term fp32 sum is within (n - 1) * u * sum|terms| of the exact sum (u = eps/2,
    the worst case; Higham, Accuracy and Stability, 4.2), sum|terms| taken as the tensor's largest
    gradient; two runs: n * eps * max|g| (an EPYC, with and without AVX-512: <= 2 eps * max|g| at
    n = 16, <= 15 at n = 2048). A later step starts from weights within lr * that of each other
    (below their own rounding): the same bound. The weights, w - lr * g rounded once a step in each
    run: atol lr * the bounds' sum, rtol steps * eps. SGD, not Adam: Adam's first update
    lr * g / (|g| + eps) is ~lr * sign(g), so a gradient within rounding of 0 moves a weight by up
    to 2 * lr, which no dtype bounds (an AMX Xeon's kernels did).
    """
    assert len(a.grads) == len(b.grads) > 0
    lr = b.optimizer.param_groups[0]["lr"]
    bounds = [[n_terms * EPS32 * float(g.abs().max()) for g in step] for step in b.grads]
    for got, want, tols in zip(a.grads, b.grads, bounds):
        for g, w, tol in zip(got, want, tols):
            torch.testing.assert_close(g, w, rtol=0, atol=tol)
    for p, q, *tols in zip(b.model.parameters(), a.model.parameters(), *bounds):
        torch.testing.assert_close(q, p, rtol=len(bounds) * EPS32, atol=lr * sum(tols))


def trainer(model, batches, accum, tmp_path=None):
    amp = MixedPrecision("fp32", device="cpu", accumulation_steps=accum)
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # compared up to rounding: assert_same_sgd_run
    model, opt = amp.setup(model, opt)
    log_dir = str(tmp_path) if tmp_path else None
    return recording(
        Trainer(
            model,
            opt,
            amp,
            batches,
            loss_fn=loss_fn,
            progress=False,
            fallback=False,
            log_dir=log_dir,
            tensorboard=False,
        )
    )


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
    assert (
        summary.optimizer_steps == ref.amp.optimizer_steps == 6
    )  # no step lost, none counted twice
    assert_same_sgd_run(oom, ref, n_terms=16)  # steps 1-3: one batch of 16 against two of 8
    events = [e for e in _events(tmp_path) if e["kind"] == "oom_rebatch"]
    assert (
        len(events) == 1 and events[0]["micro_batch"] == 8 and events[0]["accumulation_steps"] == 2
    )
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
    """GPT tiny on batches of 32 x 64 tokens, fp32, SGD (see assert_same_sgd_run)."""
    from ampkit.models.builtin import builtin

    torch.manual_seed(0)
    model, data = builtin("gpt", "tiny", batch_size=32)
    amp = MixedPrecision("fp32", device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.setup(model, opt)
    return recording(
        Trainer(
            model,
            opt,
            amp,
            data,
            progress=False,
            log_dir=str(tmp_path),
            tensorboard=False,
            **kwargs,
        )
    )


@pytest.mark.slow
def test_auto_batch_fits_the_budget_and_keeps_the_gradient_math(tmp_path):
    from ampkit.models.builtin import builtin
    from ampkit.plan.estimate import estimate

    auto = _gpt_trainer(tmp_path / "auto", batch_size="auto", memory_budget="6MiB")
    summary = auto.fit(2)
    choice = auto.auto_batch
    # The estimate at the chosen micro-batch fits; at the next larger divisor of 32 it does not.
    factory = lambda: builtin("gpt", "tiny", batch_size=1)[0]  # noqa: E731
    x, y = auto.batches(0)
    m = choice.micro_batch
    assert 32 % m == 0 and m < 32
    peak = lambda b: estimate(factory, (x[:b], y[:b]), optimizer="sgd").peak_bytes  # noqa: E731
    assert peak(m) <= 6 * 2**20 < peak(2 * m)
    assert summary.micro_batch == m and any("micro-batch" in n for n in summary.notes)
    assert auto.amp.config.accumulation_steps == 32 // m
    events = [e for e in _events(tmp_path / "auto") if e["kind"] == "auto_batch"]
    assert len(events) == 1 and events[0]["micro_batch"] == m
    # The same steps as the whole batch in one piece (fp32, accumulation over equal micro-batches).
    whole = _gpt_trainer(tmp_path / "whole")
    whole.fit(2)
    assert_same_sgd_run(auto, whole, n_terms=32 * 64)


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
