"""Shared test helpers."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SyncCounter(TorchDispatchMode):
    """Counts device->host reads (``aten._local_scalar_dense``: ``.item()``, ``bool(tensor)``, ...)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


#: what a crash during a multi-process shutdown leaves on stderr (a rare race once did)
CRASH_MARKERS = (
    "terminate called",
    "Aborted",
    "Traceback",
    "SIGABRT",
    "core dumped",
    "destroy_process_group",
)


def assert_exits_cleanly(r, what: str = "") -> None:
    """A finished ``subprocess.run`` of a multi-process job: status 0 and no crash output (a rare
    shutdown race once printed one). Every clean two-process launch in the suite makes this check:
    eight per run (test_launch.py, test_stop.py, test_slurm.py), so the suite no longer launches
    extra jobs only to repeat it (tests/distributed/test_launch_repeat.py, removed 2026-11-26: its
    launches cost ~45 s of the CI's 15 minutes)."""
    assert r.returncode == 0, (what, r.stderr[-3000:])
    for bad in CRASH_MARKERS:
        assert bad not in r.stderr, (what, bad, r.stderr[-3000:])


def train_tiny_gpt(precision, steps=8, **kw):
    """The tiny built-in GPT trained ``steps`` steps in ``precision`` (fp8 emulated on the CPU), seeded:
    ``(model, amp, losses)``. Shared by the fp8 and precision-registry tests."""
    from ampkit import MixedPrecision
    from ampkit.models.builtin import builtin

    torch.manual_seed(0)
    model, batches = builtin("gpt", "tiny", batch_size=4, seed=0)
    amp = MixedPrecision(precision, device="cpu", fp8_emulate=True, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = amp.setup(model, opt)
    losses = []
    for i in range(steps):
        with amp.autocast():
            loss = model(*batches(i))
        amp.backward(loss)
        amp.step(opt)
        losses.append(loss.item())
    return model, amp, losses


def savefig_dies_halfway(monkeypatch) -> None:
    """Make every matplotlib ``savefig`` write a cut file and then be stopped (KeyboardInterrupt):
    what a run stopped while saving an image leaves, for the atomic-write tests."""
    import matplotlib.figure

    real = matplotlib.figure.Figure.savefig

    def dies_halfway(self, fname, *a, **k):
        real(self, fname, *a, **k)
        with open(fname, "r+b") as f:
            f.truncate(100)  # the write cut short ...
        raise KeyboardInterrupt  # ... by a stop

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", dies_halfway)
