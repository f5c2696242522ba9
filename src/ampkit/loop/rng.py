"""The random states a checkpoint carries: torch (CPU and CUDA), numpy (when installed) and
Python's, in ``weights_only``-safe types (re-exported by :mod:`ampkit.loop.checkpoint`)."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """RNG states of torch (CPU and CUDA), numpy (when installed) and Python, in weights_only-safe types."""
    out: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        name, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    except ImportError:
        pass
    version, internal, gauss = random.getstate()
    out["python"] = {"version": version, "state": list(internal), "gauss": gauss}
    return out


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (missing parts are left alone)."""
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np

            n = state["numpy"]
            np.random.set_state(
                (
                    n["name"],
                    n["keys"].numpy().astype("uint32"),
                    n["pos"],
                    n["has_gauss"],
                    n["gauss"],
                )
            )
        except ImportError:
            pass
    if "python" in state:
        p = state["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
