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
"""

from __future__ import annotations

import io
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.utils._pytree import tree_map_only

from .env import barrier, is_main, rank

__all__ = ["consolidate", "is_complete", "load", "model_shapes", "save"]

_TENSORS = ("model", "optimizer")


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
    barrier()  # every rank's shards are written before the rename makes the checkpoint visible
    if is_main():
        if os.path.isdir(directory):
            shutil.rmtree(directory)
        os.replace(partial, directory)
    barrier()
    return directory


def model_shapes(directory: str) -> dict[str, tuple[int, ...]]:
    """The global shape of every model tensor a checkpoint holds (from its ``.metadata``; no tensor is read)."""
    meta = dcp.FileSystemReader(directory).read_metadata()
    return {k[len("model."):]: tuple(v.size) for k, v in meta.state_dict_metadata.items()
            if k.startswith("model.") and hasattr(v, "size")}


def _keys(directory: str) -> set[str]:
    meta = dcp.FileSystemReader(directory).read_metadata()
    return set(meta.state_dict_metadata)


def load(directory: str, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` into copies of ``model_state``/``optimizer_state``
    (live tensors from :func:`capture`, which give the shapes and shardings). Returns the saved
    state (``model``, ``optimizer``, this rank's ``rng``, the rest). A collective."""
    clone = lambda t: t.detach().clone()  # noqa: E731
    payload: dict[str, Any] = {"model": tree_map_only(torch.Tensor, clone, model_state),
                               "optimizer": tree_map_only(torch.Tensor, clone, optimizer_state), "extra": b""}
    mine = f"rng.rank{rank()}"
    has_rng = mine in _keys(directory)  # a checkpoint from a different world size lacks some ranks
    if has_rng:
        payload[mine] = b""
    dcp.load(payload, checkpoint_id=directory, planner=_SafeLoadPlanner())
    out = dict(_unblob(payload["extra"]))
    out.update(model=payload["model"], optimizer=payload["optimizer"])
    out["rng"] = _unblob(payload[mine]) if has_rng else {}
    return out


def consolidate(directory: str, rank_rng: int = 0) -> dict[str, Any]:
    """The checkpoint as one plain state dict, in one process: full tensors, the optimizer state
    numbered like a plain ``optimizer.state_dict()``, rank ``rank_rng``'s RNG. Everything in it
    loads with ``torch.load(weights_only=True)`` once saved."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from .states import id_keyed

    if not is_complete(directory):
        raise FileNotFoundError(f"{directory!r} is not a complete DCP checkpoint (no .metadata)")
    sd: dict[str, Any] = {}
    # What torch's own dcp_to_torch_save does, without the round trip through a pickle file.
    _load_state_dict(sd, storage_reader=dcp.FileSystemReader(directory), planner=_SafeEmptyLoadPlanner(),
                     no_dist=True)
    out = dict(_unblob(sd["extra"]))
    out["model"] = sd["model"]
    out["optimizer"] = id_keyed(sd["optimizer"])
    rng: Optional[bytes] = sd.get(f"rng.rank{rank_rng}")
    out["rng"] = _unblob(rng) if rng is not None else {}
    return out
