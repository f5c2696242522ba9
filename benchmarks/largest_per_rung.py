"""The deepest GPT-2-shaped model that trains in a fixed memory budget, per precision and ladder rung.

GPT-2's block (n_embd 768, 12 heads; 128 tokens, batch 1, fused AdamW) stacked ``L`` deep: for
each precision or ``bf16-pure`` rung, the largest ``L`` whose training step fits ``--memory``,
and ``ampkit plan``'s own verdict at ``L`` and ``L + 1`` (the CLI, in this process: "fits" at
``L``, not at ``L + 1``). The depth comes from the same machinery as ``ampkit plan``
(:func:`ampkit.plan.depth.measure_depths`: 1- and 2-block copies on fake tensors, each phase's
peak affine in the depth), so nothing of the model's size is allocated.

    OMP_NUM_THREADS=1 python benchmarks/largest_per_rung.py                 # 16 GiB, every rung
    python benchmarks/largest_per_rung.py --memory 8GiB --rungs fp32,bf16-pure:split
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import time

import torch

from ampkit.cli import main as ampkit_main
from ampkit.plan.depth import measure_depths
from ampkit.plan.estimate import parse_bytes
from ampkit.step.hardware import device_info

RUNGS = [
    "fp32",
    "bf16",
    "bf16-pure",
    "bf16-pure:split",
    "bf16-pure:kahan",
    "bf16-pure:stochastic",
    "bf16-pure:stochastic+bf16",
    "bf16-pure:none",
]
BLOCK = (
    128  # tokens per sample: short, so the weights and optimizer state decide (as in fine-tuning)
)


def plan_says_fits(rung: str, depth: int, memory: str) -> bool:
    """``ampkit plan --json`` at ``depth`` layers, batch 1: whether it says the step fits (a plan
    whose fixed state alone exceeds the budget exits 2 with that message: it does not fit)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ampkit_main(
            [
                "plan",
                "--model",
                "gpt2",
                "--model_config",
                f"n_layer={depth}",
                "--block_size",
                str(BLOCK),
                "--batch_size",
                "1",
                "--memory",
                memory,
                "--precisions",
                rung,
                "--json",
            ]
        )
    if rc != 0:
        if "no batch size fits" in err.getvalue():
            return False
        raise RuntimeError(f"ampkit plan failed ({rc}): {err.getvalue()[-500:]}")
    return bool(json.loads(out.getvalue())["rows"][0]["fits"])


def plan_inputs(memory: str) -> tuple:
    """The model stack and ``batch_of`` exactly as ``ampkit plan`` builds them for GPT-2 at BLOCK tokens."""
    from ampkit.cli import build_parser
    from ampkit.cli.common import estimate_inputs
    from ampkit.cli.plan import _stack

    args = build_parser().parse_args(
        [
            "plan",
            "--model",
            "gpt2",
            "--block_size",
            str(BLOCK),
            "--batch_size",
            "1",
            "--memory",
            memory,
        ]
    )
    _, batch_of = estimate_inputs(argparse.Namespace(**{**vars(args), "seed": 0}))
    return _stack(args), batch_of


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", default="16GiB")
    ap.add_argument("--rungs", default=",".join(RUNGS))
    ap.add_argument(
        "--no-confirm", action="store_true", help="skip ampkit plan's verdict at L and L + 1"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    budget = parse_bytes(args.memory)
    print(
        f"# {device_info('cpu').name} · torch {torch.__version__} · python {platform.python_version()}"
        f" · GPT-2 blocks (768 wide, 12 heads), {BLOCK} tokens, batch 1, fused AdamW · budget {args.memory}\n"
    )
    stack, batch_of = plan_inputs(args.memory)
    print(
        "| precision / rung | largest depth L | parameters at L | peak at L | its largest part | "
        "`ampkit plan`: fits at L / at L + 1 | seconds |"
    )
    print("| --- | ---: | ---: | ---: | --- | --- | ---: |")
    for rung in [r.strip() for r in args.rungs.split(",") if r.strip()]:
        t0 = time.perf_counter()
        fit = measure_depths(stack, rung, batch_of, batches=(1, 4, 5))
        lo, hi = 0, 1
        while fit.peak(hi, 1) <= budget:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fit.peak(mid, 1) <= budget else (lo, mid)
        params = (
            124_439_808 + (lo - 12) * 7_087_872
        )  # GPT-2 124M: embeddings + 12 blocks of 7.09M (tied head)
        verdict = (
            "—"
            if args.no_confirm
            else f"{'yes' if plan_says_fits(rung, lo, args.memory) else 'NO'} / "
            f"{'yes' if plan_says_fits(rung, lo + 1, args.memory) else 'no'}"
        )
        parts = fit.parts(lo, 1)
        big = max(parts, key=lambda k: parts[k])
        print(
            f"| {rung} | {lo} | {params / 1e9:.2f} B | {fit.peak(lo, 1) / 2**30:.2f} GiB | {big} "
            f"{parts[big] / 2**30:.2f} GiB | {verdict} | {time.perf_counter() - t0:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
