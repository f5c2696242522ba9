"""The built-in tiny GPT with one deliberately unstable layer (docs/guides/when-training-goes-wrong.md).

``blocks.0.mlp.0`` has its weights multiplied by 1e6: its outputs (~1e5) exceed fp16's range
(65504) but are fine in bf16 and fp32, where the next LayerNorm brings the scale back. Use it as
``ampkit train --model examples.unstable_gpt:factory`` or ``ampkit audit --model examples.unstable_gpt:factory``.
"""

import torch

from ampkit.loop.data import TextBatches
from ampkit.loop.models import build


def factory(batch_size: int = 8, seed: int = 0, size: str = "tiny", device=None):
    torch.manual_seed(seed)
    model = build("gpt", size)
    with torch.no_grad():
        model.blocks[0].mlp[0].weight.mul_(1e6)
    batches = TextBatches(batch_size=batch_size, block_size=model.config.block_size, seed=seed, device=device)
    return model, batches
