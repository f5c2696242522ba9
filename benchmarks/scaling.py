"""Data-parallel scaling: samples/s of `ampkit train` on 1 process vs N processes (DDP, FSDP2).

Each configuration is the real command line (`ampkit train --json`, with `--nproc_per_node N`
for N > 1, i.e. torchrun + gloo on CPU / nccl on GPUs); the per-process batch is the same, so
the global batch grows with N. Throughput is the run's median step time over all ranks' samples.

    python benchmarks/scaling.py --model gpt --size small --steps 30 --nprocs 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def run(nproc: int, parallel: str, args: argparse.Namespace, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [
            sys.executable,
            "-m",
            "ampkit",
            "train",
            "--model",
            args.model,
            "--size",
            args.size,
            "--steps",
            str(args.steps),
            "--batch_size",
            str(args.batch_size),
            "--precision",
            args.precision,
            "--device",
            args.device,
            "--json",
            "--no_progress",
            "--log_every",
            "5",
            "--log_dir",
            os.path.join(d, "run"),
        ]
        if nproc > 1:
            cmd += ["--nproc_per_node", str(nproc), "--parallel", parallel]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--nprocs", default="1,2")
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    print(
        f"# torch {torch.__version__} · {args.model}/{args.size} · batch {args.batch_size} per process · "
        f"{args.precision} · {args.device} · {cores} cores"
    )
    print()
    print("| processes | wrapper | threads/process | ms/step | samples/s | vs 1 process |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    base = None
    for n in (int(x) for x in args.nprocs.split(",")):
        for parallel in ["-"] if n == 1 else ["ddp", "fsdp"]:
            threads = max(1, cores // n)
            out = run(n, parallel, args, threads)
            sps = out["samples_per_s"]
            base = base or sps
            print(
                f"| {n} | {parallel} | {threads} | {out['ms_per_step']:.1f} | {sps:,.0f} | {sps / base:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
