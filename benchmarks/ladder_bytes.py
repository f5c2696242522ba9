"""Persistent bytes per parameter and whole-step time of each memory-ladder rung on a model whose
largest tensor is a GPT-2-sized embedding (issue 36 item 1).

Bytes: every tensor reachable from the model, the optimizer and the engine after two AdamW steps,
gradients excluded, each storage once; then the gradients a backward leaves for the step
(``breakdown``'s, bf16 on the ladder's stand-ins, and in brackets the fp32 copy kept before:
``grads.HALF_GRADS = False``). Time: the whole training step (forward, backward, step),
rungs interleaved round by round in one process, relative to fp32 masters.

    OMP_NUM_THREADS=1 python benchmarks/ladder_bytes.py [--vocab 50000] [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ampkit
from ampkit.observe.memory import breakdown
from ampkit.step.policies.pure import grads as kept_grads
from ampkit.step.rung import ladder_specs


class EmbeddingHeavy(torch.nn.Module):
    def __init__(self, vocab: int = 50_000, width: int = 768) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(self.emb(x)))).float().pow(2).mean()


def persistent_bytes(*roots: object) -> int:
    """Bytes of every tensor storage reachable from ``roots`` through containers and plain objects'
    attributes, gradients excluded, each storage once."""
    seen, storages, todo = set(), {}, list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
            continue
        if isinstance(obj, dict):
            todo.extend(obj.keys())
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo.extend(obj)
        elif isinstance(obj, torch.Generator):
            continue
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("ampkit", "torch"):
            todo.extend(v for k, v in vars(obj).items() if k != "grad")
    return sum(storages.values())


def run(spec: str, vocab: int, seed: int = 0) -> tuple:
    torch.manual_seed(seed)
    model = EmbeddingHeavy(vocab)
    amp = ampkit.MixedPrecision(spec, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def step(model, opt, amp, x) -> None:
    with amp.autocast():
        loss = model(x)
    amp.backward(loss)
    amp.step(opt)
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    x = torch.randint(0, args.vocab, (8, 128), generator=torch.Generator().manual_seed(1))
    runs = {}
    for spec in ladder_specs():
        model, opt, amp = run(spec, args.vocab)
        for _ in range(2):
            step(model, opt, amp, x)
        n = sum(p.numel() for p in model.parameters())
        kept = persistent_bytes(model, opt, amp) / n
        grads = {}
        for half in (True, False):  # the gradients a backward leaves for the step
            kept_grads.HALF_GRADS = half
            with amp.autocast():
                amp.backward(model(x))
            grads[half] = breakdown(model, opt, amp).by_category.get("gradients", 0) / n
            amp.discard_window()
        kept_grads.HALF_GRADS = True
        print(
            f"{spec:28s} {kept:6.2f} -> {persistent_bytes(model, opt, amp) / n:6.2f} B/param ({n / 1e6:.1f}M "
            f"parameters) + gradients {grads[True]:.2f} (fp32 copy: {grads[False]:.2f})"
        )
        runs[spec] = (model, opt, amp)
    times: dict[str, list[float]] = {s: [] for s in runs}
    for _ in range(args.rounds):
        for spec, (model, opt, amp) in runs.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                step(model, opt, amp, x)
            times[spec].append((time.perf_counter() - t) / args.steps)
    base = statistics.median(times[ladder_specs()[0]])
    for spec, ts in times.items():
        print(
            f"{spec:28s} step {statistics.median(ts) * 1e3:7.1f} ms  {statistics.median(ts) / base:.2f}x "
            f"(min-ratio {min(ts) / min(times[ladder_specs()[0]]):.2f}x)"
        )


if __name__ == "__main__":
    main()
