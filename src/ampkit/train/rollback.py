"""Spike rollback in memory: detect a bad step on the device, roll back, skip the batch, go on.

Peers stop on a loss spike (Lightning ``SpikeDetection``, llm-foundry ``KillLossSpike``) or skip it;
users hand-roll "reload the last checkpoint and skip the batch". :class:`SpikeGuard` does it in
process, from host memory, for the :class:`~ampkit.train.trainer.Trainer` (``spike_rollback=True``)
and for hand-written loops::

    guard = ampkit.SpikeGuard(model, optimizer, amp, keep=2, every=20)
    data = guard.wrap(batches)        # data(i): the i-th batch not dropped by a rollback (a
                                      # function of the index, or a DataLoader/list/generator)
    pos = guard.position              # where the guard's first snapshot is (0)
    while amp.optimizer_steps < 1000:
        with amp.autocast():
            loss = loss_fn(model, data(pos))
        amp.backward(loss)
        amp.step(optimizer)
        pos = guard.check(pos + 1)    # the next position: pos + 1, or after a rollback the snapshot's

**Detection, on the device.** The guard subscribes to the engine's ``step`` events (the window's
mean loss and the :class:`~ampkit.step.events.StepResult`) and flags a step, with no host sync, when

* the loss is non-finite (``nonfinite_loss``), or the gradients are (``nonfinite_grads``: the
  engine's own finite check, ``result.found_inf``);
* the loss is more than ``z`` standard deviations above its exponential moving average
  (``loss_zscore``; the EMA and variance skip flagged steps; the deviation has a floor of 1% of the
  mean so that a flat loss does not make noise look like a spike);
* the gradient norm exceeds ``grad_ratio`` times its moving average (``grad_norm_ratio``; only
  when the engine clips, which is when it computes the norm).

No test fires in the first ``warmup`` steps except the non-finite ones. Flags and losses go into
a device buffer; :meth:`check` reads it once every ``every`` steps (the one sync).

**Rollback.** A quiet interval ends in a snapshot in host memory: the model, optimizer, engine
(loss scale, masters, counters), scheduler, RNG states, the detector and the data position; the
last ``keep`` are kept. A flagged interval restores the newest snapshot, drops the batches of the
first flagged step (every micro-batch of its window) from the data, records a ``spike`` event
(``offending_step``, ``batches``, ``cause``, ``loss``, ``rolled_back_to``, ``skipped``: every
dropped batch so far) and returns the snapshot's position: the steps after the snapshot are
re-run without the bad batch. A run that met bad batches thus ends with the parameters of a run
that never saw them (bitwise on CPU). Two triggers in a row from the same snapshot mean the
snapshot may itself be bad: the guard drops it and goes one further back (while ``keep`` allows).

**Checkpoints.** :meth:`SpikeGuard.state_dict` (in the Trainer's checkpoints) holds the detector,
the interval not read yet and the snapshot ring: a run stopped or killed between a spike and the
read that catches it rolls it back after the resume, at the same step (bitwise on CPU).

Positions are *logical*: position ``i`` is the ``i``-th batch not dropped (``index(i)``, and
``wrap`` fetches through it). One process only (the flags would differ between ranks).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..loop.batches import BatchSource
from ..loop.checkpoint import capture_rng, restore_rng
from ..step.engine import Event, MixedPrecision
from ..step.settings_diff import CheckpointSettingsWarning

__all__ = ["CAUSES", "ReplayedBatches", "SkippingBatches", "SpikeGuard", "check_trainer_data"]

#: the detector's causes, by bit of the per-step flag
CAUSES = ("nonfinite_loss", "nonfinite_grads", "loss_zscore", "grad_norm_ratio")


@dataclass
class _Snapshot:
    step: int
    position: int
    state: dict[str, Any]  # host copies: model, optimizer, amp, scheduler, rng, detector


def _host(obj: Any) -> Any:
    """A deep copy with every tensor cloned to host memory (nothing aliases live training state)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host(v) for v in obj)
    return copy.deepcopy(obj)


class SkippingBatches:
    """``batches`` seen through a guard: ``view(i)`` is ``batches(guard.index(i))``; other attributes
    (``samples_per_batch``, ``batches_per_epoch``, ...) are the wrapped object's."""

    def __init__(self, batches: Callable[[int], Any], guard: SpikeGuard) -> None:
        self.batches, self.guard = batches, guard

    def __call__(self, i: int) -> Any:
        return self.batches(self.guard.index(i))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["batches"], name)


class ReplayedBatches:
    """Batch ``i`` of an iterable (a DataLoader, a list, a generator or a factory of iterators, read
    in order pass after pass as the Trainer reads it), for :meth:`SpikeGuard.wrap`. A rollback
    returns at most to the guard's oldest snapshot, so only the batches from there on are kept
    (``held`` of them): memory is about ``keep * every`` batches, not the run's."""

    def __init__(self, source: BatchSource, guard: SpikeGuard) -> None:
        self.source, self.guard = source, guard
        self.first = 0  # the data index of the first batch kept
        self._kept: deque[Any] = deque()

    @property
    def held(self) -> int:
        """Batches kept in memory now."""
        return len(self._kept)

    def __call__(self, i: int) -> Any:
        floor = min(i, self.guard.oldest_index())
        while self._kept and self.first < floor:
            self._kept.popleft()
            self.first += 1
        if i < self.first:
            raise IndexError(
                f"batch {i} of this iterable was read and let go (the guard's oldest snapshot is at "
                f"batch {self.first}); a rollback never goes back that far"
            )
        while self.first + len(self._kept) <= i:
            self._kept.append(self.source.next())
        return self._kept[i - self.first]


def check_trainer_data(option: Any, source: BatchSource) -> None:
    """Refuse ``spike_rollback`` (``option``) in the Trainer over data that is not a function of the
    batch index, with why and what to do. A rollback re-reads the batches after its snapshot; the
    Trainer's checkpoints hold the guard's snapshots and interval, and a resume must re-read those
    batches exactly -- an iterator's consumed batches are gone (re-opening a DataLoader draws a new
    order, and per-sample augmentation draws again), so the resumed run would silently train on
    others. A function of the index names every batch for ever."""
    if not option or source.indexed:
        return
    kind = type(source.batches).__name__
    raise ValueError(
        f"spike_rollback in the Trainer needs the data as a function of the batch index "
        f"(batches(i) -> batch); this is a {kind}. A rollback re-reads the batches after its "
        "snapshot, and a resume from a checkpoint must re-read them exactly, which an iterator "
        "cannot (its consumed batches are gone; a new pass draws a new order): the resumed run "
        "would train on other batches. Pass the batches by index instead -- data that fits in "
        "memory: `cached = list(loader); batches = lambda i: cached[i % len(cached)]`; a map-style "
        "dataset: a function that collates batch i from it -- or use ampkit.SpikeGuard in your own "
        "loop (guard.wrap(loader): in one process, a resume does not restore its batches)"
    )


class SpikeGuard:
    """Device-side spike detection with in-memory rollback (module doc).

    Args:
        model, optimizer, amp: as set up by ``amp.setup``.
        keep: snapshots kept in host memory (each one model + optimizer state).
        every: optimizer steps between reads of the detector (and snapshots).
        z: the loss z-score that flags a step; ``grad_ratio``: the gradient-norm ratio (None: off).
        warmup: steps before the z-score and ratio tests start; ``ema``: the moving averages' decay.
        scheduler: a learning-rate scheduler to snapshot and restore with the rest.
        position: the data position of the first snapshot (taken now).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        amp: MixedPrecision,
        *,
        keep: int = 2,
        every: int = 20,
        z: float = 6.0,
        grad_ratio: Optional[float] = 10.0,
        warmup: int = 10,
        ema: float = 0.95,
        scheduler: Any = None,
        position: int = 0,
    ) -> None:
        checks = {
            "keep": (keep, keep >= 1),
            "every": (every, every >= 1),
            "z": (z, z > 0),
            "warmup": (warmup, warmup >= 0),
            "ema": (ema, 0 < ema < 1),
            "grad_ratio": (grad_ratio, grad_ratio is None or grad_ratio > 1),
        }
        for name, (value, ok) in checks.items():
            if not ok:
                raise ValueError(
                    f"SpikeGuard {name}={value!r} is out of range: keep >= 1, every >= 1, z > 0, "
                    "warmup >= 0, 0 < ema < 1, grad_ratio None or > 1"
                )
        if amp.model is None:
            raise RuntimeError(
                "SpikeGuard() before amp.setup(); call model, optimizer = amp.setup(model, optimizer) first"
            )
        self.model, self.optimizer, self.amp, self.scheduler = model, optimizer, amp, scheduler
        self.keep, self.every, self.z, self.grad_ratio, self.warmup, self.ema = (
            keep,
            every,
            z,
            grad_ratio,
            warmup,
            ema,
        )
        self.skipped: set[int] = set()  # data indices dropped by rollbacks
        self.rollbacks = 0
        self._ring: deque[_Snapshot] = deque(maxlen=keep)
        self._last_restored: Optional[_Snapshot] = None
        dev = amp.device
        self._flags = torch.zeros(every, device=dev)
        self._losses = torch.zeros(every, device=dev)
        self._ranges: list[list[int]] = []  # per step of the interval: its data indices
        self._n = 0  # steps in the current interval
        self._seen = 0  # steps observed (host count: warmup and the variance's bias correction)
        self._stats = torch.zeros(3, device=dev)  # loss EMA, loss variance EMA, grad-norm EMA
        self.position = position
        self._unsubscribe = amp.subscribe(self._on_event)
        self.start(position)

    # ------------------------------------------------------------------ data positions
    def index(self, position: int) -> int:
        """The data index of logical ``position``: the ``position``-th index no rollback dropped."""
        i = position
        for s in sorted(self.skipped):
            if s <= i:
                i += 1
            else:
                break
        return i

    def wrap(self, batches: Any) -> SkippingBatches:
        """``batches`` with the dropped indices skipped (attributes pass through): what the Trainer
        takes, a function of the index or any iterable of batches (a DataLoader, a list, a generator:
        read in order, the batches since the oldest snapshot kept, :class:`ReplayedBatches`)."""
        source = BatchSource(batches)  # checks what it is (TypeError: not batches); reads nothing
        return SkippingBatches(batches if source.indexed else ReplayedBatches(source, self), self)

    def oldest_index(self) -> int:
        """The data index of the oldest snapshot's position: as far back as a rollback can go."""
        return self.index(self._ring[0].position) if self._ring else 0

    # ------------------------------------------------------------------ the per-step detector (no sync)
    def _on_event(self, event: Event) -> None:
        if event.kind != "step" or self._n >= self.every:
            return
        loss, result = event.data.get("loss"), event.data.get("result")
        if loss is None or result is None:
            return
        loss = loss.detach().float().reshape(())
        finite = torch.isfinite(loss)
        code = (~finite).float()
        if result.found_inf is not None:
            code = code + (result.found_inf > 0).float() * 2
        mean, var, gn_ema = self._stats[0], self._stats[1], self._stats[2]
        gn = result.grad_norm.detach().float() if result.grad_norm is not None else None
        if self._seen >= max(self.warmup, 1):
            corrected = var / (
                1.0 - self.ema**self._seen
            )  # the EMA variance starts at 0: unbias it
            dev = torch.maximum(corrected.sqrt(), mean.abs() * 0.01) + 1e-12
            code = code + ((loss - mean) / dev > self.z).float() * 4
            if gn is not None and self.grad_ratio is not None:
                code = code + (gn > gn_ema * self.grad_ratio).float() * 8
        ok = code == 0
        a = self.ema
        if self._seen == 0:
            new = torch.stack(
                [loss, torch.zeros_like(loss), gn if gn is not None else torch.zeros_like(loss)]
            )
        else:
            delta = loss - mean
            new = torch.stack(
                [
                    mean + (1 - a) * delta,
                    a * (var + (1 - a) * delta * delta),
                    a * gn_ema + (1 - a) * gn if gn is not None else gn_ema,
                ]
            )
        self._stats.copy_(torch.where(ok, new, self._stats))
        self._flags[self._n] = code
        self._losses[self._n] = loss
        self._seen += 1

    # ------------------------------------------------------------------ the loop's call
    def check(self, position: int) -> int:
        """After each optimizer step, with the data position of the next batch. Returns the position
        to continue from: ``position``, or after a rollback the restored snapshot's. Every ``every``
        steps reads the detector (**syncs** once) and snapshots, or rolls back."""
        self._ranges.append([self.index(p) for p in range(self.position, position)])
        self.position = position
        self._n += 1
        if self._n < self.every:
            return position
        flags, losses = torch.stack([self._flags[: self._n], self._losses[: self._n]]).tolist()
        bad = next((j for j, f in enumerate(flags) if f), None)
        if bad is None:
            self.start(position)
            return position
        return self._roll_back(bad, int(flags[bad]), losses[bad])

    def start(self, position: int) -> None:
        """Snapshot now (a clean state at data ``position``) and start a new interval. **Syncs**."""
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "amp": self.amp.state_dict(),
            "rng": capture_rng(),
            "stats": self._stats,
            "seen": self._seen,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }
        self._ring.append(_Snapshot(self.amp.optimizer_steps, position, _host(state)))
        self._last_restored = None
        self._reset(position)

    def _reset(self, position: int) -> None:
        self._n, self._ranges, self.position, self._start_step = (
            0,
            [],
            position,
            self.amp.optimizer_steps,
        )

    def _roll_back(self, j: int, code: int, loss: float) -> int:
        snap = self._ring[-1]
        if self._last_restored is snap and len(self._ring) > 1:
            self._ring.pop()  # a second trigger after restoring it: the snapshot itself is suspect
            snap = self._ring[-1]
        offending = self._start_step + j + 1
        dropped = self._ranges[j]
        self.skipped.update(dropped)
        self._restore(snap)
        self.rollbacks += 1
        self._last_restored = snap
        causes = [c for bit, c in enumerate(CAUSES) if code & (1 << bit)]
        self.amp.record_event(
            "spike",
            offending_step=offending,
            batches=dropped,
            cause=causes,
            loss=loss if math.isfinite(loss) else str(loss),
            rolled_back_to=snap.step,
            position=snap.position,
            skipped=sorted(self.skipped),
        )
        self._reset(snap.position)
        return snap.position

    def _restore(self, snap: _Snapshot) -> None:
        s = _host(
            snap.state
        )  # fresh copies: loading must not alias the snapshot (torch keeps same-dtype tensors)
        self.model.load_state_dict(s["model"])
        self.optimizer.load_state_dict(s["optimizer"])
        kept = s["amp"][
            "events"
        ]  # the snapshot's, plus the spikes since (an older snapshot predates them)
        kept += [
            d for d in (e.to_dict() for e in self.amp.events if e.kind == "spike") if d not in kept
        ]
        with warnings.catch_warnings():  # its own snapshot (the spike event says the rollback)
            warnings.simplefilter("ignore", CheckpointSettingsWarning)
            self.amp.load_state_dict(s["amp"])
        if self.scheduler is not None and s["scheduler"] is not None:
            self.scheduler.load_state_dict(s["scheduler"])
        restore_rng(s["rng"])
        self._stats.copy_(s["stats"])
        self._seen = s["seen"]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The detector and the rollback state, for a checkpoint: the moving averages, the steps seen,
        the current interval's flags, losses and data indices (steps not read yet), the dropped batches
        and every snapshot of the ring (each a model + optimizer state in host memory: a checkpoint of
        a guarded run is ``1 + keep`` times the size). A run resumed from it checks, rolls back and
        snapshots at the same steps as an uninterrupted one. **Syncs** (copies the device buffers)."""
        ring = list(self._ring)
        return {
            "every": self.every,
            "position": self.position,
            "start_step": self._start_step,
            "n": self._n,
            "seen": self._seen,
            "stats": _host(self._stats),
            "flags": _host(self._flags[: self._n]),
            "losses": _host(self._losses[: self._n]),
            "ranges": [list(r) for r in self._ranges],
            "skipped": sorted(self.skipped),
            "rollbacks": self.rollbacks,
            "ring": [{"step": x.step, "position": x.position, "state": x.state} for x in ring],
            "last_restored": next(
                (i for i, x in enumerate(ring) if x is self._last_restored), None
            ),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the guard goes on where the checkpointed one was). The guard's
        ``every`` must be the saved one (the interval in progress is that long)."""
        if int(state["every"]) != self.every:
            raise ValueError(
                f"this checkpoint's spike guard reads every {state['every']} steps, this one every "
                f"{self.every}; resume with the same spike_rollback settings"
            )
        n, dev = int(state["n"]), self._flags.device
        self._ring = deque(
            (_Snapshot(int(x["step"]), int(x["position"]), x["state"]) for x in state["ring"]),
            maxlen=self.keep,
        )
        i = state.get("last_restored")
        self._last_restored = self._ring[i] if i is not None and i < len(self._ring) else None
        self._stats.copy_(state["stats"])
        self._flags.zero_()
        self._losses.zero_()
        self._flags[:n] = state["flags"].to(dev)
        self._losses[:n] = state["losses"].to(dev)
        self._ranges = [[int(j) for j in r] for r in state["ranges"]]
        self._n, self._seen, self._start_step = n, int(state["seen"]), int(state["start_step"])
        self.position, self.rollbacks = int(state["position"]), int(state["rollbacks"])
        self.skipped = {int(j) for j in state["skipped"]}

    def follows(self, step: int, position: int) -> bool:
        """Whether the guard's state is that of optimizer step ``step`` at data ``position``: the run
        went on from where the guard left it (a later ``fit``, a resume that restored the guard)."""
        return self._start_step + self._n == step and self.position == position

    def close(self) -> None:
        """Stop watching the engine (the snapshots are freed)."""
        self._unsubscribe()
        self._ring.clear()

    def on_step_end(self, trainer: Any, step: int, result: Any) -> None:
        """As a :class:`~ampkit.train.trainer.Trainer` callback: check, and move its data position
        back on a rollback."""
        trainer.micro_index = self.check(trainer.micro_index)

    @staticmethod
    def trainer_state(trainer: Any) -> dict[str, Any]:
        """``{"spike_guard": state}`` for a :class:`~ampkit.train.trainer.Trainer`'s checkpoint (its
        guard's :meth:`state_dict`), ``{}`` for a trainer without a guard."""
        return (
            {"spike_guard": trainer.spike_guard.state_dict()}
            if trainer.spike_guard is not None
            else {}
        )

    @classmethod
    def load_trainer_state(cls, trainer: Any, state: Optional[dict[str, Any]]) -> None:
        """A trainer's checkpoint was loaded: with a guard state, the trainer's guard (made now, with
        ``spike_rollback``) takes it; without one, a live guard snapshots what was loaded."""
        if state is not None:
            cls.for_trainer(trainer, state)
        elif trainer.spike_guard is not None:
            trainer.spike_guard.start(trainer.micro_index)

    @classmethod
    def for_trainer(
        cls, trainer: Any, saved: Optional[dict[str, Any]] = None
    ) -> Optional[SpikeGuard]:
        """The guard of a :class:`~ampkit.train.trainer.Trainer` with ``spike_rollback`` set (``True``, or a
        dict of :class:`SpikeGuard` keywords; None otherwise), snapshotted at its data position. The first
        call wraps ``trainer.batches`` and joins ``trainer.callbacks`` (``on_step_end`` runs after the
        scheduler's step). ``saved``: a checkpoint's guard state (:meth:`state_dict`: the interval in
        progress, the snapshots), so a stop or a kill before a spike is read still rolls it back,
        after the resume, at the step an uninterrupted run does. Dropped
        batches are also read back from the engine's ``spike`` events (a checkpoint without a guard
        state), so a resumed run keeps skipping them."""
        option = trainer.spike_rollback
        if not option:
            return None
        if trainer.world_size > 1:
            raise ValueError(
                "spike_rollback runs in one process only (each rank would flag different "
                f"steps); this run has {trainer.world_size} processes"
            )
        if option is not True and not isinstance(option, dict):
            raise ValueError(
                f"spike_rollback={option!r} must be True/False or a dict of SpikeGuard keywords "
                "(keep, every, z, grad_ratio, warmup, ema)"
            )
        check_trainer_data(option, trainer.source)
        guard = trainer.spike_guard
        if guard is None:
            kwargs = dict(option) if isinstance(option, dict) else {}
            guard = cls(
                trainer.model,
                trainer.optimizer,
                trainer.amp,
                scheduler=trainer.scheduler,
                position=trainer.micro_index,
                **kwargs,
            )
            trainer.batches = trainer.source.batches = guard.wrap(trainer.batches)
            trainer.callbacks.append(guard)
            trainer.spike_guard = guard
        if (
            saved is not None
        ):  # resumed: the checkpointed guard goes on (its interval, its snapshots)
            guard.load_state_dict(saved)
        elif not guard.follows(trainer.amp.optimizer_steps, trainer.micro_index):
            guard.start(trainer.micro_index)  # the run was moved elsewhere: a snapshot of now
        for e in trainer.amp.events:
            if e.kind == "spike":
                guard.skipped.update(e.data.get("skipped", []))
        return guard
