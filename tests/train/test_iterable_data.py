"""Trainer over any iterable of batches: a DataLoader, a list, a factory; epochs, records, resume."""

import json

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from ampkit import MixedPrecision
from ampkit.train.trainer import Trainer, TrainingInterrupted


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x).float(), y)


def dataset():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(100, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin() + 0.1 * torch.randn(100, 1, generator=g))


def loader(kind):
    """100 samples, batch 16 (the last batch 4), shuffled: by a seeded generator (the loader's or
    its RandomSampler's), by the global generator, or by a DistributedSampler (set_epoch each
    epoch)."""
    ds = dataset()
    if kind == "generator":
        return DataLoader(
            ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7)
        )
    if kind == "sampler":
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(7))
        return DataLoader(ds, batch_size=16, sampler=sampler)
    if kind == "global":
        return DataLoader(ds, batch_size=16, shuffle=True)
    return DataLoader(
        ds, batch_size=16, sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    )


def setup(precision="bf16", accum=1):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = MixedPrecision(precision, accumulation_steps=accum)
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def hand_loop(data, epochs, precision="bf16", accum=1):
    """The loop a user writes with ampkit's engine: every batch of every epoch, the last short
    window of an epoch stepped on its own (amp.set_window)."""
    model, opt, amp = setup(precision, accum)
    torch.manual_seed(123)
    for epoch in range(epochs):
        sampler = getattr(data, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        n = len(data)
        for i, batch in enumerate(data):
            if i % accum == 0 and n - i < accum:
                amp.set_window(n - i)
            with amp.autocast():
                loss = model(*batch)
            amp.backward(loss)
            amp.step(opt)
    return model, amp


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_bitwise(a, b):
    for x, y in zip(params(a), params(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("accum", [1, 2])
def test_dataloader_epochs_bitwise_with_hand_loop_and_epoch_records(tmp_path, accum):
    ref, ref_amp = hand_loop(loader("generator"), 3, accum=accum)
    model, opt, amp = setup(accum=accum)
    torch.manual_seed(123)
    summary = Trainer(model, opt, amp, loader("generator"), log_dir=str(tmp_path), log_every=3).fit(
        epochs=3
    )
    assert_bitwise(model, ref)
    steps_per_epoch = -(-7 // accum)  # 7 batches: 6 of 16 and one of 4
    assert amp.optimizer_steps == ref_amp.optimizer_steps == 3 * steps_per_epoch
    log = read(tmp_path / "log.jsonl")
    epochs = [r for r in log if r.get("kind") == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    steps = [r for r in log if r["type"] == "step"]
    for e in epochs:
        assert e["samples"] == 100 and e["steps"] == steps_per_epoch and e["seconds"] > 0
        mine = steps[e["epoch"] * steps_per_epoch : (e["epoch"] + 1) * steps_per_epoch]
        assert mine[-1]["step"] == e["step"]
        assert [r["epoch"] for r in mine] == [
            e["epoch"]
        ] * steps_per_epoch  # each step record carries its epoch
        assert e["loss"] == pytest.approx(sum(r["loss"] for r in mine) / steps_per_epoch, rel=1e-6)
    assert [e["epoch"] for e in summary.epochs] == [0, 1, 2] and summary.epochs[0][
        "samples_per_s"
    ] > 0
    assert summary.samples_per_s > 0  # counted from the batches (16 per step)
    assert summary.epochs[1]["loss"] < summary.epochs[0]["loss"] * 1.5


@pytest.mark.parametrize("kind", ["generator", "global", "distributed"])
def test_resume_inside_an_epoch_is_bitwise(tmp_path, kind):
    ref, _ = hand_loop(loader(kind), 3)

    class StopAt:
        def on_step_end(self, trainer, step, result):
            if step == 10:  # epoch 2 (steps 8..14), batch 3 of 7
                trainer.request_stop()

    model, opt, amp = setup()
    torch.manual_seed(123)
    first = Trainer(
        model,
        opt,
        amp,
        loader(kind),
        callbacks=[StopAt()],
        checkpoint_dir=str(tmp_path / "ck"),
        log_dir=str(tmp_path / "log"),
    )
    with pytest.raises(TrainingInterrupted):
        first.fit(epochs=3)
    assert amp.optimizer_steps == 10 and first.source.epoch == 1 and first.source.in_epoch == 3
    state = torch.load(sorted((tmp_path / "ck").glob("*.pt"))[-1], weights_only=True)
    assert (
        state["run"]["epoch"] == 1
        and state["run"]["batch_in_epoch"] == 3
        and state["run"]["loss"] > 0
    )

    torch.manual_seed(999)  # the resumed process's own RNG: replaced by the checkpoint's
    model, opt, amp = setup()
    second = Trainer(
        model,
        opt,
        amp,
        loader(kind),
        checkpoint_dir=str(tmp_path / "ck"),
        log_dir=str(tmp_path / "log"),
    )
    assert second.resume() is not None
    summary = second.fit(epochs=3)
    assert_bitwise(model, ref)
    assert amp.optimizer_steps == 21 and [e["epoch"] for e in summary.epochs] == [1, 2]
    log = read(tmp_path / "log" / "log.jsonl")
    epochs = [r for r in log if r.get("kind") == "epoch"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2] and all(e["samples"] == 100 for e in epochs)
    steps = [r for r in log if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 22))
    assert epochs[1]["loss"] == pytest.approx(sum(r["loss"] for r in steps[7:14]) / 7, rel=1e-6)
    stop = next(r for r in log if r.get("kind") == "stop")
    checkpoint = [r for r in log if r.get("kind") == "checkpoint"][-1]
    assert stop["epoch"] == checkpoint["epoch"] == 1 and stop["loss"] == pytest.approx(
        steps[9]["loss"]
    )


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("kind", ["generator", "sampler", "global"])
def test_a_checkpoint_at_any_step_epoch_ends_included_resumes_bitwise(tmp_path, kind, accum):
    """Every checkpoint of a 2-epoch run, resumed by a fresh Trainer (fresh model, loader and
    generator, another global seed), ends with the uninterrupted run's parameters bitwise. A
    checkpoint at an epoch's last step resumed epoch 1 in epoch 0's order for a loader that
    shuffles with its own generator: the generator's state after the pass was in no checkpoint."""
    from ampkit.loop.checkpoint import load_checkpoint

    ref, _ = hand_loop(loader(kind), 2, accum=accum)
    model, opt, amp = setup(accum=accum)
    torch.manual_seed(123)
    run = Trainer(
        model,
        opt,
        amp,
        loader(kind),
        checkpoint_dir=str(tmp_path),
        checkpoint_every=1,
        keep_last=None,
        progress=False,
    )
    run.fit(epochs=2)
    assert_bitwise(model, ref)
    per_epoch = -(-7 // accum)
    paths = sorted(tmp_path.glob("*.pt"))
    assert len(paths) == 2 * per_epoch
    differ = []
    for k, path in enumerate(paths[:-1], start=1):
        model, opt, amp = setup(accum=accum)
        torch.manual_seed(999)  # the resumed process's own RNG: replaced by the checkpoint's
        resumed = Trainer(model, opt, amp, loader(kind), progress=False)
        resumed.load_state_dict(load_checkpoint(str(path)), source=str(path))
        resumed.fit(epochs=2)
        if any(not torch.equal(a, b) for a, b in zip(params(model), params(ref))):
            differ.append(f"step {k}" + (" (an epoch's end)" if k % per_epoch == 0 else ""))
    assert not differ


def test_list_and_factory_and_one_shot_generator():
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)) for n in (5, 5, 3)]
    ref, _ = hand_loop(batches, 2)
    for data in (batches, lambda: iter(batches), lambda: (b for b in batches)):
        model, opt, amp = setup()
        torch.manual_seed(123)
        s = Trainer(model, opt, amp, data).fit(epochs=2)
        assert_bitwise(model, ref)
        assert [e["samples"] for e in s.epochs] == [13, 13] and s.optimizer_steps == 6
    model, opt, amp = setup()
    t = Trainer(model, opt, amp, (b for b in batches))
    assert t.fit(epochs=1).optimizer_steps == 3  # a one-shot generator: one epoch
    with pytest.raises(ValueError, match="one-shot generator"):
        t.fit(epochs=2)
    with pytest.raises(ValueError, match="already completed 1 epoch"):
        t.fit(epochs=1)
    model, opt, amp = setup()
    s = Trainer(model, opt, amp, batches).fit(4)  # steps= runs on across epochs
    assert s.optimizer_steps == 4 and [e["epoch"] for e in s.epochs] == [0]
    with pytest.raises(TypeError, match="neither a function of the batch index"):
        Trainer(model, opt, amp, 3)


def test_step_records_of_indexed_data_carry_the_epoch_of_their_batches(tmp_path):
    """A function of the index with batches_per_epoch=3: steps 1-3 are epoch 0, 4-6 epoch 1 (the
    last batch of an epoch belongs to that epoch, though the index has already moved on)."""
    x = torch.randn(6, 16, 8, generator=torch.Generator().manual_seed(2))

    def batches(i):
        return x[i % 6], x[i % 6].sum(1, keepdim=True).sin()

    batches.batches_per_epoch = 3
    model, opt, amp = setup("fp32")
    Trainer(model, opt, amp, batches, log_dir=str(tmp_path), log_every=2).fit(6)
    steps = [r for r in read(tmp_path / "log.jsonl") if r["type"] == "step"]
    assert [r["epoch"] for r in steps] == [0, 0, 0, 1, 1, 1]


def test_a_resume_with_another_batch_size_is_refused(tmp_path):
    """A run resumed with batches of another size trained on, without a word: the data position
    (batches taken) then names other samples and the effective batch changes, which a changed
    accumulation_steps is refused for. The checkpoint records the data's batch size; a resume
    whose data declares another one is refused before anything is loaded."""
    from ampkit import CheckpointMismatch

    def trainer(data):
        model, opt, amp = setup("fp32")
        return Trainer(model, opt, amp, data, checkpoint_dir=str(tmp_path / "ck"), progress=False)

    first = trainer(DataLoader(dataset(), batch_size=16))
    first.fit(3)
    first.save_checkpoint()
    with pytest.raises(CheckpointMismatch, match="batches of 16 samples.*8"):
        trainer(DataLoader(dataset(), batch_size=8)).resume()
    assert trainer(DataLoader(dataset(), batch_size=16)).resume() is not None

    class Indexed:  # a function of the index that declares its batch
        def __init__(self, n):
            self.samples_per_batch = n

        def __call__(self, i):
            return dataset()[i * self.samples_per_batch : (i + 1) * self.samples_per_batch]

    with pytest.raises(CheckpointMismatch, match="batches of 16 samples.*4"):
        trainer(Indexed(4)).resume()
    assert trainer(Indexed(16)).resume() is not None
    assert trainer([next(iter(DataLoader(dataset(), batch_size=8)))]).resume() is not None  # unsaid


def _ckpt_trainer(data, ckdir):
    model, opt, amp = setup("fp32")
    return Trainer(model, opt, amp, data, checkpoint_dir=str(ckdir), progress=False)


@pytest.mark.parametrize("kind", ["indexed", "loader"])
def test_a_resume_with_another_number_of_processes_is_refused(tmp_path, kind):
    """A 2-process run resumed with 3 processes trained on without a word: rank r of W reads
    batches i * W + r (a DistributedSampler its share), so some batches were never trained, the
    effective batch changed and the new rank started from a fresh RNG. The checkpoint records the
    number of processes; another one is refused before anything is loaded, naming both. (A
    1-process checkpoint stands in for a 2-process one by its recorded world size.)"""
    from ampkit import CheckpointMismatch
    from ampkit.loop.checkpoint import load_checkpoint

    def data():
        if kind == "loader":
            return DataLoader(dataset(), batch_size=16)
        return lambda i: dataset()[16 * (i % 6) : 16 * (i % 6 + 1)]

    first = _ckpt_trainer(data(), tmp_path)
    first.fit(3)
    state = load_checkpoint(first.save_checkpoint())
    assert state["data"]["world_size"] == 1
    state["data"]["world_size"] = 2  # as a 2-process run records it
    second = _ckpt_trainer(data(), tmp_path)
    before = params(second.model)
    with pytest.raises(
        CheckpointMismatch,
        match=r"ck: its run had 2 processes, this one has 1: .*resume with 2 processes "
        r"\(ampkit train: --nproc_per_node 2\) or start a new run",
    ):
        second.load_state_dict(state, source="ck")
    assert all(torch.equal(a, b) for a, b in zip(params(second.model), before))
    assert second.amp.optimizer_steps == 0 and second.micro_index == 0  # nothing was loaded
    del state["data"]["world_size"]  # a checkpoint from before the field: resumes as before
    second.load_state_dict(state, source="ck")
    assert second.amp.optimizer_steps == 3 and second.micro_index == 3


def test_a_resume_with_another_sequence_length_is_refused(tmp_path):
    """Text batches of 16 tokens a sample resumed with 8 (``ampkit train --block_size``) trained on
    without a word: batch i then holds other windows of text, an epoch another number of batches
    and a step another number of tokens. The checkpoint records the data's tokens per batch; a
    resume whose data declares another is refused before anything is loaded, naming both."""
    from ampkit import CheckpointMismatch
    from ampkit.models.data import TextBatches

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 256)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.emb(x).flatten(0, 1), y.flatten())

    def trainer(block):
        torch.manual_seed(0)
        model = Bigram()
        amp = MixedPrecision("fp32")
        model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = TextBatches(batch_size=2, block_size=block)
        return Trainer(model, opt, amp, data, checkpoint_dir=str(tmp_path), progress=False)

    first = trainer(16)
    first.fit(2)
    first.save_checkpoint()
    with pytest.raises(
        CheckpointMismatch,
        match=r"its run read samples of 16 tokens, this data's are 8 \(2 samples a batch\).*"
        r"resume with samples of 16 tokens \(ampkit train: --block_size 16\) or start a new run",
    ):
        trainer(8).resume()
    assert trainer(16).resume() is not None
