"""Where the Trainer's batches come from, epoch by epoch, with a position a checkpoint can resume.

Two kinds of data are accepted:

- a **function of the index** (``batches(i) -> batch``, ampkit's built-in data): the position is
  the next index; with several processes rank ``r`` of ``W`` reads ``i * W + r``; an epoch is
  ``batches.batches_per_epoch`` indices when the function says so;
- **any iterable of batches**: a ``DataLoader``, a list, a re-iterable object, or a factory (a
  function of no argument returning a fresh iterator, e.g. a generator function). Each epoch is one
  pass, ``iter(batches)`` anew (a one-shot generator gives one epoch only). Before each pass the
  sampler's ``set_epoch(epoch)`` is called (``DistributedSampler``; each rank iterates its own
  loader). An epoch with a ``len()`` is that many batches; without one it ends at ``StopIteration``.

**Resuming inside an epoch.** At the start of each pass the source keeps the random states
``iter()`` draws from (the loader's and sampler's ``torch.Generator`` and the global CPU
generator); the checkpoint holds them with the epoch and the batches already taken. On resume the
pass is re-created from those states and the taken batches are read and skipped (they are loaded,
not trained on), then the global generator is put back to the checkpoint's: the resumed run sees
the same batches in the same order as the uninterrupted one. A checkpoint between passes (at an
epoch's last step) holds the loader's and sampler's generators as that pass left them: the next
pass draws its order from them.
"""

from __future__ import annotations

import inspect
import os
from collections import deque
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from ..models.data import batch_size

__all__ = ["BatchSource", "IndexedBatches", "check_batches", "held_out"]


def _is_index_function(batches: Any) -> bool:
    """True for ``batches(i)``; False for a factory of no argument (and for non-callables)."""
    if not callable(batches) or hasattr(batches, "__iter__"):
        return False
    try:
        params = inspect.signature(batches).parameters.values()
    except (TypeError, ValueError):
        return True  # a builtin we cannot inspect: today's contract, a function of the index
    required = [
        p
        for p in params
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return bool(required) or any(p.kind is p.VAR_POSITIONAL for p in params)


def check_batches(batches: Any, what: str = "batches", *, reiterable: bool = False) -> None:
    """Raise ``TypeError`` unless ``batches`` is data the Trainer takes (see the module docstring);
    ``reiterable``: a one-shot iterator (a generator object), which gives one pass only, is refused too.
    ``what`` names the argument in the message (``"eval_batches"``)."""
    if not callable(batches) and not hasattr(batches, "__iter__"):
        raise TypeError(
            f"{what}={type(batches).__name__!r} is neither a function of the batch index, "
            "an iterable of batches (a DataLoader, a list) nor a function returning an "
            "iterator"
        )
    if reiterable and hasattr(batches, "__iter__") and iter(batches) is batches:
        raise TypeError(
            f"{what} is a one-shot iterator ({type(batches).__name__}), which can be read "
            "only once: pass a list, a DataLoader or a function returning a fresh iterator"
        )


def held_out(batches: Any, count: int) -> tuple[Callable[[int], Any], int]:
    """``(batch_of, n)``: evaluation's batches, ``batch_of(0 .. n-1)``. A function of the index is
    itself, ``n = count``; an iterable gives the first ``count`` batches of a fresh pass (``n`` is
    fewer when it has fewer), read at each call, the random states left as they were (an
    evaluation does not change what training draws next). ``RuntimeError`` when ``batches`` is None."""
    if batches is None:
        raise RuntimeError("no eval_batches were given to the Trainer")
    source = BatchSource(batches)
    if source.indexed:
        return batches, count
    first = source.sample(count)
    if not first:
        raise ValueError("the evaluation data yielded no batches")
    return first.__getitem__, len(first)


class IndexedBatches:
    """Batch ``i`` of any data the Trainer takes, for code that reads ``batches(i)`` (``compare``).

    An iterable is read in order, pass after pass as the Trainer walks its epochs (``set_epoch``
    included), and every batch read is kept so that several runs read the same batches: memory
    grows with the number of batches read. ``batch_size``, ``samples_per_batch`` (else counted
    from the first batch) and ``tokens_per_batch`` are the data's.
    """

    def __init__(self, batches: Any) -> None:
        check_batches(batches)
        self.source = BatchSource(batches)
        self._read: list[Any] = []
        self.batch_size = getattr(batches, "batch_size", None)
        self.tokens_per_batch = getattr(batches, "tokens_per_batch", None)
        n = getattr(batches, "samples_per_batch", None)
        self.samples_per_batch = n if n is not None else BatchSource.samples_in(self(0))

    def __call__(self, i: int) -> Any:
        while len(self._read) <= i:
            self._read.append(self.source.next())
        return self._read[i]

    @staticmethod
    def of(batches: Any) -> Callable[[int], Any]:
        """``batches`` itself when it is a function of the index, else an :class:`IndexedBatches`."""
        return batches if _is_index_function(batches) else IndexedBatches(batches)


def _generators(batches: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a pass over ``batches`` may draw from (loader, sampler)."""
    found: dict[int, torch.Generator] = {}
    holders = [batches, getattr(batches, "sampler", None), getattr(batches, "batch_sampler", None)]
    holders.append(getattr(holders[2], "sampler", None))
    for h in holders:
        g = getattr(h, "generator", None)
        if isinstance(g, torch.Generator) and g.device.type == "cpu":
            found.setdefault(id(g), g)
    return list(found.values())


def _epoch_setters(batches: Any) -> list[Any]:
    """Objects with ``set_epoch`` (the iterable, its sampler, its batch sampler's sampler), once each."""
    found: dict[int, Any] = {}
    batch_sampler = getattr(batches, "batch_sampler", None)
    for h in (
        batches,
        getattr(batches, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ):
        if h is not None and callable(getattr(h, "set_epoch", None)):
            found.setdefault(id(h), h)
    return list(found.values())


class BatchSource:
    """The Trainer's batches in order, with the epoch, the position inside it, and throughput counts.

    ``next()`` returns the next batch; ``window(n)`` says how many batches the next optimizer step
    takes (``n``, or fewer for the last, short window of an epoch of an iterable);
    ``take_finished()`` the epochs completed since the last call. ``state_dict()`` is the position.
    """

    def __init__(self, batches: Any, *, rank: int = 0, world_size: int = 1) -> None:
        self.batches = batches
        check_batches(batches)
        self.indexed = _is_index_function(batches)
        self.rank, self.world_size = rank, world_size
        self.micro_index = 0  # batches taken in all (this rank)
        self.epoch = 0  # epochs completed
        self.in_epoch = 0  # batches taken in the current epoch
        self._iter: Optional[Iterator[Any]] = None
        self._ahead: deque[Any] = deque()  # batches read ahead to find an epoch's end (no len())
        self._exhausted = False
        self._finished: list[int] = []
        self._epoch_rng: Optional[dict[str, Any]] = None  # random states at the start of this pass
        self._resume_rng: Optional[dict[str, Any]] = (
            None  # set by load_state_dict until the pass reopens
        )
        self._one_shot_used = False
        #: the data state the last :meth:`load_state_dict` restored (what the checkpoint recorded)
        self.checkpoint_state: dict[str, Any] = {}

    # ------------------------------------------------------------------ shape of an epoch
    @property
    def per_epoch(self) -> Optional[int]:
        """Batches per epoch (per rank): ``batches_per_epoch`` of a function, ``len()`` of an
        iterable, None when unknown (an epoch then ends at ``StopIteration``)."""
        if self.indexed or callable(self.batches) and not hasattr(self.batches, "__iter__"):
            n = getattr(self.batches, "batches_per_epoch", None)
            return int(n) if n is not None else None
        try:
            return len(self.batches)
        except TypeError:
            return None

    @property
    def batch_epoch(self) -> int:
        """The epoch (from 0) of the last batch taken (a function of the index moves on at once)."""
        per = self.per_epoch
        if self.indexed and per and self.micro_index:
            return (self.micro_index - 1) // per
        return self.epoch

    @property
    def samples_per_batch(self) -> Optional[int]:
        n = getattr(self.batches, "samples_per_batch", None)
        return int(n) if n is not None else None

    @property
    def declared_batch_size(self) -> Optional[int]:
        """Samples per batch as the data declares it (``samples_per_batch``, a ``DataLoader``'s
        ``batch_size``), None when it does not: what a checkpoint records, so that a resume with
        batches of another size is told apart (reads no batch)."""
        n = self.samples_per_batch
        if n is None and not self.indexed:
            n = getattr(self.batches, "batch_size", None)
        return n if isinstance(n, int) and not isinstance(n, bool) else None

    def check_resume(self, saved: dict[str, Any], source: str) -> None:
        """Refuse a checkpoint's data state (``saved``, from a run's ``state_dict``) that this data
        cannot go on from as the same run, with :class:`~ampkit.loop.checkpoint.CheckpointMismatch`
        naming both values: another declared batch size, another number of tokens a sample (both
        change what batch ``i`` holds and the effective batch), another number of processes (each
        reads its own share of the data). A value the checkpoint does not hold (written before
        ampkit recorded it) or this data does not declare is not compared."""
        from .checkpoint import CheckpointMismatch

        size, now = saved.get("batch_size"), self.declared_batch_size
        if isinstance(size, int) and now is not None and size != now:
            raise CheckpointMismatch(
                f"{source}: its run read batches of {size} samples, this data's are {now}: the "
                "data position would name other samples and the effective batch would change; "
                f"resume with batches of {size} (ampkit train: --batch_size {size}) or start a "
                "new run"
            )
        tokens, mine = saved.get("tokens_per_batch"), self.tokens_per_batch
        if isinstance(tokens, int) and mine is not None and tokens != mine:
            if now:  # the same batch size: the samples' length changed
                length = tokens // now
                said = (
                    f"samples of {length} tokens, this data's are {mine // now} ({now} samples "
                    "a batch)"
                )
                hint = f"samples of {length} tokens (ampkit train: --block_size {length})"
            else:
                said = f"batches of {tokens} tokens, this data's are {mine}"
                hint = f"batches of {tokens} tokens"
            raise CheckpointMismatch(
                f"{source}: its run read {said}: batch i would hold other text, an epoch another "
                f"number of batches and a step another number of tokens; resume with {hint} or "
                "start a new run"
            )
        world = saved.get("world_size")
        if isinstance(world, int) and world != self.world_size:
            raise CheckpointMismatch(
                f"{source}: its run had {world} processes, this one has {self.world_size}: each "
                "process reads its own share of the data (rank r of W the batches i * W + r, or "
                "its DistributedSampler's), so batches would be skipped or read twice, the "
                "effective batch would change and a process without a saved random state would "
                f"start a fresh one; resume with {world} processes (ampkit train: --nproc_per_node "
                f"{world}) or start a new run"
            )

    @property
    def tokens_per_batch(self) -> Optional[int]:
        n = getattr(self.batches, "tokens_per_batch", None)
        return int(n) if n is not None else None

    @property
    def data_file(self) -> tuple[bool, Optional[str]]:
        """``(declared, path)``: whether the data says which file it reads (a ``path`` attribute,
        as ampkit's text data has) and that file, absolute (None: the built-in corpus)."""
        if not hasattr(self.batches, "path"):
            return False, None
        path = self.batches.path
        if not isinstance(path, (str, os.PathLike)):
            return True, None
        return True, os.path.abspath(os.fspath(path))

    def file_change(self) -> Optional[tuple[Optional[str], Optional[str]]]:
        """``(the checkpoint's, this data's)`` file when the last :meth:`load_state_dict` restored a
        run that read another one (both declared; None is the built-in corpus), else None."""
        declared, now = self.data_file
        saved = self.checkpoint_state
        if not declared or "data_file" not in saved or saved["data_file"] == now:
            return None
        return saved["data_file"], now

    def window(self, count: int) -> int:
        """Batches the next optimizer step takes: ``count``, or what is left of an iterable's epoch
        when fewer (that short window is stepped on its own, as ``amp.set_window`` makes exact)."""
        if self.indexed:
            return count
        self._close_if_done()
        per = self.per_epoch
        if per is not None:
            return min(count, per - self.in_epoch)
        self._fill(count)
        return min(count, len(self._ahead)) if self._exhausted else count

    # ------------------------------------------------------------------ reading
    def next(self) -> Any:
        """The next batch (an iterable: opening the next pass when this one is done)."""
        if self.indexed:
            batch = self.batches(self.micro_index * self.world_size + self.rank)
            self.micro_index += 1
            per = self.per_epoch
            if per and self.micro_index // per > self.epoch:
                self._finished.append(self.epoch)
                self.epoch += 1
            self.in_epoch = self.micro_index - self.epoch * per if per else self.micro_index
            return batch
        self._close_if_done()
        self._fill(1)
        if not self._ahead:
            self._close_if_done()
            self._fill(1)
        if not self._ahead:
            raise ValueError(
                f"the data yielded no batches in epoch {self.epoch} (an empty loader, or a one-shot "
                "generator already used up: pass a list, a DataLoader or a function returning a fresh "
                "iterator)"
            )
        self.in_epoch += 1
        self.micro_index += 1
        return self._ahead.popleft()

    def _fill(self, n: int) -> None:
        """Read ahead until ``n`` batches are waiting or the pass is done."""
        if self._iter is None:
            self._open()
        while len(self._ahead) < n and not self._exhausted:
            try:
                self._ahead.append(next(self._iter))  # type: ignore[arg-type]
            except StopIteration:
                self._exhausted = True

    def _epoch_done(self) -> bool:
        """All of the current epoch was taken: its length reached, or its pass ran dry."""
        if self.in_epoch == 0:
            return False
        per = self.per_epoch
        if per is not None and self.in_epoch >= per:
            return True
        if per is None and not self._ahead:
            self._fill(
                1
            )  # an epoch of unknown length: look one batch ahead to learn whether it ended
        return self._exhausted and not self._ahead

    def _close_if_done(self) -> None:
        if self._epoch_done():
            self._finished.append(self.epoch)
            self.epoch += 1
            self.in_epoch = 0
            self._iter, self._exhausted, self._resume_rng = None, False, None
            self._ahead.clear()

    def take_finished(self) -> list[int]:
        """The epochs completed since the last call (learnt after a step, before the next one reads)."""
        if not self.indexed:
            self._close_if_done()
        out, self._finished = self._finished, []
        return out

    def _open(self) -> None:
        """Start pass ``self.epoch``: ``set_epoch``, remember the random states, ``iter()``; on
        resume, from the saved states, skipping the batches already trained on."""
        for s in _epoch_setters(self.batches):
            s.set_epoch(self.epoch)
        gens = _generators(self.batches)
        resume, self._resume_rng = self._resume_rng, None
        now = torch.get_rng_state() if resume is not None else None
        if resume is not None:
            torch.set_rng_state(resume["cpu"])
            for g, state in zip(gens, resume.get("generators", [])):
                g.set_state(state)
        self._epoch_rng = {
            "cpu": torch.get_rng_state(),
            "generators": [g.get_state() for g in gens],
        }
        self._iter = self._make_iter()
        skip = self.in_epoch if resume is not None else 0
        for k in range(skip):
            try:
                next(self._iter)
            except StopIteration:
                raise ValueError(
                    f"resuming epoch {self.epoch} at batch {skip}: the data now has only {k} batches "
                    "in this epoch (was it changed since the checkpoint?)"
                ) from None
        if now is not None:
            torch.set_rng_state(
                now
            )  # the checkpoint's global state, as the uninterrupted run had it here

    def _make_iter(self) -> Iterator[Any]:
        b = self.batches
        if hasattr(b, "__iter__"):
            it = iter(b)
            if it is b:  # a generator or other one-shot iterator: one pass only
                if self._one_shot_used and self.in_epoch == 0:
                    return iter(())
                self._one_shot_used = True
            return it
        return iter(b())

    def sample(self, count: int = 1) -> list[Any]:
        """The first ``count`` batches of a fresh pass (for measuring before training), leaving
        every random state and the position as they were. A one-shot iterator cannot be sampled."""
        if self.indexed:
            return [self.batches(i) for i in range(count)]
        if hasattr(self.batches, "__iter__") and iter(self.batches) is self.batches:
            raise ValueError(
                "cannot measure on a one-shot generator: pass a list, a DataLoader or a function "
                "returning a fresh iterator"
            )
        gens = _generators(self.batches)
        saved = torch.get_rng_state(), [g.get_state() for g in gens]
        try:
            it = self._make_iter()
            return [batch for _, batch in zip(range(count), it)]
        finally:
            torch.set_rng_state(saved[0])
            for g, state in zip(gens, saved[1]):
                g.set_state(state)

    def as_function(self, count: int = 8) -> Callable[[int], Any]:
        """A function of the index for code that measures on ``batches(i)``: the data itself, or
        the first ``count`` batches of a pass, cycled."""
        if self.indexed:
            return self.batches  # type: ignore[no-any-return]
        first = self.sample(count)
        if not first:
            raise ValueError("the data yielded no batches")
        fn = lambda i: first[i % len(first)]  # noqa: E731
        return fn

    @staticmethod
    def samples_in(batch: Any) -> Optional[int]:
        """Samples in ``batch`` (the first dimension of its first tensor), None when it has none."""
        try:
            return batch_size(batch)
        except TypeError:
            return None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The position (batches taken, the epoch and the batches taken in it) and what
        :meth:`check_resume` compares: the processes reading and the data's tokens per batch; the
        file the data reads when it says (``data_file``, see :meth:`file_change`)."""
        return {
            "micro_index": self.micro_index,
            "epoch": self.epoch,
            "in_epoch": self.in_epoch,
            "world_size": self.world_size,
            "tokens_per_batch": self.tokens_per_batch,
            **({"data_file": self.data_file[1]} if self.data_file[0] else {}),
        }

    def rng_state(self) -> dict[str, Any]:
        """The data's random states, saved with each rank's own RNG (ranks differ): in the middle
        of an iterable's pass ``{"data_pass": ...}``, the states the pass started from; between
        passes (an epoch's end) ``{"data_next": ...}``, the data's own generators as the next pass
        will find them (the global generator's is the checkpoint's own); ``{}`` for a function of
        the index, or an iterable with no generator of its own between passes."""
        if self.indexed:
            return {}
        rng = self._epoch_rng if self._iter is not None else None
        if rng:
            return {"data_pass": {"cpu": rng["cpu"], "generators": list(rng["generators"])}}
        gens = _generators(self.batches)
        return {"data_next": {"generators": [g.get_state() for g in gens]}} if gens else {}

    def load_state_dict(self, state: dict[str, Any], rng: Optional[dict[str, Any]] = None) -> None:
        """Restore :meth:`state_dict` (and :meth:`rng_state`, from the checkpoint's ``rng``); the pass
        is re-created lazily, at the next batch."""
        self.checkpoint_state = dict(state)
        self.micro_index = int(state.get("micro_index", 0))
        per = self.per_epoch
        if self.indexed:
            self.epoch = self.micro_index // per if per else 0
            self.in_epoch = self.micro_index - self.epoch * per if per else self.micro_index
            return
        self.epoch = int(state.get("epoch", 0))
        self.in_epoch = int(state.get("in_epoch", 0))
        self._iter, self._exhausted, self._finished = None, False, []
        self._ahead.clear()
        self._resume_rng = (rng or {}).get("data_pass")
        upcoming = (rng or {}).get("data_next")
        if upcoming is not None and not self.in_epoch:
            # Saved between passes: the generators' states after the last pass, which the next
            # pass draws its order from (a fresh loader's generator would replay epoch 0's).
            for g, after in zip(_generators(self.batches), upcoming.get("generators", [])):
                g.set_state(after)
        if self.in_epoch and self._resume_rng is None:
            self._resume_rng = {
                "cpu": torch.get_rng_state(),
                "generators": [],
            }  # no saved states: skip only

    def seek(self, micro_index: int) -> None:
        """Move a function of the index to batch ``micro_index`` (a spike rollback goes back);
        an iterable cannot be moved back in place."""
        if not self.indexed:
            raise ValueError(
                "only batches given as a function of the index can be moved back (spike_rollback "
                "with an iterable: use SpikeGuard in your own loop, see docs/guides/when-training-goes-wrong.md)"
            )
        kept = self.checkpoint_state
        self.load_state_dict({"micro_index": micro_index})
        self.checkpoint_state = kept
