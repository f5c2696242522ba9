"""An engineered model that cannot train in fp16: one layer's output exceeds fp16's range."""

import torch
import torch.nn.functional as F
from torch import nn

from ampkit import MixedPrecision


class Unstable(nn.Module):
    def __init__(self, gain: float = 1e6):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.big = nn.Linear(32, 32)  # outputs ~1e6: inf in fp16 (max 65504), fine in bf16/fp32
        self.norm = nn.LayerNorm(32)  # brings the scale back, so fp32/bf16 train normally
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight.mul_(gain)

    def forward(self, x, y=None):
        out = self.head(self.norm(self.big(F.gelu(self.inp(x)))))
        return out if y is None else F.cross_entropy(out, y)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(32, 16, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def train_unstable(steps=40, precision="fp16", model=None, amp=None, **kw):
    """Train the unstable model with ampkit (fp16 by default); returns (amp, model, opt, losses)."""
    torch.manual_seed(0)
    model = model or Unstable()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    amp = amp or MixedPrecision(precision, device="cpu", **kw)
    model, opt = amp.setup(model, opt)
    losses = []
    for x, y in data(steps):
        with amp.autocast():
            loss = model(x, y)
        losses.append(loss.detach())
        amp.backward(loss)
        amp.step(opt)
    return amp, model, opt, torch.stack(losses)
