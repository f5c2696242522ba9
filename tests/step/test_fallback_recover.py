"""fallback_recover_after: after a fallback, retry the faster precision after N clean steps, back
off (double N) when trouble returns; the same parameters as a loop that switches by hand."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampkit import MixedPrecision
from ampkit.step.config import ConfigError, MixedPrecisionConfig


class Flaky(nn.Module):
    """Overflows fp16 (an activation ~1e7) while ``trouble`` is on; bf16/fp32 train through it."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.norm, self.head = (
            nn.Linear(16, 32),
            nn.Linear(32, 32),
            nn.LayerNorm(32),
            nn.Linear(32, 4),
        )
        self.trouble = False

    def forward(self, x, y):
        h = self.mid(F.gelu(self.inp(x)))
        if self.trouble:
            h = h * 1e7
        return F.cross_entropy(self.head(self.norm(h)), y)


def batches(n):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    xs = [torch.randn(32, 16, generator=g) for _ in range(n)]
    return [(x, (x @ w).argmax(1)) for x in xs]


def trouble_at(step):
    return step < 60  # steps 0..59 overflow in fp16; after that fp16 trains cleanly


def run(amp, steps=90, switches=None, state_at=None):
    torch.manual_seed(0)
    model = Flaky()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = amp.setup(model, opt)
    precisions, saved = [], None
    for i, (x, y) in enumerate(batches(steps)):
        model.trouble = trouble_at(i)
        with amp.autocast():
            loss = model(x, y)
        amp.backward(loss)
        amp.step(opt)
        if (
            switches and i + 1 in switches
        ):  # where the engine switched: right after optimizer step i + 1
            amp.switch(switches[i + 1])
        precisions.append(amp.precision.name)
        if state_at == i + 1:
            saved = amp.state_dict()
    return model, precisions, saved


def test_retry_after_clean_steps_backs_off_and_equals_hand_switching():
    kw = dict(fallback=True, fallback_patience=2, fallback_check_every=2, device="cpu")
    amp = MixedPrecision("fp16", fallback_recover_after=4, **kw)
    model, precisions, _ = run(amp)
    events = [e for e in amp.events if e.kind in ("fallback", "fallback_retry")]
    kinds = [e.kind for e in events]
    assert kinds[:6] == ["fallback", "fallback_retry"] * 3
    assert all(
        e.data["from"] == "fp16" and e.data["to"] == "bf16" for e in events if e.kind == "fallback"
    )
    assert all(
        e.data["from"] == "bf16" and e.data["to"] == "fp16"
        for e in events
        if e.kind == "fallback_retry"
    )
    retries = [e.data["recover_after"] for e in events if e.kind == "fallback_retry"]
    assert retries[:3] == [4, 8, 16]  # the wait doubles each time trouble returns
    # the time spent in bf16 before each retry grows with the interval
    stays = [
        b.step - a.step
        for a, b in zip(events, events[1:])
        if (a.kind, b.kind) == ("fallback", "fallback_retry")
    ]
    assert stays == sorted(stays) and stays[-1] > stays[0]
    assert (
        precisions[-1] == "fp16" and kinds[-1] == "fallback_retry"
    )  # trouble gone: it stays back in fp16
    assert [e.data["recover_after"] for e in events if e.kind == "fallback"][1:3] == [8, 16]

    # the same switches by hand, at the same steps, with no fallback policy: bitwise the same weights
    switches = {e.step: e.data["to"] for e in events}
    hand, hand_precisions, _ = run(MixedPrecision("fp16", device="cpu"), switches=switches)
    assert hand_precisions == precisions
    for a, b in zip(model.parameters(), hand.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_off_by_default_stays_fallen_back_and_state_carries_the_retry():
    kw = dict(fallback=True, fallback_patience=2, fallback_check_every=2, device="cpu")
    amp = MixedPrecision("fp16", **kw)
    _, precisions, _ = run(amp, steps=70)
    assert precisions[-1] == "bf16" and not [e for e in amp.events if e.kind == "fallback_retry"]

    amp = MixedPrecision("fp16", fallback_recover_after=4, **kw)
    _, precisions, state = run(amp, steps=90, state_at=30)
    assert state["fallback"]["interval"] >= 8  # two retries ended in a fallback by step 30
    fresh = MixedPrecision("fp16", fallback_recover_after=4, **kw)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["fallback"] == state["fallback"]


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4"])
def test_recover_after_rejects_bad_values(bad):
    with pytest.raises(ConfigError, match="fallback_recover_after"):
        MixedPrecisionConfig(fallback_recover_after=bad)
