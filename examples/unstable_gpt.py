"""The built-in tiny GPT with one deliberately unstable layer (docs/guides/when-training-goes-wrong.md).

``blocks.0.mlp.0`` has its weights multiplied by 1e6: its outputs (~1e5) exceed fp16's range
(65504) but are fine in bf16 and fp32, where the next LayerNorm brings the scale back. Use it as
``ampkit train --model examples.unstable_gpt:factory`` or ``ampkit audit --model examples.unstable_gpt:factory``.

Run as a script (``python examples/unstable_gpt.py``), it shows what it is for: the loss of one
batch in each precision, and the layer that overflows in fp16, named.
"""

import torch

import ampkit
from ampkit.models.builtin import build
from ampkit.models.data import TextBatches


def factory(batch_size: int = 8, seed: int = 0, size: str = "tiny", device=None):
    torch.manual_seed(seed)
    model = build("gpt", size)
    with torch.no_grad():
        model.blocks[0].mlp[0].weight.mul_(1e6)
    batches = TextBatches(
        batch_size=batch_size, block_size=model.config.block_size, seed=seed, device=device
    )
    return model, batches


def main() -> dict:
    model, batches = factory(batch_size=2)
    x, y = batches(0)
    losses = {}
    for precision in ("fp32", "bf16", "fp16"):
        amp = ampkit.MixedPrecision(precision, device="cpu")
        with torch.no_grad(), amp.autocast():
            losses[precision] = float(model(x, y))
        print(f"{precision}: loss of one batch {losses[precision]:.4f}")

    amp = ampkit.MixedPrecision("fp16", device="cpu")

    def closure():
        with amp.autocast():
            return model(x, y)

    report = ampkit.localize_nonfinite(model, closure, scale=amp.scaler.get_scale())
    print(f"fp16 overflows in {report.module}: {report.message}")
    print(
        "train it: ampkit train --model examples.unstable_gpt:factory --size tiny --precision fp16 "
        "(the fallback moves to bf16); find it: ampkit audit --model examples.unstable_gpt:factory --size tiny"
    )
    return {"losses": losses, "module": report.module}


if __name__ == "__main__":
    main()
