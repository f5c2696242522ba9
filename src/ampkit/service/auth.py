"""Bearer tokens and owners (``../shared/SERVICE-API.md``): ``AMPKIT_TOKENS=alice:T1,bob:T2``,
``AMPKIT_TOKEN=T`` (owner ``default``), else ``<data_dir>/tokens.json`` (mode 0600), written on
first start with one generated token for ``default``."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tempfile
from collections.abc import Mapping
from typing import Optional

__all__ = ["load_tokens"]


def token_source(data_dir: str, env: Optional[Mapping[str, str]] = None) -> str:
    """Where a server on ``data_dir`` takes its tokens from, for its start line: the variable or
    file and its owners, or that a first start writes a new token (and where). Reads, never
    writes; a malformed source is left to :func:`load_tokens` to refuse."""
    env = os.environ if env is None else env
    if env.get("AMPKIT_TOKENS"):
        owners = {i.partition(":")[0].strip() for i in env["AMPKIT_TOKENS"].split(",")}
        return f"AMPKIT_TOKENS (owners {', '.join(sorted(o for o in owners if o))})"
    if env.get("AMPKIT_TOKEN"):
        return "AMPKIT_TOKEN (owner 'default')"
    path = os.path.join(data_dir, "tokens.json")
    if not os.path.exists(path):
        return f"a new token for 'default' is written to {path} (read it there)"
    try:
        with open(path, encoding="utf-8") as f:
            owners = sorted(set(json.load(f).values()))
        return f"{path} (owners {', '.join(map(str, owners))})"
    except (OSError, ValueError, AttributeError, TypeError):
        return path


def load_tokens(data_dir: str, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """token -> owner. Raises ``ValueError`` for a malformed ``AMPKIT_TOKENS`` or tokens file."""
    env = os.environ if env is None else env
    if env.get("AMPKIT_TOKENS"):
        out = {}
        for item in env["AMPKIT_TOKENS"].split(","):
            owner, sep, token = item.strip().partition(":")
            if not sep or not owner or not token:
                raise ValueError(
                    f"AMPKIT_TOKENS item {item!r} is not OWNER:TOKEN (e.g. alice:s3cret,bob:t0ken)"
                )
            if token in out and out[token] != owner:
                raise ValueError(
                    f"AMPKIT_TOKENS gives the same token to {out[token]} and {owner}: each "
                    "owner needs a token of its own (requests with it would act as one of them)"
                )
            out[token] = owner
        return out
    if env.get("AMPKIT_TOKEN"):
        return {env["AMPKIT_TOKEN"]: "default"}
    path = os.path.join(data_dir, "tokens.json")
    if not os.path.exists(path):
        _first_tokens(data_dir, path)
    try:
        with open(path, encoding="utf-8") as f:
            tokens = json.load(f)
    except ValueError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); it maps each token to its owner: restore it, or "
            "delete it and a new token is generated for 'default' at the next start"
        ) from None
    if not isinstance(tokens, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()
    ):
        raise ValueError(f"{path} must be a JSON object mapping each token to its owner")
    if not tokens:
        raise ValueError(
            f"{path} holds no token, so every request would be refused; add "
            '"TOKEN": "OWNER" entries, or delete it and one is generated for \'default\''
        )
    return tokens


def _first_tokens(data_dir: str, path: str) -> None:
    """Write ``path`` with one generated token for ``default``: beside it (0600), fsynced, then
    linked into place, so it is whole or absent (a crash mid-write left a file that refused every
    later start), and a file another process wrote meanwhile is kept."""
    os.makedirs(data_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=data_dir, prefix=".tokens.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({secrets.token_urlsafe(24): "default"}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process's: kept
            pass
        except OSError:  # a file system without hard links
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
