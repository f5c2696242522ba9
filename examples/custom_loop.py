"""A custom loop with gradient accumulation, clipping, a learning-rate schedule and fp16 loss scaling."""

import torch
import torch.nn.functional as F

import ampkit


def main(steps: int = 15, accumulation: int = 4) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0, end_factor=0.1, total_iters=steps
    )
    amp = ampkit.MixedPrecision(
        "fp16",
        device="cpu",
        accumulation_steps=accumulation,
        clip_grad_norm=1.0,
        init_scale=2.0**12,
        growth_interval=5,
    )
    model, optimizer = amp.setup(model, optimizer)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 4, generator=g)
    for _ in range(steps * accumulation):
        x = torch.randn(16, 32, generator=g)
        with amp.autocast():
            loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
        amp.backward(loss)  # loss / 4, times the loss scale
        result = amp.step(optimizer)  # a no-op on 3 of every 4 micro-steps
        if result.boundary:
            if not result.skipped:  # .skipped reads the device (a sync); the tensors do not
                scheduler.step()
            print(
                f"step {amp.optimizer_steps:3d}  loss {loss.item():.4f}  grad norm {result.grad_norm.item():.3f}  "
                f"scale {result.scale.item():g}  lr {scheduler.get_last_lr()[0]:.5f}"
            )
    return amp.stats()


if __name__ == "__main__":
    main()
