"""Work per optimizer step, independent of machine load: Python calls inside ampkit, torch ops, host syncs.

Wall-clock ratios (``benchmarks/overhead.py``) drown in noise on a shared 2-core machine; these
counts do not. For each precision it trains a small MLP with fused AdamW through ampkit and counts,
over a steady-state step: Python function calls whose code lives in the ``ampkit`` package
(``sys.setprofile``), ATen ops dispatched (``TorchDispatchMode``) and device->host reads
(``aten._local_scalar_dense``). The hand-written torch.amp loop's ATen op count is given beside it.

    python benchmarks/step_work.py [--clip 1.0]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit import MixedPrecision

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import raw_stepper  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PKG = os.path.dirname(ampkit.__file__)


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


class WithLoss(torch.nn.Module):
    """``model(x, y)`` -> the loss, as ``overhead.raw_stepper`` calls it."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def model_and_batch():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    return m, (torch.randn(32, 64), torch.randint(0, 10, (32,)))


def ampkit_step(precision, clip):
    m, (x, y) = model_and_batch()
    amp = MixedPrecision(precision, device="cpu", clip_grad_norm=clip)
    m, opt = amp.setup(m, torch.optim.AdamW(m.parameters(), fused=True))

    def step():
        with amp.autocast():
            loss = torch.nn.functional.cross_entropy(m(x), y)
        amp.backward(loss)
        amp.step(opt)

    return step


def raw_step(precision, clip):
    """The hand-written loop of ``benchmarks/overhead.py`` (one implementation), on the same model."""
    m, batch = model_and_batch()
    step = raw_stepper(
        WithLoss(m),
        torch.optim.AdamW(m.parameters(), fused=True),
        precision,
        torch.device("cpu"),
        clip,
    )
    return lambda: step(batch)


def count(step):
    for _ in range(3):
        step()  # steady state: lazy state built, caches warm
    calls = 0

    def prof(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            calls += 1

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    with Ops() as ops:
        step()
    return calls, ops.ops, ops.syncs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--precisions", default="fp32,bf16,fp16,bf16-pure,fp16-pure")
    args = ap.parse_args()
    print(f"# ampkit at {PKG} · torch {torch.__version__} · clip {args.clip}")
    print(
        "| precision | ampkit Python calls/step | ampkit ATen ops/step | raw loop ATen ops/step | host syncs/step |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for p in args.precisions.split(","):
        calls, ops, syncs = count(ampkit_step(p, args.clip))
        raw = count(raw_step(p, args.clip))[1] if p in DTYPES else None
        print(f"| {p} | {calls} | {ops} | {raw if raw is not None else '-'} | {syncs} |")


if __name__ == "__main__":
    main()
