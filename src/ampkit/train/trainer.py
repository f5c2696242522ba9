"""A small training loop composed from the engine: what ``ampkit train`` runs.

Reads top to bottom: take the next batch (:mod:`~ampkit.loop.batches`: a function of the index or
any iterable, epoch by epoch), forward under ``amp.autocast()``, ``amp.backward``, ``amp.step``;
then what follows a step, in :meth:`Trainer._after_step`'s fixed order (scheduler, epoch records,
callbacks, evaluation, checkpoint, stop). A :class:`~ampkit.observe.monitor.Monitor` records every
optimizer step and reads the
device only every ``log_every`` steps, so the loop adds no per-step host sync of its own.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..distributed import broadcast_object, is_main, rank, world_size
from ..distributed.states import capture, restore
from ..loop.batches import BatchSource, held_out
from ..loop.checkpoint import (
    CheckpointManager,
    ShardedCheckpointManager,
    capture_rng,
    check_state,
    restore_rng,
)
from ..loop.steps import LossFn, StepOutcome, Steps, batch_loss
from ..models.data import batch_size, split_batch  # noqa: F401 (split_batch: still importable from here)
from ..observe.monitor import Monitor
from ..plan.autobatch import check_auto_args
from ..step.engine import MixedPrecision
from .choices import choose_batch, confirm_auto_precision, rebatch
from .epochs import EpochLog
from .firstskip import RecentBatches, SkipWatch, saved_diagnosis
from .rollback import SpikeGuard, check_trainer_data
from .runlog import open_monitor, write_summary
from .stop import GracefulStop, TrainingInterrupted, signal_name
from .summary import TrainSummary
from .trainer_config import (
    BatchConfig,
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    TrainerSettings,
    check_engine,
    group_settings,
)

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "EvalConfig",
    "LogConfig",
    "TrainSummary",
    "Trainer",
    "TrainingInterrupted",
]


class Trainer:
    """Train ``model`` with ``amp`` on ``batches``: a ``DataLoader``, a list, any re-iterable, a
    function returning a fresh iterator each epoch, or a function from batch index to batch.

    ``Trainer(model, optimizer, amp, batches).fit(steps)`` is the whole call; the rest is optional.

    Args:
        model, optimizer: already passed through ``amp.setup`` (anything else is refused here).
        batches: an iterable of batches, walked in order, one pass per epoch (``set_epoch`` called
            on its sampler each epoch; see :class:`~ampkit.loop.batches.BatchSource`), or
            ``batches(i)`` returning micro-batch ``i``. Samples per second are counted from the
            batches themselves (the first dimension of the first tensor) unless the data exposes
            ``samples_per_batch``; ``tokens_per_batch`` adds tokens per second.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``; default :func:`~ampkit.loop.steps.batch_loss`
            (``model(*batch)``).
        scheduler: a learning-rate scheduler, stepped after every optimizer step that was not skipped.
        callbacks: objects with any of ``on_step_end(trainer, step, result)``,
            ``on_eval(trainer, loss)``, ``on_checkpoint(trainer, path)``, ``on_train_end(trainer, summary)``.
        fallback: turn on the engine's default fallback chain if it is off (``False`` leaves the
            engine as configured).
        diagnose: on the first skipped step of the run, re-run that step's batch with
            :meth:`MixedPrecision.diagnose` and record which module produced the inf/NaN (the
            skip is learnt from the monitor's batched reads, so this adds no per-step sync).
        checkpoint, evaluation, log, batching: the settings in groups (:class:`CheckpointConfig`:
            checkpoints' ``dir``, ``every``, ``keep_last``; :class:`EvalConfig`: held-out
            ``batches`` every ``every`` steps, ``steps`` of them, in the training ``precision`` or
            ``"fp32"``; :class:`LogConfig`: host reads every ``every`` steps, logs in ``dir``,
            ``tensorboard``, a ``progress`` bar on ``console``; :class:`BatchConfig`: ``size="auto"``
            within ``memory_budget``). **settings: the same one by one, as flat keywords
            (``checkpoint_dir``, ``eval_every``, ``log_dir``, ``batch_size``, ...;
            :data:`~ampkit.train.trainer_config.FLAT`), each replacing one field of its group.

    An engine asked for ``"auto"`` has its choice confirmed by measurement on a CPU before the
    first step (:func:`ampkit.choose.autoselect.confirm_auto`; a resumed run keeps its checkpoint's
    precision).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        amp: MixedPrecision,
        batches: Any,
        *,
        loss_fn: LossFn = batch_loss,
        scheduler: Any = None,
        callbacks: Sequence[Any] = (),
        fallback: bool = True,
        diagnose: bool = True,
        checkpoint: Optional[CheckpointConfig] = None,
        evaluation: Optional[EvalConfig] = None,
        log: Optional[LogConfig] = None,
        batching: Optional[BatchConfig] = None,
        spike_rollback: Any = False,
        **settings: Any,
    ) -> None:
        check_engine(model, optimizer, amp)  # before anything is printed or changed
        self.settings: TrainerSettings = group_settings(
            {"checkpoint": checkpoint, "evaluation": evaluation, "log": log, "batching": batching},
            settings,
        )
        self.model, self.optimizer, self.amp = model, optimizer, amp
        self.batches, self.loss_fn, self.spike_rollback, self.spike_guard = (
            batches,
            loss_fn,
            spike_rollback,
            None,
        )
        self.split = 1  # micro-batches each batch is cut into (doubled after an OOM error)
        self.run_id = broadcast_object(
            uuid.uuid4().hex[:12]
        )  # one id for all ranks; kept across resumes
        self.notes: list[str] = []
        self.diagnose = diagnose
        self.diagnosis: Any = None
        self.scheduler = scheduler
        self.world_size, self.rank = (
            world_size(),
            rank(),
        )  # > 1: rank 0 alone logs; checkpoints are sharded (DCP)
        self.source = BatchSource(batches, rank=self.rank, world_size=self.world_size)
        check_trainer_data(spike_rollback, self.source)  # at once, not at fit()
        self.epochs = EpochLog()
        self._window_batches: list[
            Any
        ] = []  # the step's batches, kept to redo it after an OOM error
        self._window_plan: Optional[int] = None
        self._last_loss: Any = None  # the last step's mean loss (device tensor)
        self._samples = 0  # samples in the last step's batches
        ck = self.settings.checkpoint
        self.checkpoints: Any = None
        if ck.dir and self.world_size > 1:
            self.checkpoints = ShardedCheckpointManager(
                ck.dir, lambda: capture(model, optimizer), keep_last=ck.keep_last
            )
        elif ck.dir:
            self.checkpoints = CheckpointManager(ck.dir, keep_last=ck.keep_last)
        self.callbacks = list(callbacks)
        check_auto_args(
            self.settings.batching.size, self.settings.batching.memory_budget, self.world_size
        )
        self.auto_batch: Any = None  # an AutoBatch once batch_size='auto' has chosen
        self.micro_batch: Optional[int] = (
            None  # set when ampkit cuts batches (auto batch size, OOM)
        )
        self._monitor: Optional[Monitor] = None
        self._resumed: Optional[str] = None  # what load_state_dict loaded, until a fit logs it
        if fallback and amp.config.fallback is False:
            if amp.config.skip_nonfinite:
                amp.set_fallback(
                    True
                )  # on by default in the trainer (DESIGN §4); opt-in on the engine
            else:
                self.notes.append("fallback left off: it needs skip_nonfinite=True")
        self._recent = RecentBatches(
            2 * self.settings.log.every + 2
        )  # a skip's batch, for its diagnosis
        self._stop: Optional[GracefulStop] = None  # set while fit() runs
        self._watch: Optional[SkipWatch] = None  # the first skip the monitor showed (fit())
        #: printed after a graceful stop's checkpoint (``ampkit train`` puts its exact command here)
        self.resume_hint = "Resume with Trainer.resume() on the same checkpoint_dir, then fit() the remaining steps"

    @property
    def micro_index(self) -> int:
        """The data position: batches taken so far (this rank); set back by a spike rollback."""
        return self.source.micro_index

    @micro_index.setter
    def micro_index(self, value: int) -> None:
        self.source.seek(value)

    def fit(self, steps: Optional[int] = None, *, epochs: Optional[int] = None) -> TrainSummary:
        """Run ``steps`` optimizer steps (each ``accumulation_steps`` micro-batches), or train until
        ``epochs`` epochs are done in all (counted from the run's start, across resumes).

        With an iterable, an epoch is one pass over it, every batch once and in order, the last
        short batch too; when the epoch's batches do not fill the last accumulation window, that
        window is shorter (:meth:`MixedPrecision.set_window`). With a function of the index, an
        epoch is ``batches_per_epoch`` indices and windows run on across epochs. Each completed
        epoch writes an ``epoch`` record (loss, seconds, samples/s; one host read).

        Before the first step of a run: an engine asked for ``"auto"`` has its pick confirmed by
        measurement (CPU; :func:`~ampkit.choose.autoselect.confirm_auto`), then ``batch_size="auto"``
        chooses the micro-batch for that precision.

        **Signals.** While ``fit`` runs, SIGINT (Ctrl-C) and SIGTERM do not kill the run: the
        optimizer step in flight is finished, a checkpoint of that step is written (with a
        ``checkpoint_dir``), a ``stop`` event is logged, and :class:`TrainingInterrupted` (a
        ``KeyboardInterrupt``; ``.signal``, ``.step``, ``.checkpoint``, ``.exit_code`` 130/143) is
        raised -- ``fit`` does not return. :meth:`resume` then continues bitwise where it stopped.
        With several processes every rank stops after the same step. The handlers are installed
        for the length of ``fit`` only (main thread); the previous ones are restored."""
        (steps, epochs), amp = self._count_steps(steps, epochs), self.amp
        if amp.optimizer_steps == 0:
            confirm_auto_precision(self)
        if (
            self.settings.batching.size == "auto"
            and self.auto_batch is None
            and amp.optimizer_steps == 0
        ):
            choose_batch(self)
        accum, watch = (
            amp.config.accumulation_steps // self.split,
            SkipWatch(),
        )  # accum: in batches of the data
        monitor = self._open_monitor(steps, accum, [watch] if self.diagnose else [])
        self._watch = watch
        self.model.train()
        self.epochs.start()
        stop = self._stop = GracefulStop(announce=is_main())
        try:
            stop.__enter__()  # SIGINT/SIGTERM handlers only while training; the user's come back in `finally`
            run, target = (
                Steps(self.model, self.optimizer, amp, self.loss_fn),
                amp.optimizer_steps + (steps or 0),
            )
            SpikeGuard.for_trainer(self)  # spike_rollback: snapshots now; on_step_end may roll back
            while amp.optimizer_steps < target if epochs is None else self.source.epoch < epochs:
                self._train_step(run, accum, monitor, watch, stop)  # (a rollback takes steps back)
            stop.drain()  # the last step's flag: its collective completes on every rank alike
        except BaseException:
            # Keep the original error (e.g. a full disk) rather than one from closing the logs.
            with contextlib.suppress(Exception):
                monitor.close()
            self._monitor = None
            raise
        finally:
            stop.__exit__()
            self._stop = None
        return self._finish(monitor)

    def _count_steps(
        self, steps: Optional[int], epochs: Optional[int]
    ) -> tuple[int, Optional[int]]:
        """``(steps, None)``, or for ``epochs=`` on an iterable ``(estimated steps, epochs)`` (the
        loop runs until that many epochs are done); a function of the index turns epochs into steps."""
        if (steps is None) == (epochs is None):
            raise ValueError("give exactly one of steps= and epochs=")
        if epochs is not None:
            src = self.source
            if not isinstance(epochs, int) or epochs < 1:
                raise ValueError(f"epochs={epochs!r} must be an integer >= 1")
            if epochs <= src.epoch:
                raise ValueError(
                    f"epochs={epochs}: this run has already completed {src.epoch} epoch(s); "
                    "fit(epochs=N) trains until N epochs are done in all"
                )
            per, accum = src.per_epoch, self.amp.config.accumulation_steps // self.split
            if src.indexed:
                if per is None:
                    raise ValueError(
                        f"epochs={epochs} needs data with a batches_per_epoch attribute "
                        "(or an iterable of batches, e.g. a DataLoader); use steps= instead"
                    )
                return max(
                    1, (epochs * per - src.micro_index) // self.amp.config.accumulation_steps
                ), None
            left = (
                [per - src.in_epoch] + [per] * (epochs - src.epoch - 1) if per is not None else []
            )
            return sum(
                -(-n // accum) for n in left
            ), epochs  # -(-a // b): windows, the short last one too
        assert steps is not None
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        return steps, None

    def _open_monitor(self, steps: int, accum: int, extra_sinks: list[Any]) -> Monitor:
        """The run's monitor (:func:`.runlog.open_monitor`)."""
        resumed, self._resumed = self._resumed, None
        self._monitor = open_monitor(self, steps, accum, extra_sinks, resumed)
        return self._monitor

    def _train_step(
        self, run: Steps, accum: int, monitor: Monitor, watch: SkipWatch, stop: GracefulStop
    ) -> None:
        """One optimizer step (redone with smaller micro-batches after an out-of-memory error),
        then :meth:`_after_step`."""
        step = self.amp.optimizer_steps + 1
        while True:
            try:
                outcome = self._window(run, step, accum)
                break
            except torch.OutOfMemoryError as e:
                rebatch(
                    self, e, accum, monitor
                )  # no step lost, none counted twice: the window is redone
                accum = self.amp.config.accumulation_steps // self.split
        self._after_step(outcome, monitor, watch, stop)

    def _after_step(
        self, outcome: StepOutcome, monitor: Monitor, watch: SkipWatch, stop: GracefulStop
    ) -> None:
        """What follows each optimizer step, in this order -- the one place per-step hooks go:
        scheduler, first-skip diagnosis, epoch records, callbacks, evaluation, checkpoint, stop."""
        amp, result = self.amp, outcome.result
        if self.scheduler is not None and not result.skipped:
            # Only after optimizer steps that really happened (reading `skipped` syncs once
            # per step; only when a scheduler is given), as Accelerate does.
            self.scheduler.step()
        self._diagnose_first_skip()
        self._last_loss = outcome.mean_loss()
        self.epochs.add(self._last_loss, self._samples)
        for epoch in self.source.take_finished():
            monitor.log_event("epoch", **self.epochs.close(epoch, self.world_size))
        self._call("on_step_end", amp.optimizer_steps, result)
        every = self.settings.evaluation.every
        if every and amp.optimizer_steps % every == 0:
            self.evaluate()
        saved = None
        every = self.settings.checkpoint.every
        if every and amp.optimizer_steps % every == 0:
            saved = self._checkpoint(monitor)
        signum = stop.poll(amp.device)  # every rank: the same answer after the same step
        if signum:
            self._stop_now(signum, saved, monitor)

    def _finish(self, monitor: Monitor) -> TrainSummary:
        """Close the monitor, write ``summary.json``, call ``on_train_end``; the run's summary."""
        summary = monitor.close()
        self._monitor = None
        log_dir = self.settings.log.dir
        if log_dir and is_main():
            write_summary(log_dir, summary)
        result = TrainSummary.from_run(
            self.amp.stats(),
            summary,
            monitor.records,
            monitor.events,
            log_dir=log_dir,
            run_id=self.run_id,
            world_size=self.world_size,
            micro_batch=self.micro_batch,
            notes=list(self.notes),
        )
        self._call("on_train_end", result)
        return result

    def _diagnose_first_skip(self) -> None:
        """Diagnose the run's first skipped step once the monitor has shown it (one per run)."""
        watch = self._watch
        if watch is not None and watch.first is not None and self.diagnosis is None:
            self.diagnosis = self._recent.diagnose(*watch.first, self.amp, self.model, self.loss_fn)

    def _checkpoint(self, monitor: Monitor) -> str:
        # The log covers the checkpoint (no gap after a kill and resume) and holds the diagnosis of
        # a skip it shows, as an uninterrupted run's does; the checkpoint syncs anyway.
        monitor.flush()
        self._diagnose_first_skip()
        t0 = time.perf_counter()
        path = self.save_checkpoint()
        monitor.log_event(
            "checkpoint", path=path, seconds=time.perf_counter() - t0, **self._progress()
        )
        self._call("on_checkpoint", path)
        return path

    def _stop_now(self, signum: int, saved: Optional[str], monitor: Monitor) -> None:
        """After a signal: checkpoint this step (unless just done), record a ``stop`` event, raise."""
        path = saved if saved is not None or self.checkpoints is None else self._checkpoint(monitor)
        monitor.log_event("stop", signal=signal_name(signum), checkpoint=path, **self._progress())
        stop = TrainingInterrupted(signum, self.amp.optimizer_steps, path)
        if is_main():
            hint = f". {self.resume_hint}" if path and self.resume_hint else ""
            print(f"ampkit: {stop}{hint}", file=sys.stderr, flush=True)
        raise stop

    def _progress(self) -> dict[str, Any]:
        """Where the run is, for checkpoints and records: ``epoch`` (completed epochs; the one in
        progress is numbered so, from 0), ``batch_in_epoch`` and the last step's ``loss`` (read: a sync)."""
        loss = float(self._last_loss) if self._last_loss is not None else None
        return {"epoch": self.source.epoch, "batch_in_epoch": self.source.in_epoch, "loss": loss}

    def request_stop(self) -> None:
        """Stop ``fit`` after the optimizer step in flight, as SIGTERM would (checkpoint, then
        :class:`TrainingInterrupted`); e.g. from a callback. No effect outside ``fit``."""
        if self._stop is not None:
            self._stop.request()

    def _window(self, run: Steps, step: int, accum: int) -> StepOutcome:
        """One optimizer step: ``accum`` batches (fewer at the end of an iterable's epoch), each
        cut into ``self.split`` micro-batches. Its batches are kept until it completes, so an
        out-of-memory error redoes it on the same data."""
        kept = self._window_batches
        if not kept:
            self._window_plan = self.source.window(accum)
        count = self._window_plan or accum
        if count < accum:
            self.amp.set_window(
                count * self.split
            )  # the epoch's short last window, stepped on its own

        def batch(k: int) -> Any:
            while len(kept) <= k:
                kept.append(self.source.next())
            return kept[k]

        def remember(k: int, b: Any) -> None:
            if k == 0 and self.diagnose and self.diagnosis is None:
                self._recent.remember(step, b)

        outcome = run.optimizer_step(batch, 0, count=count, split=self.split, on_batch=remember)
        samples = [self.source.samples_in(b) for b in kept]
        self._samples = sum(n for n in samples if n) if all(samples) else 0
        kept.clear()
        monitor = self._monitor
        if (
            monitor is not None
            and monitor.samples_per_step is None
            and self._samples
            and count == accum
        ):
            monitor.samples_per_step = (
                self._samples * self.world_size
            )  # counted from the batches themselves
        return outcome

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def evaluate(self) -> float:
        """Mean loss over ``eval_steps`` held-out batches, in the training precision or fp32
        (``eval_precision``), without gradients; logged as an ``eval`` event. **Syncs** once."""
        ev = self.settings.evaluation
        batch_of, n = held_out(ev.batches, ev.steps)  # an iterable: its first eval_steps batches
        ctx = self.amp.autocast if ev.precision == "train" else self.amp.disabled
        value = float(
            Steps(self.model, self.optimizer, self.amp, self.loss_fn).eval_loss(batch_of, n, ctx)
        )
        if self._monitor is not None:
            self._monitor.log_event(
                "eval",
                loss=value,
                precision=self.amp.precision.name if ev.precision == "train" else "fp32",
                batches=n,
            )
        self._call("on_eval", value)
        return value

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The whole training state: model, optimizer, scheduler, engine (precision after fallbacks,
        scaler, counters, events), RNG states, the data position, the spike guard's. **Syncs**."""
        return {
            **dict(zip(("model", "optimizer"), capture(self.model, self.optimizer))),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "amp": self.amp.state_dict(),
            "rng": {
                **capture_rng(),
                **self.source.rng_state(),
            },  # the data pass's too: ranks differ
            "data": {
                **self.source.state_dict(),
                "batch_size": self.source.declared_batch_size,
                "split": self.split,
                "epoch_log": self.epochs.state_dict(),
            },
            "run": {"id": self.run_id, **self._progress()},
            **SpikeGuard.trainer_state(self),
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Restore :meth:`state_dict`. Everything is checked before anything is loaded: the keys,
        the model's keys and shapes, the optimizer's parameter groups and the engine state; on a
        mismatch nothing changes and :class:`~ampkit.loop.checkpoint.CheckpointError` says what."""
        check_state(state, capture(self.model, self.optimizer)[0], self.optimizer, source)
        self.source.check_resume(state.get("data", {}), source)
        restore(self.model, self.optimizer, state["model"], state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.amp.load_state_dict(state["amp"])
        restore_rng(state.get("rng", {}))
        data = state.get("data", {})
        if "data" not in state:  # (a checkpoint the Trainer wrote always has it)
            warnings.warn(
                f"{source} has no data position ('data'): the data starts again from its "
                "first batch, so this run will not read what the saved one would have",
                stacklevel=2,
            )
        self.source.load_state_dict(data, state.get("rng"))
        self.epochs.load_state_dict(data.get("epoch_log", {}))
        self.split = int(data.get("split", 1))
        loss = state.get("run", {}).get("loss")
        self._last_loss = torch.tensor(loss) if loss is not None else None
        self.run_id = str(state.get("run", {}).get("id", self.run_id))
        self.diagnosis = (
            saved_diagnosis(state["amp"].get("events", [])) or self.diagnosis
        )  # once per run
        SpikeGuard.load_trainer_state(self, state.get("spike_guard"))  # (spike_rollback)
        self._resumed = source  # the next fit's log goes on after this step (run_sinks)

    def save_checkpoint(self) -> str:
        if self.checkpoints is None:
            raise RuntimeError("no checkpoint_dir was given to the Trainer")
        return self.checkpoints.save(self.amp.optimizer_steps, self.state_dict())

    def resume(self) -> Optional[str]:
        """Load the newest good checkpoint of ``checkpoint_dir``; returns its path, or None if there is none."""
        if self.checkpoints is None:
            raise RuntimeError("no checkpoint_dir was given to the Trainer")
        found = self.checkpoints.load_latest()
        if found is None:
            return None
        path, state = found
        self.load_state_dict(state, source=f"checkpoint {path!r}")
        return path
