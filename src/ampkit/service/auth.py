"""Bearer tokens and owners (``../shared/SERVICE-API.md``): ``AMPKIT_TOKENS=alice:T1,bob:T2``,
``AMPKIT_TOKEN=T`` (owner ``default``), else ``<data_dir>/tokens.json`` (mode 0600), written on
first start with one generated token for ``default``."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from typing import Optional

__all__ = ["load_tokens"]


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
            out[token] = owner
        return out
    if env.get("AMPKIT_TOKEN"):
        return {env["AMPKIT_TOKEN"]: "default"}
    path = os.path.join(data_dir, "tokens.json")
    if not os.path.exists(path):
        os.makedirs(data_dir, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({secrets.token_urlsafe(24): "default"}, f, indent=2)
    try:
        with open(path, encoding="utf-8") as f:
            tokens = json.load(f)
    except ValueError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e}); it maps each token to its owner"
        ) from None
    if not isinstance(tokens, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()
    ):
        raise ValueError(f"{path} must be a JSON object mapping each token to its owner")
    return tokens
