"""Spike rollback in memory (ampkit.train.rollback): a run that met a corrupted batch (targets x1000)
and a NaN batch ends bitwise where a run that never saw them ends; a clean run records nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit.train.rollback import SpikeGuard
from ampkit.train.trainer import Trainer

CORRUPT, NAN = 13, 22  # data indices of the bad batches (after the detector's warmup)
STEPS = 28


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return nn.functional.mse_loss(out.float(), y)


def data(bad: bool, corrupt: tuple[int, ...] = (CORRUPT,), nan: tuple[int, ...] = (NAN,)):
    """Batches ``(x, y)``; with ``bad`` the ``corrupt`` ones have targets x1000 and the ``nan`` ones a
    NaN input, without it those indices are left out (a run that never saw them)."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 8, generator=g) for _ in range(STEPS + 8)]
    ws = torch.randn(8, 4, generator=g)
    ys = [
        x @ ws for x in xs
    ]  # computed once: an fp32 matmul's last bits may depend on memory alignment
    order = [i for i in range(STEPS + 8) if bad or i not in corrupt + nan]

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = order[i]
        x, y = xs[k], ys[k]
        if bad and k in corrupt:
            y = y * 1000
        if bad and k in nan:
            x = x.clone()
            x[3, 2] = float("nan")
        return x, y

    return batch


def build(precision: str):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = ampkit.MixedPrecision(precision, device="cpu")
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def reference(precision: str) -> dict[str, torch.Tensor]:
    model, opt, amp = build(precision)
    batches = data(bad=False)
    for i in range(STEPS):
        with amp.autocast():
            loss = model(*batches(i))
        amp.backward(loss)
        amp.step(opt)
    return amp.full_precision_state_dict()


class Listed(torch.utils.data.Dataset):
    """The batches of :func:`data` as a map-style dataset (a DataLoader with ``batch_size=None``)."""

    def __init__(self, bad: bool) -> None:
        self.batch, self.n = data(bad), STEPS + 8 - (0 if bad else 2)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch(i)


def guarded(precision: str, bad: bool, every: int = 4, loader: bool = False):
    model, opt, amp = build(precision)
    guard = SpikeGuard(model, opt, amp, keep=2, every=every)
    source = torch.utils.data.DataLoader(Listed(bad), batch_size=None) if loader else data(bad)
    batches = guard.wrap(source)
    pos, held = guard.position, 0
    while amp.optimizer_steps < STEPS:
        with amp.autocast():
            loss = model(*batches(pos))
        amp.backward(loss)
        amp.step(opt)
        pos = guard.check(pos + 1)
        held = max(held, getattr(batches, "held", 0))
    guard.held = held  # the most batches an iterable's view kept at once
    return amp, guard


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_hand_written_loop_rolls_back_and_ends_like_a_run_without_the_bad_batches(precision):
    amp, guard = guarded(precision, bad=True)
    spikes = [e for e in amp.events if e.kind == "spike"]
    assert [e.data["batches"] for e in spikes] == [[CORRUPT], [NAN]]
    assert (
        spikes[0].data["offending_step"] == CORRUPT + 1 and spikes[1].data["offending_step"] == NAN
    )
    assert "loss_zscore" in spikes[0].data["cause"]
    assert {"nonfinite_loss", "nonfinite_grads"} <= set(spikes[1].data["cause"])
    assert spikes[0].data["loss"] > 1000 and spikes[1].data["loss"] == "nan"
    assert guard.skipped == {CORRUPT, NAN} and amp.optimizer_steps == STEPS
    ref = reference(precision)
    assert_bitwise(amp.full_precision_state_dict(), ref)
    # Without the guard the corrupted batch leaves its mark: the comparison above can fail.
    unguarded, _, uamp = build(precision)
    batches = data(bad=True)
    for i in range(STEPS):
        with uamp.autocast():
            loss = unguarded(*batches(i))
        uamp.backward(loss)
        uamp.step(_)
    assert not all(torch.equal(v, ref[k]) for k, v in uamp.full_precision_state_dict().items())


def test_hand_written_loop_over_a_dataloader_rolls_back_like_one_over_an_index_function():
    """``guard.wrap`` takes what the Trainer takes (issue 34 section 5): a DataLoader is read in
    order and only the batches a rollback can return to are kept (since the oldest snapshot)."""
    amp, guard = guarded("bf16", bad=True, loader=True)
    assert [e.data["batches"] for e in amp.events if e.kind == "spike"] == [[CORRUPT], [NAN]]
    assert_bitwise(amp.full_precision_state_dict(), reference("bf16"))
    assert 0 < guard.held <= guard.keep * guard.every + 2  # two intervals and the step in reading


def test_wrap_takes_a_generator_and_refuses_what_is_not_batches():
    model, opt, amp = build("bf16")
    guard = SpikeGuard(model, opt, amp)
    view = guard.wrap(iter(["a", "b", "c"]))
    assert [view(0), view(1), view(1), view(2)] == ["a", "b", "b", "c"]
    with pytest.raises(TypeError, match="neither a function of the batch index"):
        guard.wrap(3)


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_a_clean_run_records_nothing_and_matches_an_unguarded_run(precision):
    amp, guard = guarded(precision, bad=False)
    assert not [e for e in amp.events if e.kind == "spike"] and guard.rollbacks == 0
    assert_bitwise(amp.full_precision_state_dict(), reference(precision))


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])
def test_trainer_spike_rollback(precision, tmp_path):
    model, opt, amp = build(precision)
    trainer = Trainer(
        model,
        opt,
        amp,
        data(bad=True),
        loss_fn=lambda m, b: m(*b),
        fallback=False,
        diagnose=False,
        spike_rollback={"every": 4},
        log_dir=str(tmp_path),
        log_every=4,
    )
    summary = trainer.fit(STEPS)
    assert amp.optimizer_steps == STEPS
    assert [e.data["batches"] for e in amp.events if e.kind == "spike"] == [[CORRUPT], [NAN]]
    assert_bitwise(amp.full_precision_state_dict(), reference(precision))
    assert "spike" in (tmp_path / "log.jsonl").read_text()
    assert summary is not None


def test_trainer_spike_rollback_refuses_a_dataloader_at_once_and_its_recipe_runs_exactly():
    """A DataLoader with ``spike_rollback`` is refused when the Trainer is made (not at ``fit``),
    saying why (a resume could not re-read the batches a rollback returns to: an iterator's
    consumed batches are gone) and what to do; the recipe it gives -- the loader's batches as a
    function of the index -- rolls back exactly as the index function does."""
    from torch.utils.data import DataLoader

    batch = data(bad=True)
    rows = [batch(i) for i in range(STEPS + 8)]
    loader = DataLoader(rows, batch_size=None)
    model, opt, amp = build("bf16")
    with pytest.raises(ValueError) as e:
        Trainer(model, opt, amp, loader, loss_fn=lambda m, b: m(*b), spike_rollback=True)
    msg = str(e.value)
    for words in (
        "DataLoader",
        "function of the batch index",
        "resume",
        "list(loader)",
        "SpikeGuard",
    ):
        assert words in msg, msg
    cached = list(loader)  # the message's recipe
    trainer = Trainer(
        model,
        opt,
        amp,
        lambda i: cached[i % len(cached)],
        loss_fn=lambda m, b: m(*b),
        fallback=False,
        diagnose=False,
        spike_rollback={"every": 4},
        progress=False,
    )
    trainer.fit(STEPS)
    assert [e.data["batches"] for e in amp.events if e.kind == "spike"] == [[CORRUPT], [NAN]]
    assert_bitwise(amp.full_precision_state_dict(), reference("bf16"))


def test_rollback_restores_the_scheduler_and_goes_further_back_when_a_snapshot_is_suspect():
    """Two corrupted batches in one interval: the replay after the first rollback triggers again from
    the same snapshot, so the guard drops that snapshot and restores the one before it."""
    bad = {"corrupt": (CORRUPT, CORRUPT + 1), "nan": ()}
    model, opt, amp = build("bf16")
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.9)
    trainer = Trainer(
        model,
        opt,
        amp,
        data(True, **bad),
        loss_fn=lambda m, b: m(*b),
        fallback=False,
        diagnose=False,
        scheduler=sched,
        spike_rollback={"every": 4, "keep": 3},
    )
    trainer.fit(STEPS)
    spikes = [e.data for e in amp.events if e.kind == "spike"]
    assert [s["batches"] for s in spikes] == [[CORRUPT], [CORRUPT + 1]]
    assert spikes[1]["rolled_back_to"] < spikes[0]["rolled_back_to"]  # one snapshot further back
    ref_model, ref_opt, ref_amp = build("bf16")
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 3, gamma=0.9)
    Trainer(
        ref_model,
        ref_opt,
        ref_amp,
        data(False, **bad),
        loss_fn=lambda m, b: m(*b),
        fallback=False,
        scheduler=ref_sched,
    ).fit(STEPS)
    assert sched.state_dict() == ref_sched.state_dict()
    assert_bitwise(amp.full_precision_state_dict(), ref_amp.full_precision_state_dict())


def test_bad_settings_are_refused_with_the_valid_ranges():
    model, opt, amp = build("bf16")
    with pytest.raises(ValueError, match="every=0 is out of range"):
        SpikeGuard(model, opt, amp, every=0)
    with pytest.raises(ValueError, match="spike_rollback='yes'"):
        Trainer(model, opt, amp, data(bad=False), spike_rollback="yes").fit(1)
    with pytest.raises(RuntimeError, match="before amp.setup"):
        SpikeGuard(model, opt, ampkit.MixedPrecision("bf16", device="cpu"))
