"""What "nothing is lost" costs per optimizer step: the ranks' stop agreement and the numerics guard.

* ``GracefulStop.poll``: one process reads a flag (no collective); several processes all-reduce
  4 bytes per step so all stop after the same step (gloo on CPU here; on CUDA the result is read
  a step late, without a host sync).
* The fallback/exhausted guard: three in-place device ops per step on 0-d counters, plus a
  non-blocking copy every ``fallback_check_every`` steps (now on for every precision, also with
  the fallback off).

Both are shown next to a real DDP step of the built-in mlp/small (2 gloo processes) and a real
one-process step, so the figure that matters -- the share of a step -- is in the table.

    python benchmarks/stop_overhead.py [--calls 2000] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, n: int) -> float:
    """Median seconds per call over 5 rounds of ``n`` calls."""
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n)
    return statistics.median(rounds)


def _train_step_s(steps: int) -> tuple[float, float]:
    """Median seconds per optimizer step of ampkit on mlp/small (DDP when a group exists), without
    and with a ``GracefulStop.poll`` after every step, in alternating blocks."""
    from ampkit import MixedPrecision
    from ampkit.distributed import wrap_ddp
    from ampkit.models.builtin import builtin
    from ampkit.train.stop import GracefulStop

    model, batches = builtin("mlp", "small", batch_size=64, seed=0)
    if dist.is_initialized():
        model = wrap_ddp(model, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    stop = GracefulStop(announce=False)
    cpu = torch.device("cpu")

    def step(i=[0]):  # noqa: B006 - a counter
        with amp.autocast():
            loss = model(*batches(i[0]))
        amp.backward(loss)
        amp.step(opt)
        i[0] += 1

    def step_polled():
        step()
        stop.poll(cpu)

    for _ in range(10):
        step_polled()
    plain, polled = [], []
    for block in range(10):
        for fn, out in ((step, plain), (step_polled, polled))[:: 1 if block % 2 else -1]:
            out.append(_time(fn, max(1, steps // 50)))
    stop.drain()
    return statistics.median(plain), statistics.median(polled)


def _worker(rank: int, world: int, port: int, calls: int, steps: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ampkit.train.stop import GracefulStop

    stop = GracefulStop(announce=False)
    dev = torch.device("cpu")
    for _ in range(50):
        stop.poll(dev)
    poll = _time(lambda: stop.poll(dev), max(1, calls // 5))
    stop.drain()
    dist.barrier()
    plain, polled = _train_step_s(steps)
    if rank == 0:
        out["poll_2"] = poll
        out["step_2"], out["step_2_polled"] = plain, polled
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from ampkit.step.fallback import FallbackPolicy
    from ampkit.train.stop import GracefulStop

    stop = GracefulStop(announce=False)
    poll_1 = _time(lambda: stop.poll(torch.device("cpu")), args.calls)
    policy = FallbackPolicy((), patience=8, check_every=10, min_scale=None)
    found = torch.zeros(())
    scale = torch.full((), 2.0**16)
    n = [0]

    def guard() -> None:
        policy.observe(found)
        n[0] += 1
        if n[0] % 10 == 0:
            policy.check(scale, True)

    guard_1 = _time(guard, args.calls)
    step_1 = _train_step_s(args.steps)[0]

    import socket

    with socket.socket() as sock:  # a free local port for the process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(_worker, args=(2, port, args.calls, args.steps, out), nprocs=2, join=True)

    rows = [
        ("stop poll, 1 process", poll_1, step_1),
        ("stop poll, 2 processes, back to back (round trip)", out["poll_2"], out["step_2"]),
        (
            "stop poll, 2 processes, inside DDP steps",
            out["step_2_polled"] - out["step_2"],
            out["step_2"],
        ),
        ("numerics guard (observe + check/10)", guard_1, step_1),
    ]
    print(
        f"torch {torch.__version__}, 1 thread per process; step = ampkit fp32 step of mlp/small, batch 64"
    )
    print(f"{'per optimizer step':<48} {'cost (us)':>10} {'step (ms)':>10} {'share':>8}")
    for name, cost, step in rows:
        print(f"{name:<48} {cost * 1e6:>10.1f} {step * 1e3:>10.2f} {cost / step:>8.2%}")


if __name__ == "__main__":
    main()
