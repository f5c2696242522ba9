"""A Hugging Face GPT-2 (built from a small GPT2Config, nothing downloaded) trained with ampkit.

Python: `python examples/hf_gpt2.py`. Shell: `ampkit train --model examples.hf_gpt2:factory --size tiny`.
Needs `pip install "ampkit[hf]"`.
"""

import torch

import ampkit
from ampkit.models.data import TextBatches


class CausalLM(torch.nn.Module):
    """Wraps a transformers causal LM so that model(input_ids, labels) returns the loss."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # our batches are already shifted (labels = next byte), so compute the loss on the logits
        logits = self.hf(input_ids=input_ids).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        )


def factory(batch_size: int = 4, seed: int = 0, size: str = "tiny", device=None):
    from transformers import GPT2Config, GPT2LMHeadModel

    dims = {
        "tiny": (64, 2, 2),
        "small": (128, 4, 4),
        "medium": (384, 6, 6),
        "large": (768, 12, 12),
    }[size]
    cfg = GPT2Config(  # the tokens are bytes: 256 of them, no special tokens
        vocab_size=256,
        n_positions=128,
        n_embd=dims[0],
        n_layer=dims[1],
        n_head=dims[2],
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = CausalLM(GPT2LMHeadModel(cfg))
    return model, TextBatches(batch_size=batch_size, block_size=64, seed=seed, device=device)


def main(steps: int = 10) -> list:
    model, batches = factory()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = ampkit.MixedPrecision("bf16", device="cpu", clip_grad_norm=1.0)
    model, optimizer = amp.setup(model, optimizer)
    losses = []
    for i in range(steps):
        with amp.autocast():
            loss = model(*batches(i))
        amp.backward(loss)
        amp.step(optimizer)
        losses.append(loss.item())
    print("losses:", [round(v, 3) for v in losses])
    return losses


if __name__ == "__main__":
    main()
