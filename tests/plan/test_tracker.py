"""StepTracker: the live bytes of a fake-tensor step after every operation, checked byte for byte
against PyTorch's own MemTracker running the same step."""

import pytest
import torch

from ampkit.models.builtin import build, builtin
from ampkit.plan.session import Session
from ampkit.plan.tracker import StepTracker


def _memtracker():
    """torch's MemTracker behind StepTracker's interface: its total after each operation (metadata
    queries left out, as StepTracker leaves them out) and its ACT bytes at the peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class Ref(MemTracker):
        def __init__(self, block=None):  # block: another device's allocator (not compared here)
            super().__init__()
            self.timeline = []
            self.grad_timeline = []

        def mark_gradients(self, tensors):  # the gradients' own timeline: not MemTracker's
            pass

        def backward(self):
            pass

        def optimizer(self):
            pass

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if getattr(func, "namespace", "") == "prim":
                return func(*args, **(kwargs or {}))
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.timeline.append(sum(s["Total"] for s in self._curr_mem_snap.values()))
            return out

        @property
        def peak(self):
            return sum(self._peak_mem.values())

        @property
        def peak_forward_bytes(self):
            snap = self.get_tracker_snapshot("peak")
            return sum(v for d in snap.values() for k, v in d.items() if str(k).endswith("ACT"))

    return Ref


def _both(session, batch, monkeypatch):
    """The measure with StepTracker, then the same measure with MemTracker in its place."""
    from ampkit.plan import session as estimate_session

    ours = session.measure(batch)
    with monkeypatch.context() as m:
        m.setattr(estimate_session, "StepTracker", _memtracker())
        ref = session.measure(batch)
    return ours, ref


def _data(name, size, b):
    return builtin(name, size, batch_size=b, seed=0)[1](0)


CASES = [
    ("gpt", "tiny", "fp32", False),
    ("gpt", "tiny", "bf16", True),
    ("gpt", "tiny", "fp16", False),
    ("gpt", "tiny", "bf16-pure", True),
    ("mlp", "small", "fp16-pure", False),
    ("cnn", "tiny", "bf16", False),
]


@pytest.mark.parametrize("name,size,precision,ckpt", CASES)
def test_every_operation_leaves_the_bytes_memtracker_counts(
    name, size, precision, ckpt, monkeypatch
):
    with Session(lambda: build(name, size), "adamw", precision, activation_checkpointing=ckpt) as s:
        ours, ref = _both(s, _data(name, size, 3), monkeypatch)
    assert len(ours.timeline) > 20 and max(ours.timeline) > 50_000
    assert ours.timeline == ref.timeline  # every point, not only the peak
    assert (ours.peak_bytes, ours.parts, ours.phases) == (ref.peak_bytes, ref.parts, ref.phases)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp8", "bf16-pure:split"])
def test_fp8_and_the_ladder_rungs_too(precision, monkeypatch):
    if precision == "fp8":
        pytest.importorskip("torchao")
    with Session(
        lambda: build("gpt", "tiny"), "adamw", precision, activation_checkpointing=True
    ) as s:
        ours, ref = _both(s, _data("gpt", "tiny", 4), monkeypatch)
    assert ours.timeline == ref.timeline and ours.peak_bytes == ref.peak_bytes
    if (
        precision == "fp8"
    ):  # the forward's bytes at the peak: MemTracker's ACT less the backward's 4-byte seed
        act, act_ref = ours.parts["activations"], ref.parts["activations"]
        assert 0 <= act_ref - act <= 8 and act > 100_000
    else:
        assert ours.parts == ref.parts


def test_a_storage_is_counted_once_however_many_views_and_until_it_is_freed():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(1000)
        with StepTracker() as t:
            y = x * 2  # 4000 bytes (x was made before: not counted)
            v = y.view(10, 100)  # a view: nothing new
            z = v.t().contiguous()  # a view, then a copy: 4000 more
            del y, v  # y's storage freed
            w = z + 1
            del z
            w.add_(1)  # in place: nothing new
    assert t.timeline == [4000, 4000, 4000, 8000, 8000, 4000]
    assert t.peak == 8000 and t.total == 4000


def test_external_tensors_and_cuda_rounding():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = torch.nn.Linear(10, 3)  # 120 + 12 bytes
        t, extra = StepTracker(), torch.zeros(5)
        t.track_external(model, extra)
        assert t.total == 120 + 12 + 20
        del extra  # freed: no longer counted
        assert t.total == 120 + 12
        if torch.cuda.is_available():
            c = StepTracker()
            c.track_external(torch.zeros(3, device="cuda"))
            assert c.total == 512
