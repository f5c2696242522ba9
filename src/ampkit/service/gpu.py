"""GPU temperature and memory for ``/health``, run metrics and the scheduler's temperature hold.

Read through ``torch.cuda`` (memory; temperature where pynvml is installed) and, for the
temperature otherwise, ``nvidia-smi``. Without a CUDA device the list is empty and nothing is
reported (the fields are absent). Every reader is guarded: a failing probe reports ``None``,
never an error to the caller.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Optional

__all__ = ["TempHold", "gpu_status", "gpu_temperatures"]


def _smi_temperatures() -> dict[int, float]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index,temperature.gpu", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    temps = {}
    for line in out.splitlines():
        index, _, temp = line.partition(",")
        try:
            temps[int(index)] = float(temp)
        except ValueError:
            continue
    return temps


def gpu_status() -> list[dict[str, Any]]:
    """One dict per CUDA device: ``index``, ``name``, ``temperature_c``, ``memory_used_bytes``,
    ``memory_total_bytes`` (``None`` where unreadable); ``[]`` without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        n = torch.cuda.device_count()
    except Exception:
        return []
    smi: Optional[dict[int, float]] = None
    out = []
    for i in range(n):
        row: dict[str, Any] = {
            "index": i,
            "name": None,
            "temperature_c": None,
            "memory_used_bytes": None,
            "memory_total_bytes": None,
        }
        try:
            row["name"] = torch.cuda.get_device_name(i)
            free, total = torch.cuda.mem_get_info(i)  # the whole device's, every process included
            row["memory_used_bytes"], row["memory_total_bytes"] = int(total - free), int(total)
        except Exception:
            pass
        try:
            row["temperature_c"] = float(torch.cuda.temperature(i))  # needs pynvml
        except Exception:
            smi = _smi_temperatures() if smi is None else smi
            row["temperature_c"] = smi.get(i)
        out.append(row)
    return out


def gpu_temperatures() -> list[float]:
    """Each CUDA device's temperature in °C (unreadable ones left out); ``[]`` without CUDA."""
    return [r["temperature_c"] for r in gpu_status() if r["temperature_c"] is not None]


class TempHold:
    """The scheduler's hold: no queued run starts while a device reads over ``max_temp`` °C.

    ``read`` returns the temperatures now (default :func:`gpu_temperatures`); it is read at most
    every ``every_s`` seconds. ``reason`` is why runs are held, or ``None``."""

    def __init__(
        self,
        max_temp: Optional[float],
        read: Optional[Callable[[], list[float]]] = None,
        every_s: float = 5.0,
    ) -> None:
        self.max_temp, self.read, self.every_s = max_temp, read or gpu_temperatures, every_s
        self.reason: Optional[str] = None
        self._checked = -float("inf")

    def held(self) -> bool:
        if self.max_temp is None:
            return False
        now = time.monotonic()
        if now - self._checked >= self.every_s:
            self._checked = now
            try:
                hot = [t for t in self.read() if t > self.max_temp]
            except Exception as e:  # an unreadable sensor does not stop the queue; it is reported
                hot, self.reason = [], None
                print(
                    f"ampkit serve: cannot read the GPU temperature: {type(e).__name__}: {e}",
                    file=sys.stderr,
                )
            self.reason = (
                (
                    f"a device is at {max(hot):g} °C, over this server's limit of {self.max_temp:g} °C "
                    "(ampkit serve --max_gpu_temp): queued runs wait"
                )
                if hot
                else None
            )
        return self.reason is not None
