"""``batch_size="auto"``: the largest micro-batch that fits a memory budget, chosen before the run.

The data's batch (``batches(0)``) is the effective batch the user asked for; ampkit keeps it and
cuts it into ``split`` equal micro-batches, accumulating over them (so the gradient math is that of
the whole batch). ``split`` is the smallest divisor of the batch whose micro-batch fits the budget
by :func:`ampkit.plan.estimate.estimate` (fake tensors; nothing allocated). On CUDA the budget defaults
to the device's memory this process can still use, and the first real window confirms the
choice: an ``OutOfMemoryError`` there is handled by the Trainer's out-of-memory recovery (halve
the micro-batch, double the accumulation, redo the window), so no step is lost -- Composer's
auto-microbatching, started from the estimate rather than from the full batch. On a CPU a budget
must be given (there is no device limit to read).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Union

import torch

from ..models.data import batch_size, split_batch
from .estimate import estimate, parse_bytes

__all__ = ["AutoBatch", "HEADROOM", "check_auto_args", "choose_split", "device_budget"]

HEADROOM = (
    0.9  # of the CUDA memory left to this process: fragmentation and what the estimate misses
)


@dataclass(frozen=True)
class AutoBatch:
    """The chosen cut of each batch: ``split`` micro-batches of ``micro_batch`` samples."""

    batch: int
    split: int
    micro_batch: int
    budget_bytes: int
    predicted_bytes: int
    reason: str


def check_auto_args(batch_size: Any, memory_budget: Any, world_size: int) -> None:
    """The Trainer's ``batch_size``/``memory_budget`` arguments, checked at construction."""
    if batch_size not in (None, "auto"):
        raise ValueError(
            f"batch_size={batch_size!r}; choose 'auto' (the largest micro-batch of the data's "
            "batches that fits memory_budget) or None (the batches as they come)"
        )
    if memory_budget is not None:
        if batch_size != "auto":
            raise ValueError(
                f"memory_budget={memory_budget!r} is only used with batch_size='auto' (got batch_size={batch_size!r})"
            )
        parse_bytes(memory_budget)  # a bad budget fails here, not at fit()
    if batch_size == "auto" and world_size > 1:
        raise ValueError(
            "batch_size='auto' chooses for one process; under DDP/FSDP give each rank's batch "
            "(`ampkit plan` predicts it)"
        )


def device_budget(device: torch.device, memory_budget: Union[str, int, float, None]) -> int:
    """Bytes to fit: ``memory_budget`` parsed, else on CUDA ``HEADROOM`` x (free + this process's
    cached memory); on other devices a budget must be given."""
    if memory_budget is not None:
        return parse_bytes(memory_budget)
    if device.type != "cuda":
        raise ValueError(
            f"batch_size='auto' needs a memory budget on {device.type} (e.g. memory_budget='8GiB'); "
            "only on CUDA is the device's free memory the default budget"
        )
    free, _ = torch.cuda.mem_get_info(device)
    return int(HEADROOM * (free + torch.cuda.memory_reserved(device)))


def _same_optimizer(optimizer: torch.optim.Optimizer) -> Any:
    """A factory for a fresh optimizer of the same class and settings (for the fake step). Where
    the class has a fused implementation it is used: a non-fused step reads the skip decision on the
    host, which fake tensors cannot (a foreach step's temporaries can be larger than fused's)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if "fused" in accepted:
        kwargs["fused"] = True
        if "foreach" in accepted:
            kwargs["foreach"] = None
    return lambda params: type(optimizer)(params, **kwargs)


def choose_split(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: str,
    device: torch.device,
    batch: Any,
    budget: int,
) -> AutoBatch:
    """The smallest divisor ``split`` of the batch whose micro-batch's predicted peak fits ``budget``."""
    n = batch_size(batch)
    if n < 1:
        raise ValueError(
            "batch_size='auto' needs batches with a leading batch dimension (tensors of shape [B, ...])"
        )
    divisors = [s for s in range(1, n + 1) if n % s == 0]
    opt = _same_optimizer(optimizer)
    seen: dict[int, int] = {}

    def peak(split: int) -> int:
        if split not in seen:
            micro = split_batch(batch, split)[0]
            seen[split] = estimate(model, micro, opt, precision, device=device).peak_bytes
        return seen[split]

    if peak(divisors[-1]) > budget:
        raise ValueError(
            f"memory budget {budget / 2**20:,.0f} MiB: not even a micro-batch of 1 fits "
            f"({seen[divisors[-1]] / 2**20:,.0f} MiB predicted in {precision}); give more memory, "
            "a smaller model, or a half precision"
        )
    lo, hi = (
        0,
        len(divisors) - 1,
    )  # divisors[hi] fits; find the first that fits (peak falls with the split)
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(divisors[mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    split = divisors[hi]
    micro = n // split
    reason = (
        f"micro-batch {micro} ({'the whole batch' if split == 1 else f'batch {n} cut in {split}'}): "
        f"predicted peak {seen[split] / 2**20:,.0f} MiB in {precision} fits the budget of "
        f"{budget / 2**20:,.0f} MiB"
    )
    if split > 1:
        reason += (
            f"; micro-batch {n // divisors[hi - 1]} would need {seen[divisors[hi - 1]] / 2**20:,.0f} MiB"
            if divisors[hi - 1] in seen
            else ""
        )
    return AutoBatch(
        batch=n,
        split=split,
        micro_batch=micro,
        budget_bytes=budget,
        predicted_bytes=seen[split],
        reason=reason,
    )
