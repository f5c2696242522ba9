"""The four-line happy path on the built-in tiny GPT: MixedPrecision("auto"), autocast, backward, step."""

import torch

import ampkit
from ampkit.models.builtin import builtin


def main(steps: int = 20) -> float:
    torch.manual_seed(0)
    amp = ampkit.MixedPrecision("auto")  # picks the device too: CUDA if present, else CPU
    model, batches = builtin("gpt", "tiny", batch_size=4, device=amp.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, optimizer = amp.setup(model, optimizer)
    for i in range(steps):
        x, y = batches(i)
        with amp.autocast():
            loss = model(x, y)
        amp.backward(loss)
        amp.step(optimizer, clip_grad_norm=1.0)

    print(amp.precision.name, "-", amp.precision.reason)
    print(amp.stats())
    return loss.item()


if __name__ == "__main__":
    main()
