"""What the checkpoint digest costs: ``save_checkpoint`` / ``load_checkpoint`` of a state of
``--mb`` MiB of fp32 tensors, against the same atomic save without the digest (temp file, fsync,
rename, fsync of the directory: the code before the digest) and a bare ``torch.load``.

The save hashes the bytes as torch writes them (no second read) and adds the sidecar (a small
file: write, fsync, rename); the load hashes the file once before ``torch.load`` reads it (both
from the page cache here: the file was just written). Rounds interleave the two forms.

    python benchmarks/checkpoint_digest.py [--mb 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from ampkit.loop.checkpoint import load_checkpoint, save_checkpoint
from ampkit.loop.digest import file_sha256


def save_plain(state: dict, path: str) -> None:
    """The atomic save without a digest (what save_checkpoint did before)."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    with os.fdopen(fd, "wb") as f:
        torch.save({"ampkit_checkpoint": 1, **state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)


def load_plain(path: str) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--mb", type=int, default=100, help="state size in MiB (fp32 tensors of 1 MiB each)"
    )
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(256, 1024) for i in range(args.mb)}}
    out: dict[str, list[float]] = {
        k: []
        for k in (
            "save plain",
            "save + digest",
            "load plain",
            "load + verify",
            "sha256 of the file",
        )
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        for i in range(args.rounds):
            # a new name each round, as a run's checkpoints have (no stale digest to remove first)
            a, b = os.path.join(d, f"a{i}.pt"), os.path.join(d, f"b{i}.pt")
            out["save plain"].append(timed(save_plain, state, a))
            out["save + digest"].append(timed(save_checkpoint, state, b))
            out["load plain"].append(timed(load_plain, a))
            out["load + verify"].append(timed(load_checkpoint, b))
            out["sha256 of the file"].append(timed(file_sha256, b))
            size = os.path.getsize(b) / 2**20
            for f in (a, b, b + ".sha256"):
                os.unlink(f)
    print(
        f"checkpoint of {size:.1f} MiB, median of {args.rounds} interleaved rounds "
        f"(torch {torch.__version__}, {os.cpu_count()} CPUs)"
    )
    med = {k: statistics.median(v) * 1e3 for k, v in out.items()}
    for k, v in med.items():
        print(f"  {k:20s} {v:8.1f} ms   (min {min(out[k]) * 1e3:.1f})")
    print(
        f"  added on save: {med['save + digest'] - med['save plain']:+.1f} ms; "
        f"added on load: {med['load + verify'] - med['load plain']:+.1f} ms"
    )


if __name__ == "__main__":
    main()
