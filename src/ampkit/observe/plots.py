"""matplotlib, imported only when a plot is asked for (the ``plot`` extra)."""

from __future__ import annotations

from typing import Any

__all__ = ["pyplot"]


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend; ImportError names the extra."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError('plots need matplotlib: pip install "ampkit[plot]"') from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
