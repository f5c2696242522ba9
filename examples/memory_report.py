"""Exact memory by category and dtype, and activation memory per precision, for the built-in GPT."""

import torch
from rich.console import Console

from ampkit import MixedPrecision
from ampkit.models.builtin import builtin
from ampkit.observe.memory import activations, breakdown


def main(size: str = "tiny") -> dict:
    torch.manual_seed(0)
    model, batches = builtin("gpt", size, batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters())
    amp = MixedPrecision("bf16", device="cpu")
    model, optimizer = amp.setup(model, optimizer)
    x, y = batches(0)
    with amp.autocast():
        loss = model(x, y)
    amp.backward(loss)
    bd = breakdown(model, optimizer, amp)  # before step(): gradients are still allocated
    amp.step(optimizer)
    console = Console()
    console.print(bd.table())
    acts = {p: activations(model, (x, y), p) for p in ("fp32", "bf16", "fp16")}
    for p, r in acts.items():
        top = sorted(r.by_module.items(), key=lambda kv: -kv[1])[:3]
        console.print(f"activations {p}: {r.total / 2**20:.2f} MiB {r.by_dtype}  largest: {top}")
    return {"breakdown": bd.to_dict(), "activations": {p: r.total for p, r in acts.items()}}


if __name__ == "__main__":
    main()
