"""A small training loop composed from the engine: what ``ampkit train`` runs.

Reads top to bottom: take batch ``i``, forward under ``amp.autocast()``, ``amp.backward``,
``amp.step``; a :class:`~ampkit.observe.monitor.Monitor` records every optimizer step and reads the
device only every ``log_every`` steps, so the loop adds no per-step host sync of its own.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Callable, Optional, Union

import torch

from ..distributed import broadcast_object, is_main, rank, world_size
from ..distributed.states import capture, restore
from ..observe.monitor import ConsoleSink, JSONLSink, Monitor, TensorBoardSink
from ..step.engine import MixedPrecision
from .autobatch import check_auto_args, choose_split, device_budget
from .checkpoint import (
    CheckpointManager,
    ShardedCheckpointManager,
    capture_rng,
    check_state,
    restore_rng,
)
from .data import batch_size, split_batch
from .firstskip import SkipWatch, saved_diagnosis
from .stop import GracefulStop, TrainingInterrupted, signal_name
from .summary import TrainSummary

__all__ = ["TrainSummary", "Trainer", "TrainingInterrupted"]

BatchFn = Callable[[int], Any]


def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``model(*batch)``: built-in models (and factories' models) return their loss from the batch."""
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


class Trainer:
    """Train ``model`` with ``amp`` on ``batches`` (a function from batch index to batch).

    Args:
        model, optimizer: already passed through ``amp.setup``.
        batches: ``batches(i)`` returns micro-batch ``i``; may expose ``samples_per_batch`` and
            ``tokens_per_batch`` for throughput figures.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``; default ``model(x, y)``.
        log_every: read metrics to the host every this many optimizer steps (the only syncs).
        progress: show a rich progress bar with live loss, scale and throughput, then a summary table.
        log_dir: write the run there: ``log.jsonl``, TensorBoard events under ``tb/`` (when
            tensorboard is installed), ``summary.json``.
        scheduler: a learning-rate scheduler, stepped after every optimizer step that was not skipped.
        checkpoint_dir, checkpoint_every, keep_last: crash-safe checkpoints (see ``ampkit.loop.checkpoint``).
        eval_batches, eval_every, eval_steps, eval_precision: periodic evaluation on held-out
            batches, in the training precision (``"train"``) or strict ``"fp32"``.
        callbacks: objects with any of ``on_step_end(trainer, step, result)``,
            ``on_eval(trainer, loss)``, ``on_checkpoint(trainer, path)``, ``on_train_end(trainer, summary)``.
        fallback: turn on the engine's default fallback chain if it is off (``False`` leaves the
            engine as configured).
        diagnose: on the first skipped step of the run, re-run that step's batch with
            :meth:`MixedPrecision.diagnose` and record which module produced the inf/NaN (the
            skip is learnt from the monitor's batched reads, so this adds no per-step sync).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        amp: MixedPrecision,
        batches: BatchFn,
        *,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = _default_loss,
        log_every: int = 10,
        progress: bool = True,
        log_dir: Optional[str] = None,
        tensorboard: bool = True,
        console: Any = None,
        diagnose: bool = True,
        scheduler: Any = None,
        checkpoint_dir: Optional[str] = None,
        checkpoint_every: Optional[int] = None,
        keep_last: Optional[int] = 3,
        eval_batches: Optional[BatchFn] = None,
        eval_every: Optional[int] = None,
        eval_steps: int = 4,
        eval_precision: str = "train",
        callbacks: Sequence[Any] = (),
        fallback: bool = True,
        batch_size: Optional[str] = None,
        memory_budget: Union[str, int, None] = None,
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every={log_every} must be >= 1")
        self.model, self.optimizer, self.amp = model, optimizer, amp
        self.batches, self.loss_fn = batches, loss_fn
        self.log_every, self.progress = log_every, progress
        self.log_dir, self.tensorboard, self.console = log_dir, tensorboard, console
        self.micro_index = 0  # the data position: index of the next micro-batch
        self.split = 1  # micro-batches each batch is cut into (doubled after an out-of-memory error)
        self.run_id = broadcast_object(uuid.uuid4().hex[:12])  # one id for all ranks; kept across resumes
        self.notes: list[str] = []
        self.diagnose = diagnose
        self.diagnosis: Any = None
        self.scheduler = scheduler
        if checkpoint_every is not None and checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={checkpoint_every} must be >= 1")
        if checkpoint_every and not checkpoint_dir:
            raise ValueError("checkpoint_every needs a checkpoint_dir")
        self.world_size, self.rank = world_size(), rank()  # > 1: rank 0 alone logs; checkpoints are sharded (DCP)
        self.checkpoints: Any = None
        if checkpoint_dir and self.world_size > 1:
            self.checkpoints = ShardedCheckpointManager(checkpoint_dir, lambda: capture(model, optimizer),
                                                        keep_last=keep_last)
        elif checkpoint_dir:
            self.checkpoints = CheckpointManager(checkpoint_dir, keep_last=keep_last)
        self.checkpoint_every = checkpoint_every
        if eval_precision not in ("train", "fp32"):
            raise ValueError(f"eval_precision={eval_precision!r}; choose 'train' (the training precision) or 'fp32'")
        if eval_every is not None and (eval_every < 1 or eval_batches is None):
            raise ValueError("eval_every must be >= 1 and needs eval_batches")
        self.eval_batches, self.eval_every, self.eval_steps = eval_batches, eval_every, eval_steps
        self.eval_precision = eval_precision
        self.callbacks = list(callbacks)
        check_auto_args(batch_size, memory_budget, self.world_size)
        self.auto_batch: Any = None  # an AutoBatch once batch_size='auto' has chosen
        self.micro_batch: Optional[int] = None  # set when ampkit cuts batches (auto batch size, OOM)
        self._auto = (batch_size == "auto", memory_budget)
        self._monitor: Optional[Monitor] = None
        if fallback and amp.config.fallback is False:
            if amp.config.skip_nonfinite:
                amp.set_fallback(True)  # on by default in the trainer (DESIGN §4); opt-in on the engine
            else:
                self.notes.append("fallback left off: it needs skip_nonfinite=True")
        self._recent: dict[int, Any] = {}  # optimizer step -> its first micro-batch (for diagnosis)
        self._stop: Optional[GracefulStop] = None  # set while fit() runs
        #: printed after a graceful stop's checkpoint (``ampkit train`` puts its exact command here)
        self.resume_hint = "Resume with Trainer.resume() on the same checkpoint_dir, then fit() the remaining steps"

    def _sinks(self, steps: int) -> list[Any]:
        sinks: list[Any] = []
        if not is_main():
            return sinks  # one process prints and writes logs
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            sinks.append(JSONLSink(os.path.join(self.log_dir, "log.jsonl")))
            if self.tensorboard:
                try:
                    sinks.append(TensorBoardSink(os.path.join(self.log_dir, "tb")))
                except ImportError as e:
                    self.notes.append(str(e))
        if self.progress:
            sinks.append(ConsoleSink(total_steps=self.amp.optimizer_steps + steps, console=self.console))
        return sinks

    def fit(self, steps: Optional[int] = None, *, epochs: Optional[int] = None) -> TrainSummary:
        """Run ``steps`` optimizer steps (each ``accumulation_steps`` micro-batches), or ``epochs``
        passes over the data (needs ``batches.batches_per_epoch``).

        **Signals.** While ``fit`` runs, SIGINT (Ctrl-C) and SIGTERM do not kill the run: the
        optimizer step in flight is finished, a checkpoint of that step is written (with a
        ``checkpoint_dir``), a ``stop`` event is logged, and :class:`TrainingInterrupted` (a
        ``KeyboardInterrupt``; ``.signal``, ``.step``, ``.checkpoint``, ``.exit_code`` 130/143) is
        raised -- ``fit`` does not return. :meth:`resume` then continues bitwise where it stopped.
        With several processes every rank stops after the same step. The handlers are installed
        for the length of ``fit`` only (main thread); the previous ones are restored."""
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
        amp = self.amp
        if self._auto[0] and self.auto_batch is None and amp.optimizer_steps == 0:
            self._choose_batch()
        accum = amp.config.accumulation_steps // self.split  # in batches of batches(i)
        samples = getattr(self.batches, "samples_per_batch", None)  # per rank: throughput is for all ranks
        tokens = getattr(self.batches, "tokens_per_batch", None)
        accum *= self.world_size
        watch = SkipWatch()
        sinks = self._sinks(steps) + ([watch] if self.diagnose else [])
        monitor = Monitor(amp, sinks, log_every=self.log_every, run_id=self.run_id,
                          samples_per_step=samples * accum if samples else None,
                          tokens_per_step=tokens * accum if tokens else None, optimizer=self.optimizer)
        accum //= self.world_size
        if self.auto_batch is not None and amp.optimizer_steps == 0:
            monitor.log_event("auto_batch", **asdict(self.auto_batch))
        self.model.train()
        self._monitor = monitor
        stop = self._stop = GracefulStop(announce=is_main())
        try:
            stop.__enter__()  # SIGINT/SIGTERM handlers only while training; the user's come back in `finally`
            for _ in range(steps):
                step = amp.optimizer_steps + 1
                while True:
                    start = self.micro_index
                    try:
                        result = self._window(step, accum)
                        break
                    except torch.OutOfMemoryError as e:
                        self.micro_index = start  # no step lost, none counted twice: redo the window
                        self._rebatch(e, accum, monitor)
                if self.scheduler is not None and not result.skipped:
                    # Only after optimizer steps that really happened (reading `skipped` syncs once
                    # per step; only when a scheduler is given), as Accelerate does.
                    self.scheduler.step()
                if watch.first is not None and self.diagnosis is None:
                    self._diagnose(*watch.first)
                self._call("on_step_end", amp.optimizer_steps, result)
                if self.eval_every and amp.optimizer_steps % self.eval_every == 0:
                    self.evaluate()
                saved = None
                if self.checkpoint_every and amp.optimizer_steps % self.checkpoint_every == 0:
                    saved = self._checkpoint(monitor)
                signum = stop.poll(amp.device)  # every rank: the same answer after the same step
                if signum:
                    self._stop_now(signum, saved, monitor)
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
        summary = monitor.close()
        self._monitor = None
        if self.log_dir and is_main():
            with open(os.path.join(self.log_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
        stats = amp.stats()
        losses = [r["loss"] for r in monitor.records]
        ms = summary["step_time_ms_median"] or 0.0
        result = TrainSummary(
            precision=stats["precision"], device=stats["device"], optimizer_steps=stats["optimizer_steps"],
            skipped_steps=stats["skipped_steps"], final_loss=_f(losses[-1]), first_loss=_f(losses[0]),
            ms_per_step=ms, samples_per_s=summary["samples_per_s"] or 0.0, tokens_per_s=summary["tokens_per_s"],
            final_scale=stats["scale"], losses=[_f(v) for v in losses], log_dir=self.log_dir,
            peak_mem_bytes=summary["peak_mem_bytes"], run_id=self.run_id,
            eval_losses=[(e["step"], e["loss"]) for e in monitor.events if e.get("kind") == "eval"],
            world_size=self.world_size, micro_batch=self.micro_batch, notes=list(self.notes),
        )
        self._call("on_train_end", result)
        return result


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

    def _window(self, step: int, accum: int) -> Any:
        """One optimizer step: ``accum`` batches, each cut into ``self.split`` micro-batches."""
        amp = self.amp
        result = None
        for k in range(accum):
            # Ranks interleave over the batch indices: rank r of W reads i*W + r (one process: i).
            batch = self.batches(self.micro_index * self.world_size + self.rank)
            self.micro_index += 1
            if k == 0 and self.diagnose and self.diagnosis is None:
                self._recent[step] = batch
                self._recent.pop(step - 2 * self.log_every - 2, None)
            for piece in split_batch(batch, self.split):
                with amp.autocast():
                    loss = self.loss_fn(self.model, piece)
                amp.backward(loss)
                result = amp.step(self.optimizer)
        return result

    def _choose_batch(self) -> None:
        """``batch_size='auto'``: cut each batch into the fewest micro-batches that fit (see ``autobatch``)."""
        budget = device_budget(self.amp.device, self._auto[1])
        choice = choose_split(self.model, self.optimizer, self.amp.precision.name, self.amp.device,
                              self.batches(0), budget)
        accum = self.amp.config.accumulation_steps // self.split
        self.split = choice.split
        self.amp.set_accumulation_steps(accum * choice.split)
        self.auto_batch, self.micro_batch = choice, choice.micro_batch
        self.notes.append(choice.reason)
        if self.console is not None and is_main():
            self.console.print(f"batch_size auto: {choice.reason}")

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
        if self.eval_batches is None:
            raise RuntimeError("no eval_batches were given to the Trainer")
        was_training = self.model.training
        self.model.eval()
        losses = []
        ctx = self.amp.autocast if self.eval_precision == "train" else self.amp.disabled
        with torch.no_grad():
            for i in range(self.eval_steps):
                with ctx():
                    losses.append(self.loss_fn(self.model, self.eval_batches(i)).detach().float())
        self.model.train(was_training)
        value = float(torch.stack(losses).mean())
        if self._monitor is not None:
            self._monitor.log_event("eval", loss=value, precision=self.amp.precision.name
                                    if self.eval_precision == "train" else "fp32", batches=self.eval_steps)
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

    def _diagnose(self, step: int, scale: Optional[float]) -> None:
        batch = self._recent.get(step)
        self._recent.clear()
        if batch is None:
            self.diagnosis = False
            return

        def closure() -> torch.Tensor:
            with self.amp.autocast():
                return self.loss_fn(self.model, batch)

        was_training = self.model.training
        self.diagnosis = self.amp.diagnose(closure, scale=scale)
        self.model.train(was_training)


def _f(v: Optional[float]) -> float:
    return math.nan if v is None else float(v)

