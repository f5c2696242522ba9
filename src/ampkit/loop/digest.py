"""The SHA-256 beside each checkpoint file: how a damaged checkpoint is told from a good one.

torch's zip archive keeps CRC-32s that ``torch.load`` does not check, so a flipped byte inside a
tensor loads as a wrong weight. :func:`ampkit.loop.checkpoint.save_checkpoint` therefore writes a
sidecar ``<file>.sha256`` (``<sha256>  <file name>``, which ``sha256sum -c`` reads): the SHA-256 of
the file's bytes, hashed as they are written, the sidecar itself written atomically *after* the
checkpoint's rename* (a stale one is removed before it). :func:`check_digest` hashes the file
(streaming) before it is loaded.

*The sidecar is in place before the checkpoint takes its name, so ampkit never leaves a checkpoint
without its digest (a kill between the renames leaves the new digest beside the older file of that
name, or none: a mismatch, reported). In a directory whose other checkpoints carry digests, one
without its own therefore lost it (deleted, copied alone) and cannot be verified: it is refused.
A checkpoint without a sidecar among ones without any (written before ampkit recorded digests)
loads unverified, with a warning that says so. "Beside" counts sharded checkpoints too (a
directory with its ``.sha256`` list inside), and the caller may name the peers itself (Hugging
Face's ``ampkit_amp.pt`` has its peers in the sibling ``checkpoint-N`` directories).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import warnings
from typing import Any, Callable, Optional

__all__ = [
    "DIGEST_SUFFIX",
    "HashingWriter",
    "check_digest",
    "check_sharded",
    "digest_path",
    "digests_beside",
    "file_sha256",
    "write_digest",
]

#: the sidecar's suffix: ``ckpt-00000500.pt.sha256``
DIGEST_SUFFIX = ".sha256"
_CHUNK = 4 << 20


def digest_path(path: str) -> str:
    """The digest sidecar of the checkpoint file ``path``."""
    return path + DIGEST_SUFFIX


def file_sha256(path: str) -> str:
    """The SHA-256 (hex) of the file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class HashingWriter:
    """A write-only file wrapper for ``torch.save`` (whose zip writer writes a file-like object in
    order, never seeking): hashes what is written (``.sha256``) and remembers the first OSError
    its writes raised (``.error``: torch reports it as a RuntimeError about file positions)."""

    def __init__(self, f: Any) -> None:
        self._f, self.error, self.sha256 = f, None, hashlib.sha256()

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.sha256.update(data)
        return n

    def flush(self) -> None:
        self._f.flush()


def write_digest(path: str, sha256: str) -> Callable[[], None]:
    """The sidecar of ``path`` saying ``sha256``, through a temporary file (fsync, rename).
    Returns what puts the sidecar back as it was (a save whose file then cannot take its name)."""
    sidecar = digest_path(path)
    undo = _undo_of(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=DIGEST_SUFFIX, dir=os.path.dirname(sidecar))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(f"{sha256}  {os.path.basename(path)}\n".encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, sidecar)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return undo


def _undo_of(path: str) -> Callable[[], None]:
    """What puts ``path``'s sidecar back as it is now (its bytes, or no sidecar), for a save whose
    file could not take its name after its new digest was written; best effort (it never raises:
    the save's own error is the one to report)."""
    sidecar = digest_path(path)
    try:
        with open(sidecar, "rb") as f:
            old: Optional[bytes] = f.read()
    except FileNotFoundError:
        old = None

    def undo() -> None:
        with contextlib.suppress(OSError):
            if old is None:
                os.unlink(sidecar)
                return
            fd, tmp = tempfile.mkstemp(
                prefix=".tmp-", suffix=DIGEST_SUFFIX, dir=os.path.dirname(sidecar)
            )
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(old)
                os.replace(tmp, sidecar)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    return undo


def check_digest(path: str, peers: Optional[list[str]] = None) -> Optional[str]:
    """None when ``path``'s bytes match its sidecar, or when it has none and neither have its peers
    (a warning says it loads unverified); else what is wrong, as words that follow the file's name.
    ``peers``: the files whose sidecars say digests were recorded (default: :func:`digests_beside`)."""
    sidecar = digest_path(path)
    name = os.path.basename(sidecar)
    try:
        with open(sidecar, "rb") as f:
            recorded = f.read(4096).split()
    except FileNotFoundError:
        if peers is None:
            peer = digests_beside(path)
        else:
            peer = next((digest_path(p) for p in peers if os.path.isfile(digest_path(p))), None)
        if peer is not None:
            return (
                f"has no digest file ({name}) although the checkpoints beside it have theirs "
                f"({peer}): it lost it and its bytes cannot be verified"
            )
        warnings.warn(
            f"checkpoint {path!r} has no digest file ({name}), nor do the checkpoints beside it "
            "(written before ampkit recorded digests?): loaded unverified",
            stacklevel=3,
        )
        return None
    except OSError as e:
        return f"cannot be verified: its digest file {name} cannot be read ({e.strerror or e})"
    want = recorded[0].decode("ascii", "replace").lower() if recorded else ""
    if not re.fullmatch(r"[0-9a-f]{64}", want):
        return f"has a damaged digest file ({name}: no SHA-256 in it)"
    try:
        got = file_sha256(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if got != want:
        return (
            f"is damaged: its SHA-256 ({got[:16]}...) does not match the digest recorded in "
            f"{name} ({want[:16]}...)"
        )
    return None


def digests_beside(path: str) -> Optional[str]:
    """The digest of another checkpoint in ``path``'s directory (a file's sidecar, or a sharded
    checkpoint directory's ``.sha256`` list), as a path relative to that directory; None if none
    has one. ``path`` may be a file or a sharded checkpoint directory."""
    path = os.path.abspath(path)
    directory, own = os.path.dirname(path), os.path.basename(path)
    try:
        names = set(os.listdir(directory)) - {own}
    except OSError:
        return None
    for n in sorted(names):
        if n.startswith(".tmp-"):
            continue
        if n.endswith(DIGEST_SUFFIX) and n[: -len(DIGEST_SUFFIX)] in names:
            return n
        if os.path.isfile(os.path.join(directory, n, DIGEST_SUFFIX)):  # a sharded checkpoint's
            return os.path.join(n, DIGEST_SUFFIX)
    return None


def check_sharded(path: str) -> Optional[str]:
    """None when every file of the sharded checkpoint directory ``path`` is listed in its
    ``.sha256`` and matches, or when it has no list and no checkpoint beside it has digests (a
    warning says it is used unverified); else what is wrong, as words that follow its name. A
    collective (:func:`ampkit.distributed.dcp.verify`; every rank sees the same files)."""
    from ..distributed import dcp

    if dcp.has_digests(path):
        damage = dcp.verify(path)
        return None if damage is None else f"is damaged: {damage}"
    peer = digests_beside(path)
    if peer is not None:
        return (
            f"has no digest list ({dcp.DIGESTS} inside it) although the checkpoints beside it "
            f"have theirs ({peer}): it lost it and its files cannot be verified"
        )
    warnings.warn(
        f"checkpoint {path!r} has no digest list ({dcp.DIGESTS} inside it), nor do the "
        "checkpoints beside it (written before ampkit recorded digests?): used unverified",
        stacklevel=3,
    )
    return None
