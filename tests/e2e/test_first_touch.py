"""What a new user touches first (hardening issue 34 §5), one test per failure, run as a user runs it."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from ampkit import MixedPrecision, Trainer


# 1 ------------------------------------------------------------------------- every API takes what the Trainer takes
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.lin(x).float(), y)


def loader(n: int = 40, batch: int = 8, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=batch, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(2) if shuffle else None)


def test_trainer_evaluates_on_a_dataloader():
    torch.manual_seed(0)
    model, opt = Net(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    val = loader(n=24, batch=8)  # 3 batches: fewer than eval_steps=4, so all 3 are used
    t = Trainer(model, opt, amp, loader(), progress=False, eval_batches=val, eval_every=2)
    summary = t.fit(4)
    assert [s for s, _ in summary.eval_losses] == [2, 4]
    with torch.no_grad():  # the same model, the same batches, the same process: bitwise
        ref = torch.stack([model(x, y).float() for x, y in val]).mean().item()
    assert summary.eval_losses[-1][1] == ref
    assert t.evaluate() == ref  # a DataLoader is read anew at each evaluation


def test_eval_batches_that_cannot_be_read_again_are_refused_at_construction():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    with pytest.raises(TypeError, match="eval_batches is a one-shot iterator"):
        Trainer(model, opt, amp, loader(), eval_batches=(b for b in loader()), eval_every=2)
    with pytest.raises(TypeError, match="eval_batches='int'"):
        Trainer(model, opt, amp, loader(), eval_batches=3, eval_every=2)


def test_compare_takes_a_dataloader_and_sees_its_batches_in_order():
    data = loader(n=24, batch=8, shuffle=True)  # 3 batches an epoch: compare reads several epochs
    rep = ampkit.compare(Net, data, ["fp32", "bf16"], steps=4, warmup=1, repeats=1, device="cpu")
    ok = {r.precision: r for r in rep.results if r.status == "ok"}
    assert set(ok) == {"fp32", "bf16"} and rep.batch_size == 8 and ok["fp32"].samples_per_s > 0
    # the fp32 row trained on the loader's batches, epoch after epoch, as the Trainer walks them
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    summary = Trainer(model, opt, amp, loader(n=24, batch=8, shuffle=True), progress=False, log_every=1).fit(5)
    assert ok["fp32"].losses == pytest.approx(summary.losses, rel=0, abs=0)


def test_confirm_auto_takes_a_dataloader(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    model = Net()
    amp = MixedPrecision("auto", device="cpu")
    choice = ampkit.confirm_auto(amp, model, loader(), use_cache=False)
    assert choice.precision == amp.precision.name
