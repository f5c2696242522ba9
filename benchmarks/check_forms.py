"""Forms of the CPU finite check (issue 34 §6), each inside the hand-written bf16 loop, paired.

The loop: ``torch.autocast("cpu", bfloat16)`` forward, ``backward``, fused AdamW ``step``,
``zero_grad(set_to_none=True)``; no ampkit engine, so only the check's own cost shows. Forms:

- ``raw``    no check (the hand-written loop)
- ``after``  one native C call over every gradient after backward (what ampkit does today)
- ``hooks``  a post-accumulate-grad hook per parameter checks its gradient while it is still in
             the cache that backward just wrote; the step only confirms each gradient is the one a
             hook read, unchanged (identity and version counter), else reads it
- ``hooks_large`` the same for tensors of >= 16384 elements, the small ones after backward
- ``noop``   a hook per parameter that does nothing (the hooks' own cost)

Blocks of ``--steps`` steps alternate between the forms (order flipped every block); the table shows
median per-step time and the median of the paired per-block ratios to ``raw``. The CPU is named.

    python benchmarks/check_forms.py --threads 1,2 --blocks 80
"""

from __future__ import annotations

import argparse
import array
import copy
import statistics
import time

import torch

from ampkit.models.builtin import MLP, MLPConfig, build
from ampkit.step.hardware import device_info
from ampkit.step.policies import native

FORMS = ["raw", "after", "hooks", "hooks_large", "noop"]


def stepper(base: torch.nn.Module, form: str, lib):
    m = copy.deepcopy(base)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    params = [p for p in m.parameters() if p.requires_grad]
    seen: dict[int, tuple] = {}  # id(param) -> (grad, its version when a hook read it)
    bad = [False]
    call = lib.ampkit_nonfinite

    def check_one(p: torch.Tensor) -> None:
        g = p.grad
        packed = array.array("q", (g.numel(), g.data_ptr(), 0))
        bad[0] |= bool(call(1, packed.buffer_info()[0], 1))
        seen[id(p)] = (g, g._version)

    hooked = []
    if form in ("hooks", "hooks_large"):
        for p in params:
            if form == "hooks" or p.numel() >= 16384:
                p.register_post_accumulate_grad_hook(check_one)
                hooked.append(p)
    elif form == "noop":
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: None)

    def step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, y)
        loss.backward()
        if form == "after":
            assert not native.any_nonfinite([p.grad for p in params], lib)
        elif form in ("hooks", "hooks_large"):
            rest = []
            for p in params:
                r = seen.get(id(p))
                g = p.grad
                if r is None or r[0] is not g or r[1] != g._version:
                    rest.append(g)
            assert not bad[0] and (not rest or not native.any_nonfinite(rest, lib))
            seen.clear()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--blocks", type=int, default=80)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--forms", default=",".join(FORMS))
    args = ap.parse_args()
    lib = native.library()
    if lib is None:
        raise SystemExit("the native kernels are not in use here (no C compiler?)")
    forms = args.forms.split(",")
    print(f"# {device_info('cpu').name} · torch {torch.__version__}", flush=True)
    print("\n| case | threads | form | ms/step | vs raw (median of paired blocks) | p10–p90 |")
    print("| --- | ---: | --- | ---: | ---: | --- |")
    for label, width, batch in [("mlp/w512, batch 64", 512, 64), ("mlp/small, batch 128", 0, 128)]:
        torch.manual_seed(0)
        base = (
            MLP(MLPConfig(in_features=width, hidden=width, n_layer=3))
            if width
            else build("mlp", "small")
        )
        xs = [torch.randn(batch, base.config.in_features) for _ in range(8)]
        ys = [torch.randint(0, base.config.n_classes, (batch,)) for _ in range(8)]
        for nt in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(nt)
            steps = {f: stepper(base, f, lib) for f in forms}
            for f in forms:
                for i in range(args.warmup):
                    steps[f](xs[i % 8], ys[i % 8])
            times = {f: [] for f in forms}
            for b in range(args.blocks):
                for f in forms if b % 2 == 0 else forms[::-1]:
                    t0 = time.perf_counter()
                    for i in range(args.steps):
                        steps[f](xs[(b + i) % 8], ys[(b + i) % 8])
                    times[f].append((time.perf_counter() - t0) / args.steps)
            for f in forms:
                r = sorted(a / b for a, b in zip(times[f], times["raw"]))
                lo, hi = r[int(0.1 * len(r))], r[min(len(r) - 1, int(0.9 * len(r)))]
                print(
                    f"| {label} | {nt} | {f} | {statistics.median(times[f]) * 1e3:.2f} "
                    f"| {statistics.median(r):.3f} | {lo:.3f}–{hi:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
