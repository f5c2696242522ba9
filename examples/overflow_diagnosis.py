"""Find the layer that overflows in fp16, then fix it: keep it in fp32, or let ampkit fall back."""

import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit import audit, localize_nonfinite


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.big = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight.mul_(1e6)  # outputs ~1e6: inf in fp16, fine in bf16/fp32

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.norm(self.big(F.gelu(self.inp(x))))), y)


def batch(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4]).argmax(1)


def train(amp, steps=30):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = amp.setup(model, opt)
    for i in range(steps):
        x, y = batch(i)
        with amp.autocast():
            loss = model(x, y)
        amp.backward(loss)
        amp.step(opt)
    return model, amp


def main() -> dict:
    model, amp = train(ampkit.MixedPrecision("fp16", device="cpu"))
    print("plain fp16:", amp.stats()["skipped_steps"], "of 30 steps skipped")
    x, y = batch(0)

    def closure():
        with amp.autocast():
            return model(x, y)

    report = localize_nonfinite(model, closure, scale=amp.scaler.get_scale())
    print("localized:", report.message)
    rec = audit(Net(), (x, y), "fp16")
    print("audit recommends keep_fp32 =", rec.recommended_keep_fp32)
    _, fixed = train(
        ampkit.MixedPrecision(
            "fp16", device="cpu", keep_fp32=rec.recommended_keep_fp32, init_scale=1024.0
        )
    )
    print("with keep_fp32:", fixed.stats()["skipped_steps"], "skipped")
    _, fell = train(
        ampkit.MixedPrecision(
            "fp16", device="cpu", fallback=True, fallback_patience=4, fallback_check_every=2
        )
    )
    print("with fallback: now", fell.precision.name, [e["reason"] for e in fell.stats()["events"]])
    return {
        "module": report.module,
        "keep": rec.recommended_keep_fp32,
        "fixed_skips": fixed.stats()["skipped_steps"],
        "fallback_precision": fell.precision.name,
    }


if __name__ == "__main__":
    main()
