"""Crash-safe checkpoints of the whole training state, and exact resume.

Writing is atomic: the state goes to a temporary file in the same directory, is flushed and
fsynced, then renamed over the final name (``os.replace`` is atomic on POSIX), and the directory
is fsynced. A reader therefore sees either the previous checkpoint or the new one, never half of
one — also when the process is killed mid-write. Loading uses ``torch.load(weights_only=True)``;
a truncated or corrupt file raises :class:`CheckpointError` naming the file, and
:meth:`CheckpointManager.load_latest` falls back to the previous good checkpoint.

Each checkpoint file has its SHA-256 beside it (:mod:`ampkit.loop.digest`), checked before
loading: a damaged file is reported and never used.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import re
import shutil
import tempfile
import warnings
from typing import Any, Callable, Optional

import torch

from .digest import (
    DIGEST_SUFFIX,
    HashingWriter,
    check_digest,
    check_sharded,
    digest_path,
    write_digest,
)
from .layouts import other_layout
from .rng import capture_rng, restore_rng

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatch",
    "DirLock",
    "ShardedCheckpointManager",
    "capture_rng",
    "check_state",
    "export_single_file",
    "list_checkpoints",
    "load_checkpoint",
    "model_mismatch",
    "restore_rng",
    "save_checkpoint",
    "torch_reason",
]

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit; the message names the file."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of a different model (keys or shapes): resuming from an older
    checkpoint of the same directory would not help, so :meth:`CheckpointManager.load_latest`
    raises it instead of falling back."""


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not supported on this platform
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(state: dict[str, Any], path: str) -> str:
    """Write ``state`` to ``path`` atomically (temp file + fsync + rename), its digest sidecar
    ``path + ".sha256"`` (atomically too) in place before the rename. Returns ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    sink, tmp, undo = None, None, None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
        with os.fdopen(fd, "wb") as f:
            sink = HashingWriter(f)
            torch.save({"ampkit_checkpoint": FORMAT_VERSION, **state}, sink)
            f.flush()
            os.fsync(f.fileno())
        # The digest first: a kill between the renames leaves it beside an older file of this name
        # (a mismatch, reported) or none -- never a checkpoint without its digest (loop.digest).
        undo = write_digest(path, sink.sha256.hexdigest())  # (used if the rename fails)
        os.replace(tmp, path)
        undo = None
        _fsync_dir(directory)
    except (OSError, RuntimeError) as e:
        _remove(tmp, undo)
        # torch's zip writer reports a failed write as a RuntimeError about file positions; the
        # OSError underneath (disk full, file too large) is the reason worth showing.
        cause = sink.error if sink is not None and sink.error is not None else e
        if not isinstance(cause, OSError) and not isinstance(e, OSError):
            raise
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        raise CheckpointError(
            f"could not write checkpoint {path!r}: {reason}. Nothing was replaced: the previous "
            "checkpoint, if any, is intact and the partial file was removed. Free space on that "
            "disk (or checkpoint elsewhere), then resume: it continues from the previous checkpoint"
        ) from e
    except BaseException:
        _remove(tmp, undo)
        raise
    return path


def _remove(tmp: Optional[str], undo: Any = None) -> None:  # undo: write_digest's
    if undo is not None:
        undo()
    if tmp is not None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def load_checkpoint(path: str, map_location: Any = "cpu") -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True`` after checking its bytes against the digest
    sidecar (a file without one loads unverified); :class:`CheckpointError` names the file on
    failure."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path!r} does not exist")
    damage = check_digest(path)
    if damage is not None:
        raise CheckpointError(f"checkpoint {path!r} {damage}; it was not loaded")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        if isinstance(e, pickle.UnpicklingError) and "Weights only load failed" in str(e):
            raise CheckpointError(
                f"checkpoint {path!r} holds objects that weights_only loading refuses, so it "
                f"was not loaded: {torch_reason(e)}"
            ) from None
        raise CheckpointError(
            f"checkpoint {path!r} is truncated or corrupt and was not loaded "
            f"({type(e).__name__}: {torch_reason(e)})"
        ) from None
    if not isinstance(state, dict) or "ampkit_checkpoint" not in state:
        raise CheckpointError(
            f"{path!r} is not an ampkit checkpoint (no 'ampkit_checkpoint' marker)"
        )
    return state


def torch_reason(e: BaseException) -> str:
    """The informative line of a ``torch.load`` error (for weights_only refusals, torch's own
    ``WeightsUnpickler error: ...`` sentence, which names the refused global)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "WeightsUnpickler error" in ln or "Unsupported global" in ln:
            return ln.split("WeightsUnpickler error:", 1)[-1].strip()[:400]
    return (lines[0] if lines else type(e).__name__)[:300]


class CheckpointManager:
    """Numbered checkpoints in one directory: ``save`` (atomic, keep the last ``keep_last``),
    ``load_latest`` (newest readable one; corrupt ones are reported and skipped)."""

    def __init__(
        self, directory: str, *, keep_last: Optional[int] = 3, prefix: str = "ckpt"
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(
                f"keep_last={keep_last} must be >= 1 (or None to keep every checkpoint)"
            )
        self.directory, self.keep_last, self.prefix = directory, keep_last, prefix

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{step:08d}.pt")

    _pattern = re.compile(r"^(?P<prefix>.+)-(?P<step>\d{8})\.pt$")

    def _complete(self, path: str) -> bool:
        return True  # a file with the final name is complete: it was renamed there after fsync

    def _load(self, path: str, map_location: Any) -> dict[str, Any]:
        return load_checkpoint(path, map_location)

    def list(self) -> list[tuple[int, str]]:
        """(step, path) of every complete checkpoint, oldest first (temp files are ignored)."""
        if not os.path.isdir(self.directory):
            return []
        out = []
        for name in os.listdir(self.directory):
            m = self._pattern.match(name)
            path = os.path.join(self.directory, name)
            if m and m.group("prefix") == self.prefix and self._complete(path):
                out.append((int(m.group("step")), path))
        return sorted(out)

    def save(self, step: int, state: dict[str, Any]) -> str:
        path = save_checkpoint({**state, "step": step}, self.path(step))
        if self.keep_last is not None:
            for _, old in self.list()[: -self.keep_last]:
                for name in (old, digest_path(old)):  # killed between: a digest alone, unread
                    with contextlib.suppress(OSError):
                        os.unlink(name)
        self._clean_temp()
        return path

    def _clean_temp(self) -> None:
        # Leftovers of a process killed mid-write: never valid, safe to remove. (A digest left
        # without its checkpoint is never read: a new file of that name replaces it first.)
        for name in os.listdir(self.directory):
            if name.startswith(".tmp-") and name.endswith((".pt", DIGEST_SUFFIX)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.directory, name))

    def load_latest(self, map_location: Any = "cpu") -> Optional[tuple[str, dict[str, Any]]]:
        """The newest checkpoint that loads and matches its digest; damaged ones are skipped, with
        one warning naming each and the checkpoint used instead. None when the directory holds no
        checkpoint file; :class:`CheckpointError` when it holds only damaged or unreadable ones
        (each named with its reason), and when the other layout's checkpoints (sharded ones for a
        single-file manager, and the other way round) are there and newer: never a silent fresh
        start, nor a silent step back."""
        own = self.list()
        refusal = other_layout(self.directory, own, list_checkpoints(self.directory, self.prefix))
        if refusal is not None:
            raise CheckpointError(refusal)
        problems = []
        for _, path in reversed(own):
            try:
                state = self._load(path, map_location)
            except CheckpointMismatch:
                raise
            except CheckpointError as e:
                problems.append(str(e))
                continue
            if problems:
                warnings.warn(
                    f"{'; '.join(problems)}; falling back to the previous checkpoint {path!r}",
                    stacklevel=2,
                )
            return path, state
        if problems:
            raise CheckpointError(
                f"every checkpoint in {self.directory!r} is damaged or "
                f"unreadable ({len(problems)} file(s)), so none was loaded: "
                + "; ".join(problems)
                + "; to go on, restore a checkpoint of this run from a backup, or start the run "
                "afresh in another directory (the damaged files are left as they are)"
            )
        return None


class ShardedCheckpointManager(CheckpointManager):
    """Numbered **sharded** checkpoints (``ckpt-00000005/``, one DCP directory each) for runs of
    several processes: every rank writes its shards (:mod:`ampkit.distributed.dcp`); atomic, keep
    the last ``keep_last``; ``load_latest`` skips directories without metadata and falls back past
    unreadable ones and ones whose files do not match their digests (``.sha256`` inside).
    ``template()`` returns the live ``(model_state, optimizer_state)`` to load into
    (:func:`ampkit.distributed.states.capture`). Every method is a collective."""

    def __init__(
        self,
        directory: str,
        template: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
        *,
        keep_last: Optional[int] = 3,
        prefix: str = "ckpt",
    ) -> None:
        super().__init__(directory, keep_last=keep_last, prefix=prefix)
        self.template = template

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"{self.prefix}-{step:08d}")

    _pattern = re.compile(r"^(?P<prefix>.+)-(?P<step>\d{8})$")

    def _complete(self, path: str) -> bool:
        from ..distributed import dcp

        return dcp.is_complete(path)  # its .metadata exists (written last, before the rename)

    def _load(self, path: str, map_location: Any) -> dict[str, Any]:
        from ..distributed import dcp

        template = self.template()
        damage = check_sharded(
            path
        )  # a collective: every rank gets the same answer, falls back alike
        if damage is not None:
            raise CheckpointError(f"checkpoint {path!r} {damage}; it was not loaded")
        try:
            shapes = dcp.model_shapes(path)
        except Exception as e:  # noqa: BLE001 - unreadable metadata: reported (and skipped) like a corrupt file
            raise CheckpointError(
                f"checkpoint {path!r} is unreadable and was not loaded "
                f"({type(e).__name__}: {torch_reason(e)})"
            ) from None
        # Keys and shapes first, from the metadata: a different model is named, not "unreadable".
        own = {k: tuple(v.shape) for k, v in template[0].items() if isinstance(v, torch.Tensor)}
        model_mismatch(shapes, own, f"checkpoint {path!r}")
        return _dcp_read(
            lambda: dcp.load(path, *template),
            f"checkpoint {path!r} is unreadable and was not loaded",
        )

    def save(self, step: int, state: dict[str, Any]) -> str:
        from ..distributed import dcp, is_main

        path = dcp.save(
            {**state, "step": step, "ampkit_checkpoint": FORMAT_VERSION}, self.path(step)
        )
        if self.keep_last is not None and is_main():
            for _, old in self.list()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        return path


def _dcp_read(read: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    """``read()``, with any failure as a :class:`CheckpointError` saying ``what`` and why. DCP's
    ``CheckpointException`` (raised on every rank alike) is a ``BaseException``, hence the catch."""
    try:
        return read()
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"{what} ({type(e).__name__}: {torch_reason(e)})") from None


def export_single_file(directory: str, path: str) -> str:
    """Turn a sharded checkpoint directory into one checkpoint file (in this one process), written
    atomically; it loads with ``weights_only=True`` into a plain model (``Trainer.load_state_dict``,
    ``ampkit train --resume``). Its files are verified first (:func:`~ampkit.loop.digest.check_sharded`):
    a damaged checkpoint is refused, never given a fresh digest. Returns ``path``."""
    from ..distributed import dcp

    if not dcp.is_complete(directory):
        raise CheckpointError(_not_sharded(directory))
    damage = check_sharded(directory)
    if damage is not None:
        raise CheckpointError(f"checkpoint {directory!r} {damage}; it was not exported")
    state = _dcp_read(
        lambda: dcp.consolidate(directory, verified=True),
        f"{directory!r} could not be read as a sharded checkpoint",
    )
    state.pop("ampkit_checkpoint", None)
    return save_checkpoint(state, path)


def _not_sharded(source: str) -> str:
    """Why ``source`` (not a complete sharded checkpoint) cannot be exported, and what to pass."""
    want = "export takes one sharded checkpoint directory, a multi-process run's ckpt-NNNNNNNN/"
    if os.path.isfile(source):
        if source.endswith(".pt"):
            return (
                f"{source!r} is a single-file checkpoint already (a one-process run's): it loads with "
                "torch.load(weights_only=True) and resumes from its --checkpoint_dir as it is; "
                f"nothing to export; {want}"
            )
        return f"{source!r} is a file, not a directory; {want}"
    if not os.path.isdir(source):
        return f"{source!r} does not exist; {want}"
    found = list_checkpoints(source)
    sharded = [path for _, path in found if os.path.isdir(path)]
    if sharded:
        return (
            f"{source!r} holds sharded checkpoints ({len(sharded)}); pass one of them, e.g. the "
            f"newest: {sharded[-1]}"
        )
    if found:
        return (
            f"{source!r} holds single-file checkpoints (newest: {os.path.basename(found[-1][1])}): "
            f"each is one file already, nothing to export; {want}"
        )
    return (
        f"{source!r} holds no checkpoint (a sharded one holds a .metadata file, written last: an "
        f"unfinished one has none); {want}"
    )


def check_state(
    state: dict[str, Any], own: dict[str, Any], optimizer: torch.optim.Optimizer, source: str
) -> None:
    """Raise :class:`CheckpointError` unless ``state`` (a trainer state) fits a model whose state is
    ``own`` and ``optimizer``: keys, shapes, parameter groups, the engine's state. Loads nothing."""
    missing_keys = [k for k in ("model", "optimizer", "amp") if not isinstance(state.get(k), dict)]
    if missing_keys:
        raise CheckpointError(
            f"{source} lacks {', '.join(missing_keys)} (a partial or foreign training state); "
            "nothing was loaded"
        )
    theirs = state["model"]
    model_mismatch(
        {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in theirs.items()},
        {k: tuple(v.shape) for k, v in own.items() if isinstance(v, torch.Tensor)},
        source,
    )
    groups = state["optimizer"].get("param_groups")
    ours = [len(g["params"]) for g in optimizer.param_groups]
    if (
        not isinstance(groups, list)
        or [len(g.get("params", ())) for g in groups] != ours
        or not isinstance(state["optimizer"].get("state"), dict)
    ):
        raise CheckpointError(
            f"{source}: the optimizer state does not fit this optimizer (parameter groups of "
            f"sizes {ours} expected); nothing was loaded"
        )
    if not {"precision", "config"} <= set(state["amp"]):
        raise CheckpointError(
            f"{source}: the engine state lacks 'precision'/'config'; nothing was loaded"
        )


def model_mismatch(theirs: dict[str, Any], own: dict[str, tuple[int, ...]], source: str) -> None:
    """Raise :class:`CheckpointMismatch` naming the missing, unexpected and differently shaped
    tensors when a checkpoint's model (``theirs``: key -> shape) does not fit ``own``."""
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    shapes = sorted(
        k for k in set(own) & set(theirs) if theirs[k] is None or tuple(theirs[k]) != own[k]
    )
    if missing or unexpected or shapes:
        parts = []
        for label, keys in (("missing", missing), ("unexpected", unexpected)):
            if keys:
                parts.append(f"{label}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}")
        if shapes:
            parts.append(
                "shape mismatch: "
                + ", ".join(
                    f"{k} {tuple(theirs[k]) if theirs[k] is not None else '(not a tensor)'} in the checkpoint vs "
                    f"{own[k]} here"
                    for k in shapes[:4]
                )
                + (" ..." if len(shapes) > 4 else "")
            )
        raise CheckpointMismatch(
            f"{source} does not fit this model ({'; '.join(parts)}); nothing was loaded "
            "(a different --model/--size or model config than the run that wrote it?)"
        )


def list_checkpoints(directory: str, prefix: str = "ckpt") -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``directory``, single-file and sharded alike, oldest first."""
    from ..distributed import dcp

    found = CheckpointManager(directory, prefix=prefix).list()
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            m = ShardedCheckpointManager._pattern.match(name)
            path = os.path.join(directory, name)
            if m and m.group("prefix") == prefix and os.path.isdir(path) and dcp.is_complete(path):
                found.append((int(m.group("step")), path))
    return sorted(found)


class DirLock:
    """An exclusive lock on a run's directory (``.ampkit.lock``, ``fcntl.flock``): a second run
    using the same directory gets a clear error instead of interleaving files. The kernel drops
    the lock when the process dies, so a killed run never leaves a stale lock behind."""

    NAME = ".ampkit.lock"

    def __init__(self, directory: str, what: str = "directory") -> None:
        self.directory, self.what = directory, what
        self._fd: Optional[int] = None

    def acquire(self) -> DirLock:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, self.NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise CheckpointError(
                f"{self.what} {self.directory!r} is in use by another ampkit run"
                f"{f' (pid {holder})' if holder else ''}; give this run its own directory"
            ) from None
        # Nothing is written into the file: taking the lock leaves the directory byte-identical
        # (a refused resume changes nothing); the holder's pid comes from the kernel's lock table.
        self._fd = fd
        return self

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _lock_holder(fd: int) -> Optional[int]:
    """The pid holding an flock on ``fd``'s file, from ``/proc/locks`` (Linux); None elsewhere."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF" (a blocked waiter's line has "->")
        if "->" not in parts and "FLOCK" in parts and len(parts) >= 6 and parts[5] == want:
            with contextlib.suppress(ValueError):
                return int(parts[4])
    return None
