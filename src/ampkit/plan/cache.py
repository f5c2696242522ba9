"""Measured steps kept on disk for ``ampkit plan``: a repeat plan of the same model -- another
budget, another batch size -- reads the shallow copies' measures instead of running them again.

A file holds the measures of one :func:`ampkit.plan.depth.measure_both` call (or a twin's), named
by a hash of everything they depend on: the model (the stack's configuration), the sample batch's
shapes and dtypes, the precision, the optimizer, the depths, batches and checkpointing settings,
the versions of torch, torchao and transformers, and the text of ampkit's own source -- any
change there is another name, so nothing stale is read. A file carries the SHA-256 of its
measures; one that does not parse or does not match it (a changed byte inside a number still
parses) is never read: measured again and replaced (written atomically: a temporary file,
fsynced, then renamed).

Where: ``plan/`` under ampkit's cache directory, ``$AMPKIT_CACHE_DIR`` (default ``~/.cache/ampkit``,
where the measured ``auto`` choices and the compiled ladder kernels live too); ``AMPKIT_PLAN_CACHE=off``
or ``ampkit plan --no_cache`` measures everything afresh. Only the command line
uses it: the library's estimates and the service (which keeps its own cache) never write here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from ..step.logs import logger
from .session import Measure

__all__ = ["cache_dir", "current", "key", "load", "save", "use"]

_DIR: contextvars.ContextVar[Optional[Path]] = contextvars.ContextVar(
    "ampkit_plan_cache", default=None
)


@contextlib.contextmanager
def use(directory: Optional[Path]) -> Iterator[None]:
    """Measures made inside the block are read from and kept in ``directory`` (None: not kept)."""
    token = _DIR.set(directory)
    try:
        yield
    finally:
        _DIR.reset(token)


def current() -> Optional[Path]:
    """The directory of the enclosing :func:`use`, or None."""
    return _DIR.get()


def cache_dir() -> Optional[Path]:
    """Where plans keep their measures: ``plan/`` under ampkit's cache directory (None: turned off)."""
    if os.environ.get("AMPKIT_PLAN_CACHE", "").strip().lower() in ("0", "off", "false", "no"):
        return None
    root = os.environ.get("AMPKIT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "ampkit"
    )
    return Path(root) / "plan"


@functools.lru_cache(maxsize=1)
def _environment() -> str:
    """The versions and ampkit's own source text: what every measure depends on besides its inputs."""
    from importlib import metadata

    h = hashlib.sha256(torch.__version__.encode())
    for dist in ("torchao", "transformers"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=-".encode())
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _shapes(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return [list(obj.shape), str(obj.dtype)]
    if isinstance(obj, (tuple, list)):
        return [_shapes(o) for o in obj]
    if isinstance(obj, dict):
        return {str(k): _shapes(v) for k, v in sorted(obj.items())}
    return repr(obj)


def key(model: str, precision: str, optimizer: Any, batch: Any, **settings: Any) -> Optional[str]:
    """The file name of these measures; None where there is no cache (outside :func:`use`) or one
    cannot be named (no model spec; an optimizer given as a callable: its behaviour is not in its name)."""
    if current() is None or not model or not isinstance(optimizer, str):
        return None
    from .devices import current as target

    device = target()
    spec = {
        "model": model,
        "precision": precision,
        "optimizer": optimizer.lower(),
        "batch": _shapes(batch),
        "device": device.name if device is not None else "cpu",
        **{k: repr(v) for k, v in sorted(settings.items())},
        "environment": _environment(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:32]


def load(name: Optional[str]) -> Optional[dict[str, Measure]]:
    """The measures saved under ``name``, or None (none saved, the cache off, or unreadable)."""
    directory = current()
    if directory is None or name is None:
        return None
    path = directory / f"{name}.json"
    try:
        raw = json.loads(path.read_text())
        if raw["sha256"] != _digest(raw["measures"]):
            logger.warning(
                "ampkit: the plan cache file %s does not match its digest: not read; its steps "
                "are measured again (and the file rewritten)",
                path,
            )
            return None
        return {
            k: Measure(
                m["precision"],
                int(m["peak_bytes"]),
                {p: int(v) for p, v in m["parts"].items()},
                {d: int(v) for d, v in m["by_dtype"].items()},
                tuple(int(x) for x in m["timeline"]),
                tuple(int(x) for x in m["phases"]),
                tuple(int(x) for x in m.get("grads", ())),
                int(m.get("largest_grad", 0)),
            )
            for k, m in raw["measures"].items()
        }
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        logger.warning(
            "ampkit: the plan cache file %s is damaged (%s: %s): not read; its steps are measured "
            "again (and the file rewritten)",
            path,
            type(e).__name__,
            e,
        )
        return None


def _digest(measures: Any) -> str:
    return hashlib.sha256(json.dumps(measures, sort_keys=True).encode()).hexdigest()


def save(name: Optional[str], measures: dict[str, Measure]) -> None:
    """Keep ``measures`` under ``name`` (atomically; a cache that cannot be written is skipped)."""
    directory = current()
    if directory is None or name is None:
        return
    body = {
        "measures": {
            k: {
                "precision": m.precision,
                "peak_bytes": m.peak_bytes,
                "parts": m.parts,
                "by_dtype": m.by_dtype,
                "timeline": list(m.timeline),
                "phases": list(m.phases),
                "grads": list(m.grads),
                "largest_grad": m.largest_grad,
            }
            for k, m in measures.items()
        }
    }
    body["sha256"] = _digest(body["measures"])
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(body, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / f"{name}.json")
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
