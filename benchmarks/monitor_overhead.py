"""Monitor overhead: training with a Monitor at log_every=1/10/100 vs without, alternating in one process.

Each configuration trains its own copy of the model; blocks of steps rotate through the
configurations (the order shifts every round) so drift hits all alike. The JSONL sink is on
(it is what `ampkit train` uses), writing to a temporary directory.

    python benchmarks/monitor_overhead.py
    python benchmarks/monitor_overhead.py --device cuda --size medium
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import tempfile
import time

import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import build
from ampkit.models.data import ClassificationBatches
from ampkit.observe.monitor import JSONLSink, Monitor
from ampkit.step.hardware import device_info


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument(
        "--steps",
        type=int,
        default=100,
        help="steps per block (a multiple of 100 keeps intervals whole)",
    )
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = build("mlp", args.size).to(device)
    data = ClassificationBatches(
        batch_size=args.batch_size, in_features=base.config.in_features, device=device
    )
    batches = [data(i) for i in range(8)]
    tmp = tempfile.mkdtemp()
    # Two identical no-monitor copies: their difference is the noise floor of this comparison.
    configs = {
        "no monitor": None,
        "no monitor (control)": None,
        "log_every=1": 1,
        "log_every=10": 10,
        "log_every=100": 100,
    }
    runners = {}
    in_monitor: dict[str, float] = dict.fromkeys(configs, 0.0)
    for name, every in configs.items():
        m = copy.deepcopy(base)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
        amp = MixedPrecision(args.precision, device=device, clip_grad_norm=1.0)
        m, opt = amp.setup(m, opt)
        if every is not None:
            # Direct accounting: wall time spent inside the monitor's callback (flushes included).
            subscribe = amp.subscribe

            def timed_subscribe(callback, name=name, subscribe=subscribe):
                def timed(event):
                    t = time.perf_counter()
                    callback(event)
                    in_monitor[name] += time.perf_counter() - t

                return subscribe(timed)

            amp.subscribe = timed_subscribe
            Monitor(
                amp,
                [JSONLSink(f"{tmp}/{every}.jsonl")],
                log_every=every,
                samples_per_step=args.batch_size,
            )

        def run(n, m=m, opt=opt, amp=amp):
            for i in range(n):
                x, y = batches[i % len(batches)]
                with amp.autocast():
                    loss = m(x, y)
                amp.backward(loss)
                amp.step(opt)

        runners[name] = run
    for run in runners.values():
        run(20)
    for k in in_monitor:
        in_monitor[k] = 0.0
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            runners[n](args.steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[n].append((time.perf_counter() - t0) / args.steps * 1e3)
    info = device_info(device)
    print(
        f"# {info.name} ({device}) · torch {torch.__version__} · python {platform.python_version()} · "
        f"mlp/{args.size} batch {args.batch_size} · {args.precision} · threads {torch.get_num_threads()}"
    )
    print()
    print(
        "| configuration | ms/step (median) | end-to-end vs no monitor (median of per-round ratios) "
        "| time inside the monitor per step | share of step time |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    base_t = times["no monitor"]
    total_steps = args.rounds * args.steps
    for n in names:
        ratio = statistics.median(a / b for a, b in zip(times[n], base_t))
        per_step_us = in_monitor[n] / total_steps * 1e6
        share = per_step_us / 1e3 / statistics.median(times[n])
        print(
            f"| {n} | {statistics.median(times[n]):.3f} | {100 * (ratio - 1):+.2f}% | {per_step_us:.1f} µs | "
            f"{100 * share:.2f}% |"
        )


if __name__ == "__main__":
    main()
