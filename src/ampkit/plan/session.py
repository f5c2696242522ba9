"""One model, set up once on fake tensors, measured at several batch sizes; and the affine memory
model that makes ``largest_batch`` cost a few measured steps instead of a bisection of estimates.

A :class:`Session` builds the model under ``FakeTensorMode``, sets up the engine, runs one warm-up
step (the optimizer state and masters' gradients), then measures a training step per
:meth:`Session.measure` call. Every measured step starts from the same state (the step before it
left the optimizer state and gradients as the warm-up did), so a measure is what a fresh
:func:`ampkit.plan.estimate.estimate` reports for that batch -- without building and warming the
model again.

A measure also records the tracker's memory total after every operation (the *timeline*). Two
measures whose timelines have the same length ran the same operations, and a step's tensors are
affine in the batch, so each point of the timeline is ``a_t + b_t * batch``: the peak at any batch
is ``max_t(a_t + b_t * batch)`` (:class:`Curve`), checked against a third measure at the answer.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from ..loop.steps import Steps, batch_loss
from ..observe.memory import activations, breakdown, saved_activations
from ..step.engine import MixedPrecision
from ..step.rung import join_spec, split_spec
from . import devices as plan_devices
from .tracker import StepTracker

__all__ = ["LOCK", "PARTS", "Curve", "Measure", "Session", "cuda_workspace_bytes", "to_device"]

PARTS = (
    "parameters",
    "gradients",
    "master_weights",
    "optimizer_state",
    "activations",
    "temporaries",
)

# the tracker installs global module hooks: estimates run one at a time per process.
LOCK = threading.RLock()
WARM_UP = "cheap"  # or "step": the warm-up runs the model's own training step


def _optimizer(
    spec: Union[str, Callable[..., torch.optim.Optimizer]], params: Any, fused: bool
) -> torch.optim.Optimizer:
    if callable(spec):
        return spec(params)
    name = str(spec).lower()
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=fused)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, fused=fused)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=fused)
    raise ValueError(
        f"optimizer={spec!r}; choose 'adamw', 'adam', 'sgd' or pass a callable params -> optimizer"
    )


def _fake(obj: Any, mode: Any, dev: torch.device) -> Any:
    """Fake copies of a batch's tensors, on the device the step is estimated for."""
    if isinstance(obj, torch.Tensor):
        t = mode.from_tensor(obj)
        return t if t.device == dev else t.to(dev)  # under the mode: a fake tensor on `dev`
    if isinstance(obj, (tuple, list)):
        return type(obj)(_fake(o, mode, dev) for o in obj)
    if isinstance(obj, dict):
        return {k: _fake(v, mode, dev) for k, v in obj.items()}
    return obj


def cuda_workspace_bytes(dev: torch.device) -> int:
    """What cuBLAS's workspaces hold on a CUDA device during a training step, counted by
    ``torch.cuda.max_memory_allocated`` (torch takes them from its caching allocator), 0 elsewhere:
    one workspace per cuBLAS handle, and a step uses two -- the forward's thread and autograd's
    device thread. The size is ``CUBLAS_WORKSPACE_CONFIG`` (``:KiB:count`` pairs) when set, else
    torch's default: ``:4096:8`` (32 MiB) on Hopper and later, ``:4096:2:16:8`` before. Measured
    on an H200 (GPT small, batch 8): the estimate without it was 63 MiB under the allocator's peak."""
    if dev.type != "cuda":
        return 0
    import os

    cfg = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    if not cfg:
        major = torch.cuda.get_device_capability(dev)[0] if torch.cuda.is_available() else 9
        cfg = ":4096:8" if major >= 9 else ":4096:2:16:8"
    try:
        nums = [int(x) for x in cfg.strip(":").split(":")]
        per_handle = sum(size * count for size, count in zip(nums[::2], nums[1::2])) * 1024
    except ValueError:
        per_handle = 32 << 20
    return 2 * per_handle


def to_device(model: torch.nn.Module, dev: torch.device) -> None:
    """Move a fake-tensor model's parameters and buffers to ``dev`` (before an optimizer holds them).

    ``Module.to`` cannot: it swaps each fake parameter in place (``torch.utils.swap_tensors``), which
    fake tensors refuse ("_apply(): Couldn't swap Linear.weight", seen estimating for CUDA). Here
    every tensor not on ``dev`` is replaced by a new parameter (or buffer) there; a parameter shared
    by several modules (tied weights) stays shared."""
    new: dict[int, Any] = {}
    for mod in model.modules():
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in table.items():
                if t is None or t.device == dev:
                    continue
                if id(t) not in new:
                    with torch.no_grad():
                        moved = t.detach().to(dev)
                    new[id(t)] = (
                        torch.nn.Parameter(moved, requires_grad=t.requires_grad)
                        if is_param
                        else moved
                    )
                table[name] = new[id(t)]


def _checkpoint(model: torch.nn.Module, ckpt: Union[bool, Sequence[str]]) -> None:
    from ..step.activation_checkpointing import apply_activation_checkpointing

    targets = (
        list(ckpt)
        if not isinstance(ckpt, bool)
        else [f"{n}.*" for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    )
    apply_activation_checkpointing(model, targets)


@dataclass(frozen=True)
class Measure:
    """One measured step: its peak, parts (bytes), bytes by dtype, the total after each operation,
    and where in the timeline the forward (the loss) and the backward ended (``phases``);
    ``grads``: the gradients' bytes within each total, ``largest_grad``: the largest parameter's
    share of them, at least its fp32 upcast with masters (what :func:`ampkit.plan.levers.in_backward`
    plans the optimizer in backward from: it steps a master's fp32 gradient, even where the ladder
    keeps bf16 ones for the ordinary step)."""

    precision: str
    peak_bytes: int
    parts: dict[str, int]
    by_dtype: dict[str, int]
    timeline: tuple[int, ...]
    phases: tuple[int, ...] = ()
    grads: tuple[int, ...] = ()
    largest_grad: int = 0


class Session:
    """``with Session(factory, ...) as s: s.measure(batch)``: see the module's docstring."""

    def __init__(
        self,
        model_or_factory: Any,
        optimizer: Any = "adamw",
        precision: str = "fp32",
        device: Union[str, torch.device, None] = "cpu",
        activation_checkpointing: Union[bool, Sequence[str]] = False,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = batch_loss,
    ) -> None:
        self.dev = torch.device(device) if device is not None else torch.device("cpu")
        self._loss_fn = loss_fn  # the Trainer's: loss_fn(model, batch) -> scalar loss
        if self.dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                "estimating for a CUDA device needs a CUDA build of torch with a GPU; use device='cpu' "
                "here (parameter, gradient, master and optimizer bytes are the same; activations too)"
            )
        self._args = (model_or_factory, optimizer, precision, activation_checkpointing)
        self._warm = False
        self.target = (
            plan_devices.current()
        )  # a GPU planned from here: its allocator, workspaces, kernels

    def __enter__(self) -> Session:
        from torch._subclasses.fake_tensor import FakeTensorMode

        LOCK.acquire()
        try:
            self.mode = FakeTensorMode(allow_non_fake_inputs=True)
            self.mode.__enter__()
            self._setup(*self._args)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if getattr(self, "mode", None) is not None:
                self.mode.__exit__(*(exc if exc and exc[0] is not None else (None, None, None)))
                self.mode = None
        finally:
            LOCK.release()

    def _setup(self, model_or_factory: Any, optimizer: Any, precision: str, ckpt: Any) -> None:
        if isinstance(model_or_factory, torch.nn.Module):
            model = copy.deepcopy(model_or_factory)  # under the mode: fake copies of the parameters
        else:
            with torch.device(self.dev):  # built where it will run: a fake model cannot be moved
                model = model_or_factory()
        to_device(model, self.dev)
        if ckpt:
            _checkpoint(model, ckpt)
        opt = _optimizer(optimizer, model.parameters(), self.dev.type in ("cpu", "cuda"))
        self.amp = MixedPrecision(
            precision, device=self.dev, fp8_emulate=True
        )  # "bf16-pure:split": a rung
        self.label = join_spec(self.amp.precision.name, split_spec(precision)[1])
        self.model, self.opt = self.amp.setup(model, opt)
        self._tracker: Any = None
        self.run = Steps(self.model, self.opt, self.amp, loss_fn=self._marked_loss)

    def _marked_loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        if self._tracker is None:
            return self._loss_fn(model, batch)
        # saved_activations does not follow torchao's fp8 casts yet
        if not self.amp.precision.row.measures_activations:
            loss = self._loss_fn(model, batch)
        else:  # the activations: what this forward saves for backward (no second forward)
            with saved_activations(model) as self._saved:
                loss = self._loss_fn(model, batch)
        self._marks.append(len(self._tracker.timeline))  # the forward ends here: a phase boundary
        self._tracker.backward()
        return loss

    def _warm_up(self, fake_batch: Any) -> None:
        """One step that creates the optimizer state (and the masters' gradients). ``WARM_UP ==
        "cheap"``: a loss that touches every parameter once (a sum), not the model's forward --
        the same gradients, state and engine counters at a fraction of the operations (tested:
        the measures that follow are the same, timelines included)."""
        if WARM_UP == "step":
            self.run.micro_step(fake_batch)
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        with self.amp.autocast():
            loss = sum((p.sum() * 0 for p in params), torch.zeros((), device=self.dev))
        self.amp.backward(loss)
        self.amp.step(self.opt)

    def checkpointing(self, on: Union[bool, Sequence[str]]) -> None:
        """Turn activation checkpointing on (True: every element of a ``ModuleList``; or module
        name globs / types) or off for the measures that follow, keeping the warmed-up state: a
        measure then is what a fresh session with ``activation_checkpointing=on`` reports."""
        from ..step.activation_checkpointing import remove_activation_checkpointing

        remove_activation_checkpointing(self.model)
        if on:
            _checkpoint(self.model, on)

    def measure(self, batch: Any) -> Measure:
        """The step's memory on ``batch`` (real or fake tensors; read only for their shapes)."""
        fake_batch = _fake(batch, self.mode, self.dev)
        model, opt, amp = self.model, self.opt, self.amp
        if not self._warm:
            self._warm_up(fake_batch)
            self._warm = True
        tracker = StepTracker(self.target.block_bytes if self.target is not None else None)
        # the ladder's remainders / compensations too (breakdown's master_weights): held all step long
        kept = getattr(getattr(amp, "policy", None), "master_storage", list)()
        tracker.track_external(model, opt, *amp.master_params(), *kept)
        self._tracker, self._marks, self._saved = tracker, [], None
        kernels = (
            plan_devices.gpu_attention() if self.target is not None else contextlib.nullcontext()
        )
        try:
            with tracker, kernels:
                self.run.forward_backward(fake_batch)
                self._marks.append(len(tracker.timeline))
                params = [*model.parameters(), *amp.master_params()]
                tracker.mark_gradients([p.grad for p in params if p.grad is not None])
                static = breakdown(model, opt, amp)  # gradients held, as at the step's peak
                tracker.optimizer()
                amp.step(opt)
        finally:
            self._tracker = None
        # activations() does not follow torchao's fp8 casts yet
        if not amp.precision.row.measures_activations:
            act_bytes = tracker.peak_forward_bytes
        else:
            saved = self._saved  # None only if the step never computed its loss here: count apart
            act_bytes = (
                saved.total
                if saved is not None
                else int(activations(model, fake_batch, amp.precision).total)
            )
        # held by the CUDA libraries, not by any tensor
        ws = (
            self.target.workspace_bytes()
            if self.target is not None
            else cuda_workspace_bytes(self.dev)
        )
        peak = tracker.peak + ws
        cats = static.by_category
        parts = {k: int(cats.get(k, 0)) for k in PARTS[:4]}
        parts["activations"] = act_bytes
        peak = max(peak, sum(parts.values()))
        parts["temporaries"] = peak - sum(parts.values())
        numels = [p.numel() for p in model.parameters()]
        largest = parts["gradients"] * max(numels, default=0) // max(1, sum(numels))
        if getattr(amp.policy, "keeps_masters", False):  # stepped in backward: its fp32 upcast
            largest = max(largest, 4 * max(numels, default=0))
        return Measure(
            self.label,
            peak,
            parts,
            dict(static.by_dtype),
            tuple(t + ws for t in tracker.timeline),
            tuple(self._marks),
            tuple(tracker.grad_timeline),
            largest,
        )


class Curve:
    """The peak as a function of the batch, from two measures at batches ``b1 < b2`` that ran the
    same operations: every timeline point and the parts are ``a + b * batch``. :meth:`peak`
    predicts the estimate's peak at any batch (exactly, where the step's tensors are affine in the
    batch: batch 1 is not always on the line, a size-1 dimension can take another path, so ``fit``
    draws its curves through batches >= 2); :meth:`agrees` checks a third measure."""

    def __init__(self, b1: int, m1: Measure, b2: int, m2: Measure) -> None:
        if not b1 < b2:
            raise ValueError(f"a curve needs two batch sizes b1 < b2, got {b1}, {b2}")
        self.ok = len(m1.timeline) == len(m2.timeline)
        self.b1, span = b1, b2 - b1
        pairs = list(zip(m1.timeline, m2.timeline)) if self.ok else []
        pairs.append(
            (m1.peak_bytes, m2.peak_bytes)
        )  # the peak itself (parts included), as a last point
        self.points = [(x, (y - x) / span) for x, y in pairs]

    def peak(self, batch: int) -> int:
        k = batch - self.b1
        return int(round(max(x + d * k for x, d in self.points)))

    def agrees(self, batch: int, m: Measure) -> bool:
        """Whether the measure at ``batch`` is the curve's prediction at every timeline point."""
        if not self.ok or len(m.timeline) + 1 != len(self.points):
            return False
        k = batch - self.b1
        return (
            all(round(x + d * k) == y for (x, d), y in zip(self.points, m.timeline))
            and self.peak(batch) == m.peak_bytes
        )

    def largest(self, budget: int, lo: int, hi: int) -> int:
        """The largest batch in ``[lo, hi]`` whose predicted peak fits ``budget`` (``lo - 1``: none).
        The peak is a maximum of affine functions (convex), so the batches that fit are an interval."""
        if self.peak(lo) > budget:
            return lo - 1
        if self.peak(hi) <= budget:
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak(mid) <= budget else (lo, mid)
        return lo


def fit(
    session: Session,
    batch_of: Callable[[int], Any],
    budget: int,
    limit: int,
    first: Optional[tuple[int, Measure]] = None,
) -> tuple[int, Measure, dict[int, Measure]]:
    """The largest batch ``B <= limit`` whose measured peak fits ``budget`` while ``B + 1``'s does
    not (B = ``limit`` when it fits): a :class:`Curve` through two measures predicts ``B``, which is
    measured with ``B + 1``; a miss draws the next curve through the measures nearest the answer,
    and after a few misses a bisection over measures finishes. Returns ``(B, measure at B, every
    measure taken)``; ``(0, measure at 1, ...)`` when not even one sample fits."""
    seen: dict[int, Measure] = dict([first]) if first else {}

    def at(b: int) -> Measure:
        if b not in seen:
            seen[b] = session.measure(batch_of(b))
        return seen[b]

    above = sorted(b for b in seen if b >= 2)
    if (
        limit >= 3 and len(above) < 2
    ):  # the first curve's two points (batch 1 is measured only if needed)
        base = above[0] if above else 2
        at(base), at(base + 1 if base < limit else base - 1)
    for _ in range(4):
        fits = [b for b in seen if seen[b].peak_bytes <= budget]
        if not fits:
            if at(1).peak_bytes > budget:
                return 0, seen[1], seen
            continue
        lo = max(fits)
        hi = min([b for b in seen if b > lo], default=limit + 1)
        if hi == lo + 1 or lo >= limit:
            return lo, seen[lo], seen
        near = sorted(sorted((b for b in seen if b >= 2), key=lambda b: abs(b - lo))[:2])
        if len(near) < 2:
            at(max(2, lo)), at(max(2, lo) + 1)
            continue
        guess = Curve(near[0], seen[near[0]], near[1], seen[near[1]]).largest(budget, lo, hi - 1)
        guess = min(max(guess, lo), hi - 1)
        at(guess)
        if guess < limit:
            at(guess + 1)
    while True:  # the curve missed a few times: bisection over measures
        if at(1).peak_bytes > budget:
            return 0, seen[1], seen
        lo = max(b for b in seen if seen[b].peak_bytes <= budget)
        hi = min([b for b in seen if b > lo], default=limit + 1)
        if hi == lo + 1 or lo >= limit:
            return lo, seen[lo], seen
        if hi > limit:  # nothing measured above lo fails yet: grow
            at(min(limit, 2 * lo))
        else:
            at((lo + hi) // 2)
