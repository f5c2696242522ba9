"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), and a single-file export.

Every rank writes its own shards in parallel (FSDP2: its DTensor shards; DDP: DCP writes each
replicated tensor once). A checkpoint directory holds:

* ``model``, ``optimizer``: tensors, from :func:`ampkit.distributed.states.capture`;
* ``extra``: everything else the caller saved (the engine's state -- precision after fallbacks,
  scaler, counters, events --, data position, scheduler, run id) as one ``torch.save`` blob, read
  back with ``weights_only=True``;
* ``rng.rank<r>``: each rank's own RNG states (ranks differ; DCP would otherwise keep one copy).

Atomicity: DCP writes the files and, last, ``.metadata``; we write into ``<dir>.partial`` and
rank 0 renames it to ``<dir>`` once every rank's ``save`` returned, so a directory with that
name is complete; :func:`is_complete` also demands ``.metadata``. Loading reads into *copies*
of the live tensors and only then applies them, so a failed load changes nothing. Every
non-tensor item is unpickled with ``weights_only=True`` (DCP's own planners do not).

Digests: before the rename, the ranks hash the directory's files (each a share) and rank 0 writes
``.sha256`` inside it (``sha256sum`` format: one ``<sha256>  <file>`` line per file, ``.metadata``
included); :func:`verify` checks them (each rank a share again) before anything is read: every file
of the directory must be listed and match. DCP keeps no checksums of its own, so without this a
flipped byte in a shard loads as a wrong weight. Whether a directory without the list may load
unverified (written before ampkit recorded digests) is its caller's decision
(:func:`ampkit.loop.digest.check_sharded`: only when no checkpoint beside it has digests).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.utils._pytree import tree_map_only

from .env import barrier, is_main, rank

__all__ = [
    "DIGESTS",
    "consolidate",
    "has_digests",
    "is_complete",
    "load",
    "model_shapes",
    "save",
    "verify",
    "writers",
]

_TENSORS = ("model", "optimizer")
#: the digest list inside a checkpoint directory
DIGESTS = ".sha256"


def _blob(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unblob(data: Any) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


class _WeightsOnly:
    """A load-planner mixin: DCP's non-tensor items (optimizer hyperparameters, our blobs) are
    unpickled with ``weights_only=True`` -- DCP's own planners use ``weights_only=False``, which
    would run code from a tampered checkpoint directory."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)  # type: ignore[attr-defined]
        else:
            self.state_dict[read_item.dest_index.fqn] = obj  # type: ignore[attr-defined]


class _SafeLoadPlanner(_WeightsOnly, DefaultLoadPlanner):
    pass


class _SafeEmptyLoadPlanner(_WeightsOnly, _EmptyStateDictLoadPlanner):
    pass


def is_complete(directory: str) -> bool:
    """True when ``directory`` is a finished DCP checkpoint (its ``.metadata`` exists)."""
    return os.path.isfile(os.path.join(directory, ".metadata"))


def save(state: dict[str, Any], directory: str) -> str:
    """Write ``state`` (``model`` and ``optimizer`` as :func:`capture` gives them, anything else
    weights_only-safe; ``rng`` per rank) to ``directory`` atomically. A collective: call on every rank."""
    partial = directory + ".partial"
    if is_main():
        shutil.rmtree(partial, ignore_errors=True)  # leftovers of a killed run
    barrier()
    rest = {k: v for k, v in state.items() if k not in (*_TENSORS, "rng")}
    payload: dict[str, Any] = {k: state[k] for k in _TENSORS}
    payload["extra"] = _blob(rest)
    payload[f"rng.rank{rank()}"] = _blob(state.get("rng", {}))
    dcp.save(payload, checkpoint_id=partial)
    barrier()  # every rank's shards (and rank 0's .metadata) are written: hash them, then rename
    files = _files(partial)
    digests = _gather({n: _sha256(os.path.join(partial, n)) for n in _share(files)})
    if is_main():
        with open(os.path.join(partial, DIGESTS), "w") as f:
            f.writelines(f"{digests[n]}  {n}\n" for n in files)
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(partial, directory)
    barrier()
    return directory


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _share(items: list[str]) -> list[str]:
    """This rank's share of ``items`` (every ``world``-th one)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return items[rank() :: world]


def _gather(mine: dict[str, str]) -> dict[str, str]:
    """Every rank's ``mine`` merged, on every rank (a collective; ``mine`` in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def has_digests(directory: str) -> bool:
    """Whether the checkpoint ``directory`` has its digest list (readable or not)."""
    return os.path.lexists(os.path.join(directory, DIGESTS))


def writers(directory: str) -> int:
    """How many processes wrote the checkpoint ``directory``: the ranks in its shard files' names
    (DCP's ``__<rank>_<n>.distcp``; every rank writes at least its RNG); nothing is unpickled."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    return len({m.group(1) for n in names if (m := re.fullmatch(r"__(\d+)_\d+\.distcp", n))})


def _files(directory: str) -> list[str]:
    """The names of the directory's files, as :func:`save` lists them (the list itself aside)."""
    return sorted(
        n
        for n in os.listdir(directory)
        if n != DIGESTS and os.path.isfile(os.path.join(directory, n))
    )


def verify(directory: str) -> Optional[str]:
    """What is wrong with the files of the checkpoint ``directory`` against its digest list (each
    rank hashes a share; every rank gets the same answer), or None when every file of the
    directory is listed and matches. A directory without the list is one too (see
    :func:`has_digests`). A collective."""
    listed: dict[str, str] = {}
    problem = None
    try:
        with open(os.path.join(directory, DIGESTS), "rb") as f:
            for line in f.read().decode("utf-8", "replace").splitlines():
                m = re.fullmatch(r"([0-9a-f]{64})  (\S+)", line)
                if m is None or "/" in m.group(2):
                    problem = f"its digest list {DIGESTS} is damaged"
                    break
                listed[m.group(2)] = m.group(1)
    except FileNotFoundError:
        problem = f"it has no digest list ({DIGESTS})"
    except OSError as e:
        problem = f"its digest list {DIGESTS} cannot be read ({e.strerror or e})"
    if problem is None and ".metadata" not in listed:
        problem = f"its digest list {DIGESTS} is damaged (no .metadata in it)"
    if problem is None:  # a file the list does not name cannot be verified (a line deleted)
        try:
            unlisted = [n for n in _files(directory) if n not in listed]
        except OSError as e:
            unlisted, problem = [], f"its files cannot be listed ({e.strerror or e})"
        if unlisted:
            problem = (
                f"{', '.join(unlisted)} {'is' if len(unlisted) == 1 else 'are'} not in its "
                f"digest list {DIGESTS}, so {'its' if len(unlisted) == 1 else 'their'} bytes "
                "cannot be verified"
            )
    mine: dict[str, str] = {}
    for name in _share(sorted(listed)) if problem is None else []:
        try:
            got = _sha256(os.path.join(directory, name))
        except OSError as e:
            mine[name] = f"{name} cannot be read ({e.strerror or e})"
            continue
        if got != listed[name]:
            mine[name] = f"the SHA-256 of {name} does not match its digest in {DIGESTS}"
    bad = _gather(mine)  # collective on every rank, also when this rank found its own problem
    if problem is None and bad:
        problem = "; ".join(bad[k] for k in sorted(bad))
    return problem


def model_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor a checkpoint holds (from its ``.metadata``; no tensor is read)."""
    meta = dcp.FileSystemReader(directory).read_metadata()
    return {
        k[len("model.") :]: tuple(v.size)
        for k, v in meta.state_dict_metadata.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def _keys(directory: str) -> set[str]:
    meta = dcp.FileSystemReader(directory).read_metadata()
    return set(meta.state_dict_metadata)


def load(
    directory: str, model_state: dict[str, Any], optimizer_state: dict[str, Any]
) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` into copies of ``model_state``/``optimizer_state``
    (live tensors from :func:`capture`, which give the shapes and shardings). Returns the saved
    state (``model``, ``optimizer``, this rank's ``rng``, the rest). A collective."""
    clone = lambda t: t.detach().clone()  # noqa: E731
    payload: dict[str, Any] = {
        "model": tree_map_only(torch.Tensor, clone, model_state),
        "optimizer": tree_map_only(torch.Tensor, clone, optimizer_state),
        "extra": b"",
    }
    mine = f"rng.rank{rank()}"
    has_rng = mine in _keys(directory)  # a checkpoint from a different world size lacks some ranks
    if has_rng:
        payload[mine] = b""
    dcp.load(payload, checkpoint_id=directory, planner=_SafeLoadPlanner())
    out = dict(_unblob(payload["extra"]))
    out.update(model=payload["model"], optimizer=payload["optimizer"])
    out["rng"] = _unblob(payload[mine]) if has_rng else {}
    return out


def consolidate(directory: str, rank_rng: int = 0, *, verified: bool = False) -> dict[str, Any]:
    """The checkpoint as one plain state dict, in one process: full tensors, the optimizer state
    numbered like a plain ``optimizer.state_dict()``, rank ``rank_rng``'s RNG. Everything in it
    loads with ``torch.load(weights_only=True)`` once saved. Its files are checked against their
    digest list first (:func:`verify`) unless ``verified`` says the caller did."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from .states import id_keyed

    if not is_complete(directory):
        raise FileNotFoundError(f"{directory!r} is not a complete DCP checkpoint (no .metadata)")
    damage = None if verified else verify(directory)
    if damage is not None:
        raise ValueError(f"it is damaged: {damage}")
    sd: dict[str, Any] = {}
    # What torch's own dcp_to_torch_save does, without the round trip through a pickle file.
    _load_state_dict(
        sd,
        storage_reader=dcp.FileSystemReader(directory),
        planner=_SafeEmptyLoadPlanner(),
        no_dist=True,
    )
    out = dict(_unblob(sd["extra"]))
    out["model"] = sd["model"]
    out["optimizer"] = id_keyed(sd["optimizer"])
    rng: Optional[bytes] = sd.get(f"rng.rank{rank_rng}")
    out["rng"] = _unblob(rng) if rng is not None else {}
    return out
