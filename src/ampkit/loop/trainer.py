"""A small training loop composed from the engine: what ``ampkit train`` runs.

Reads top to bottom: take batch ``i``, forward under ``amp.autocast()``, ``amp.backward``,
``amp.step``; a :class:`~ampkit.observe.monitor.Monitor` records every optimizer step and reads the
device only every ``log_every`` steps, so the loop adds no per-step host sync of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Callable, Optional

import torch

from ..distributed import broadcast_object, is_main, rank, world_size
from ..distributed.states import capture, restore
from ..observe.monitor import ConsoleSink, JSONLSink, Monitor, TensorBoardSink
from ..step.engine import MixedPrecision
from .autobatch import check_auto_args, choose_split, device_budget
from .autoselect import auto_decision, confirm_auto
from .checkpoint import (
    CheckpointManager,
    ShardedCheckpointManager,
    capture_rng,
    check_state,
    restore_rng,
)
from .data import batch_size, split_batch  # noqa: F401 (split_batch: still importable from here)
from .firstskip import RecentBatches, SkipWatch, saved_diagnosis
from .rollback import SpikeGuard
from .steps import LossFn, Steps, batch_loss
from .stop import GracefulStop, TrainingInterrupted, signal_name
from .summary import TrainSummary
from .trainer_config import (
    BatchConfig,
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    TrainerSettings,
    group_settings,
)

__all__ = ["BatchConfig", "CheckpointConfig", "EvalConfig", "LogConfig", "TrainSummary", "Trainer",
           "TrainingInterrupted"]

BatchFn = Callable[[int], Any]


class Trainer:
    """Train ``model`` with ``amp`` on ``batches`` (a function from batch index to batch).

    ``Trainer(model, optimizer, amp, batches).fit(steps)`` is the whole call; the rest is optional.

    Args:
        model, optimizer: already passed through ``amp.setup``.
        batches: ``batches(i)`` returns micro-batch ``i``; may expose ``samples_per_batch`` and
            ``tokens_per_batch`` for throughput figures.
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
            :data:`~ampkit.loop.trainer_config.FLAT`), each replacing one field of its group.

    An engine asked for ``"auto"`` has its choice confirmed by measurement on a CPU before the
    first step (:func:`ampkit.loop.autoselect.confirm_auto`; a resumed run keeps its checkpoint's
    precision).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        amp: MixedPrecision,
        batches: BatchFn,
        *,
        loss_fn: LossFn = batch_loss,
        scheduler: Any = None,
        callbacks: Sequence[Any] = (),
        fallback: bool = True,
        diagnose: bool = True,
        checkpoint: Optional[CheckpointConfig] = None,
        evaluation: Optional[EvalConfig] = None,
        log: Optional[LogConfig] = None,
        batching: Optional[BatchConfig] = None, spike_rollback: Any = False,
        **settings: Any,
    ) -> None:
        self.settings: TrainerSettings = group_settings(
            {"checkpoint": checkpoint, "evaluation": evaluation, "log": log, "batching": batching}, settings)
        self.model, self.optimizer, self.amp = model, optimizer, amp
        self.batches, self.loss_fn, self.spike_rollback, self.spike_guard = batches, loss_fn, spike_rollback, None
        self.micro_index = 0  # the data position: index of the next micro-batch
        self.split = 1  # micro-batches each batch is cut into (doubled after an out-of-memory error)
        self.run_id = broadcast_object(uuid.uuid4().hex[:12])  # one id for all ranks; kept across resumes
        self.notes: list[str] = []
        self.diagnose = diagnose
        self.diagnosis: Any = None
        self.scheduler = scheduler
        self.world_size, self.rank = world_size(), rank()  # > 1: rank 0 alone logs; checkpoints are sharded (DCP)
        ck = self.settings.checkpoint
        self.checkpoints: Any = None
        if ck.dir and self.world_size > 1:
            self.checkpoints = ShardedCheckpointManager(ck.dir, lambda: capture(model, optimizer),
                                                        keep_last=ck.keep_last)
        elif ck.dir:
            self.checkpoints = CheckpointManager(ck.dir, keep_last=ck.keep_last)
        self.callbacks = list(callbacks)
        check_auto_args(self.settings.batching.size, self.settings.batching.memory_budget, self.world_size)
        self.auto_batch: Any = None  # an AutoBatch once batch_size='auto' has chosen
        self.micro_batch: Optional[int] = None  # set when ampkit cuts batches (auto batch size, OOM)
        self._monitor: Optional[Monitor] = None
        if fallback and amp.config.fallback is False:
            if amp.config.skip_nonfinite:
                amp.set_fallback(True)  # on by default in the trainer (DESIGN §4); opt-in on the engine
            else:
                self.notes.append("fallback left off: it needs skip_nonfinite=True")
        self._recent = RecentBatches(2 * self.settings.log.every + 2)  # a skip's batch, for its diagnosis
        self._stop: Optional[GracefulStop] = None  # set while fit() runs
        #: printed after a graceful stop's checkpoint (``ampkit train`` puts its exact command here)
        self.resume_hint = "Resume with Trainer.resume() on the same checkpoint_dir, then fit() the remaining steps"

    def _sinks(self, steps: int) -> list[Any]:
        sinks: list[Any] = []
        if not is_main():
            return sinks  # one process prints and writes logs
        log = self.settings.log
        if log.dir:
            os.makedirs(log.dir, exist_ok=True)
            sinks.append(JSONLSink(os.path.join(log.dir, "log.jsonl")))
            if log.tensorboard:
                try:
                    sinks.append(TensorBoardSink(os.path.join(log.dir, "tb")))
                except ImportError as e:
                    self.notes.append(str(e))
        if log.progress:
            sinks.append(ConsoleSink(total_steps=self.amp.optimizer_steps + steps, console=log.console))
        return sinks

    def fit(self, steps: Optional[int] = None, *, epochs: Optional[int] = None) -> TrainSummary:
        """Run ``steps`` optimizer steps (each ``accumulation_steps`` micro-batches), or ``epochs``
        passes over the data (needs ``batches.batches_per_epoch``).

        Before the first step of a run: an engine asked for ``"auto"`` has its pick confirmed by
        measurement (CPU; :func:`~ampkit.loop.autoselect.confirm_auto`), then ``batch_size="auto"``
        chooses the micro-batch for that precision.

        **Signals.** While ``fit`` runs, SIGINT (Ctrl-C) and SIGTERM do not kill the run: the
        optimizer step in flight is finished, a checkpoint of that step is written (with a
        ``checkpoint_dir``), a ``stop`` event is logged, and :class:`TrainingInterrupted` (a
        ``KeyboardInterrupt``; ``.signal``, ``.step``, ``.checkpoint``, ``.exit_code`` 130/143) is
        raised -- ``fit`` does not return. :meth:`resume` then continues bitwise where it stopped.
        With several processes every rank stops after the same step. The handlers are installed
        for the length of ``fit`` only (main thread); the previous ones are restored."""
        steps = self._count_steps(steps, epochs)
        amp = self.amp
        if amp.optimizer_steps == 0:
            self._confirm_auto()
        if self.settings.batching.size == "auto" and self.auto_batch is None and amp.optimizer_steps == 0:
            self._choose_batch()
        accum = amp.config.accumulation_steps // self.split  # in batches of batches(i)
        watch = SkipWatch()
        monitor = self._open_monitor(steps, accum, [watch] if self.diagnose else [])
        self.model.train()
        stop = self._stop = GracefulStop(announce=is_main())
        try:
            stop.__enter__()  # SIGINT/SIGTERM handlers only while training; the user's come back in `finally`
            run, target = Steps(self.model, self.optimizer, amp, self.loss_fn), amp.optimizer_steps + steps
            SpikeGuard.for_trainer(self)  # spike_rollback: snapshots now; on_step_end may roll back
            while amp.optimizer_steps < target:  # (a rollback takes steps back)
                self._train_step(run, accum, monitor, watch, stop)
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

    def _count_steps(self, steps: Optional[int], epochs: Optional[int]) -> int:
        if (steps is None) == (epochs is None):
            raise ValueError("give exactly one of steps= and epochs=")
        if epochs is not None:
            per_epoch = getattr(self.batches, "batches_per_epoch", None)
            if per_epoch is None or epochs < 1:
                raise ValueError(f"epochs={epochs} needs epochs >= 1 and data with a batches_per_epoch attribute")
            steps = max(1, epochs * per_epoch // self.amp.config.accumulation_steps)
        assert steps is not None
        if steps < 1:
            raise ValueError(f"steps={steps} must be >= 1")
        return steps

    def _open_monitor(self, steps: int, accum: int, extra_sinks: list[Any]) -> Monitor:
        """The run's monitor; at step 0 it also logs what was chosen before it (auto precision, batch)."""
        amp = self.amp
        samples = getattr(self.batches, "samples_per_batch", None)  # per rank: throughput is for all ranks
        tokens = getattr(self.batches, "tokens_per_batch", None)
        per_step = accum * self.world_size
        monitor = Monitor(amp, self._sinks(steps) + extra_sinks, log_every=self.settings.log.every,
                          run_id=self.run_id, samples_per_step=samples * per_step if samples else None,
                          tokens_per_step=tokens * per_step if tokens else None, optimizer=self.optimizer)
        if amp.optimizer_steps == 0:
            decision = auto_decision(amp)
            if decision is not None:
                monitor.log_event("auto_precision", **decision)
            if self.auto_batch is not None:
                monitor.log_event("auto_batch", **asdict(self.auto_batch))
        self._monitor = monitor
        return monitor

    def _train_step(self, run: Steps, accum: int, monitor: Monitor, watch: SkipWatch, stop: GracefulStop) -> None:
        """One optimizer step (redone with smaller micro-batches after an out-of-memory error),
        then what follows it: scheduler, diagnosis, callbacks, evaluation, checkpoint, a stop."""
        amp = self.amp
        step = amp.optimizer_steps + 1
        while True:
            start = self.micro_index
            try:
                result = self._window(run, step, accum)
                break
            except torch.OutOfMemoryError as e:
                self.micro_index = start  # no step lost, none counted twice: redo the window
                self._rebatch(e, accum, monitor)
        if self.scheduler is not None and not result.skipped:
            # Only after optimizer steps that really happened (reading `skipped` syncs once
            # per step; only when a scheduler is given), as Accelerate does.
            self.scheduler.step()
        if watch.first is not None and self.diagnosis is None:
            self.diagnosis = self._recent.diagnose(*watch.first, self.amp, self.model, self.loss_fn)
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
            with open(os.path.join(log_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
        result = TrainSummary.from_run(self.amp.stats(), summary, monitor.records, monitor.events, log_dir=log_dir,
                                       run_id=self.run_id, world_size=self.world_size, micro_batch=self.micro_batch,
                                       notes=list(self.notes))
        self._call("on_train_end", result)
        return result

    def _confirm_auto(self) -> None:
        """``auto`` settled by measurement before the first step (a no-op for other precisions,
        off the CPU, with several processes, and once decided: the CLI may have done it already)."""
        if auto_decision(self.amp) is not None:
            return
        console = self.settings.log.console if is_main() else None
        choice = confirm_auto(self.amp, self.model, self.batches, loss_fn=self.loss_fn,
                              announce=console.print if console is not None else None)
        if auto_decision(self.amp) is not None:
            self.notes.append(f"precision auto: {choice.reason}")
            if console is not None:
                console.print(f"precision auto: {choice.reason}")

    def _checkpoint(self, monitor: Monitor) -> str:
        t0 = time.perf_counter()
        path = self.save_checkpoint()
        monitor.log_event("checkpoint", path=path, seconds=time.perf_counter() - t0)
        self._call("on_checkpoint", path)
        return path

    def _stop_now(self, signum: int, saved: Optional[str], monitor: Monitor) -> None:
        """After a signal: checkpoint this step (unless just done), record a ``stop`` event, raise."""
        path = saved
        if path is None and self.checkpoints is not None:
            path = self._checkpoint(monitor)
        monitor.log_event("stop", signal=signal_name(signum), checkpoint=path)
        stop = TrainingInterrupted(signum, self.amp.optimizer_steps, path)
        if is_main():
            hint = f". {self.resume_hint}" if path and self.resume_hint else ""
            print(f"ampkit: {stop}{hint}", file=sys.stderr, flush=True)
        raise stop

    def request_stop(self) -> None:
        """Stop ``fit`` after the optimizer step in flight, as SIGTERM would (checkpoint, then
        :class:`TrainingInterrupted`); e.g. from a callback. No effect outside ``fit``."""
        if self._stop is not None:
            self._stop.request()

    def _window(self, run: Steps, step: int, accum: int) -> Any:
        """One optimizer step: ``accum`` batches, each cut into ``self.split`` micro-batches."""
        def remember(k: int, batch: Any) -> None:
            self.micro_index += 1
            if k == 0 and self.diagnose and self.diagnosis is None:
                self._recent.remember(step, batch)

        # Ranks interleave over the batch indices: rank r of W reads i*W + r (one process: i).
        return run.optimizer_step(self.batches, self.micro_index, count=accum, split=self.split,
                                  index=lambda i: i * self.world_size + self.rank, on_batch=remember).result

    def _choose_batch(self) -> None:
        """``batch_size='auto'``: cut each batch into the fewest micro-batches that fit (see ``autobatch``)."""
        budget = device_budget(self.amp.device, self.settings.batching.memory_budget)
        choice = choose_split(self.model, self.optimizer, self.amp.precision.name, self.amp.device,
                              self.batches(0), budget)
        accum = self.amp.config.accumulation_steps // self.split
        self.split = choice.split
        self.amp.set_accumulation_steps(accum * choice.split)
        self.auto_batch, self.micro_batch = choice, choice.micro_batch
        self.notes.append(choice.reason)
        console = self.settings.log.console
        if console is not None and is_main():
            console.print(f"batch_size auto: {choice.reason}")

    def _rebatch(self, error: BaseException, accum: int, monitor: Monitor) -> None:
        """After an out-of-memory error: free the window, halve the micro-batch, double the
        accumulation (same effective batch, same gradient math), record ``oom_rebatch``."""
        self.amp.discard_window()
        if self.amp.device.type == "cuda":
            torch.cuda.empty_cache()
        batch = self.batches(self.micro_index)
        size = batch_size(batch) // self.split
        if size < 2:
            raise RuntimeError(f"out of memory even with a micro-batch of {size}: nothing left to split "
                               f"({str(error).splitlines()[0][:200]})") from error
        self.split *= 2
        self.micro_batch = size // 2
        self.amp.set_accumulation_steps(accum * self.split)
        monitor.log_event("oom_rebatch", micro_batch=batch_size(batch) // self.split,
                          accumulation_steps=accum * self.split, error=str(error).splitlines()[0][:200])
        self.notes.append(f"out of memory at step {self.amp.optimizer_steps + 1}: micro-batch halved to "
                          f"{batch_size(batch) // self.split}, accumulation doubled to {accum * self.split}")

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is not None:
                fn(self, *args)

    def evaluate(self) -> float:
        """Mean loss over ``eval_steps`` held-out batches, in the training precision or fp32
        (``eval_precision``), without gradients; logged as an ``eval`` event. **Syncs** once."""
        ev = self.settings.evaluation
        if ev.batches is None:
            raise RuntimeError("no eval_batches were given to the Trainer")
        was_training = self.model.training
        self.model.eval()
        losses = []
        ctx = self.amp.autocast if ev.precision == "train" else self.amp.disabled
        with torch.no_grad():
            for i in range(ev.steps):
                with ctx():
                    losses.append(self.loss_fn(self.model, ev.batches(i)).detach().float())
        self.model.train(was_training)
        value = float(torch.stack(losses).mean())
        if self._monitor is not None:
            self._monitor.log_event("eval", loss=value, precision=self.amp.precision.name
                                    if ev.precision == "train" else "fp32", batches=ev.steps)
        self._call("on_eval", value)
        return value

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The whole training state: model, optimizer, scheduler, engine (precision after fallbacks,
        scaler, counters, events), RNG states and the data position. **Syncs**."""
        return {
            **dict(zip(("model", "optimizer"), capture(self.model, self.optimizer))),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "amp": self.amp.state_dict(),
            "rng": capture_rng(),
            "data": {"micro_index": self.micro_index, "split": self.split},
            "run": {"id": self.run_id},
        }

    def load_state_dict(self, state: dict[str, Any], source: str = "checkpoint") -> None:
        """Restore :meth:`state_dict`. Everything is checked before anything is loaded: the keys,
        the model's keys and shapes, the optimizer's parameter groups and the engine state; on a
        mismatch nothing changes and :class:`~ampkit.loop.checkpoint.CheckpointError` says what."""
        check_state(state, capture(self.model, self.optimizer)[0], self.optimizer, source)
        restore(self.model, self.optimizer, state["model"], state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.amp.load_state_dict(state["amp"])
        restore_rng(state.get("rng", {}))
        self.micro_index = int(state.get("data", {}).get("micro_index", 0))
        self.split = int(state.get("data", {}).get("split", 1))
        self.run_id = str(state.get("run", {}).get("id", self.run_id))
        self.diagnosis = saved_diagnosis(state["amp"].get("events", [])) or self.diagnosis  # once per run

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
