"""The devices a plan can be made for -- from any machine, a CUDA GPU included from a CPU-only one.

``ampkit plan --device h100-80gb`` plans the training step on fake CPU tensors (nothing is
allocated, no GPU is needed) and counts what that GPU would hold instead of what the CPU's kernels
hold. Four things differ, and each is modelled here:

* **The caching allocator's blocks.** PyTorch's CUDA allocator (``c10/cuda/CUDACachingAllocator.cpp``)
  rounds every request up to 512 bytes (``kMinBlockSize``); requests of 1 MiB or less are packed
  into 2 MiB segments (``kSmallBuffer``), those between 1 and 10 MiB (``kMinLargeAlloc``) are cut
  from 20 MiB segments (``kLargeBuffer``) shared with others, and larger ones get a segment of
  their own rounded up to 2 MiB (``kRoundLarge``). :meth:`GPU.block_bytes` is what one tensor takes:
  512-byte rounding, and a whole 2 MiB-rounded segment from 10 MiB on (what ``memory_reserved``
  counts for it; a remainder under 1 MiB is not split off for another tensor).
* **The libraries' workspaces**, which no tensor holds: cuBLAS keeps one workspace per handle and a
  training step uses two (the forward's thread and autograd's device thread); the size is torch's
  default for the architecture (``:4096:8``, 32 MiB, from Hopper on; ``:4096:2:16:8`` before), or
  ``CUBLAS_WORKSPACE_CONFIG`` when set (:func:`ampkit.plan.session.cuda_workspace_bytes`,
  measured on an H200). cuDNN's workspace is taken per convolution call, inside the step's
  temporaries of a CNN; a transformer's step calls none.
* **What is not the allocator's**: the CUDA context and the kernels loaded into it
  (:data:`CONTEXT_BYTES`, an allowance: CUDA 12 loads modules lazily), and the fragmentation
  of the cached segments (:data:`FRAGMENTATION` of what is left: the largest batch under an 8 GiB
  cap on an H200 was 3-6% below the allocated-bytes estimate, docs/benchmarks.md §21). The budget
  a step may take is the device's memory less both (:meth:`GPU.budget`).
* **Attention's kernels.** A GPU runs ``scaled_dot_product_attention`` with a fused kernel (flash or
  memory-efficient) even with dropout: it saves the output and a row of log-sum-exp, never the
  attention matrix. The CPU runs the dropout case with the math kernel, which keeps the matrix;
  :func:`gpu_attention` makes the fake step take the fused path (dropout's randomness does not
  change a byte it keeps, only two RNG scalars).

The table is the memory each card reports (``nvidia-smi``'s total, MiB), its compute capability,
and whether it runs bf16 and fp8 (a plan for a card without bf16 refuses the bf16 rows).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "CONTEXT_BYTES",
    "DEVICES",
    "FRAGMENTATION",
    "GPU",
    "FLAGS",
    "current",
    "figures_for",
    "gpu_attention",
    "parse_device",
    "plan_budget",
    "use",
]

MiB = 1 << 20
SMALL = 1 << 20  # kSmallSize: the largest request packed into 2 MiB small segments
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: from here a request gets a segment of its own
ROUND_LARGE = 2 * MiB  # kRoundLarge: such a segment's rounding
MIN_BLOCK = 512  # kMinBlockSize: every request's rounding
CONTEXT_BYTES = (
    768 * MiB
)  # the CUDA context with torch's and cuBLAS's kernels loaded (lazy loading)
FRAGMENTATION = 0.03  # of the memory left after the context: cached segments no request fits
#: what the messages call the device and the memory: ``ampkit plan``'s flags (the REST planner names
#: its body's fields, ``("device", "gpu_memory_gb")``)
FLAGS = ("--device", "--memory")


@dataclass(frozen=True)
class GPU:
    """A CUDA device a plan is made for: ``name`` (the table's key), ``label`` (what the card calls
    itself), ``memory_bytes`` (its total; None for ``cuda``: give ``--memory``), the compute
    ``capability``, and bf16 / fp8 support."""

    name: str
    label: str
    memory_bytes: Optional[int]
    capability: tuple[int, int]
    bf16: bool = True
    fp8: bool = False

    def block_bytes(self, nbytes: int) -> int:
        """What the caching allocator takes for a tensor of ``nbytes`` (module docstring)."""
        if nbytes >= MIN_LARGE_ALLOC:
            return -(-nbytes // ROUND_LARGE) * ROUND_LARGE
        return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)

    def workspace_bytes(self) -> int:
        """cuBLAS's two workspaces for this architecture (``CUBLAS_WORKSPACE_CONFIG`` when set)."""
        cfg = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "") or (
            ":4096:8" if self.capability[0] >= 9 else ":4096:2:16:8"
        )
        try:
            nums = [int(x) for x in cfg.strip(":").split(":")]
            per_handle = sum(size * count for size, count in zip(nums[::2], nums[1::2])) * 1024
        except ValueError:
            per_handle = 32 * MiB
        return 2 * per_handle

    def budget(self, memory: Optional[int] = None, flags: tuple[str, str] = FLAGS) -> int:
        """The bytes a training step may take: ``memory`` (``--memory``, at most the device's) or the
        device's, less the CUDA context and the fragmentation allowance. ``flags``: what the
        messages call the device and the memory (:data:`FLAGS`)."""
        device, mem = flags
        total = memory if memory is not None else self.memory_bytes
        if total is None:
            raise ValueError(
                f"{device} {self.name}: the memory of an unnamed CUDA device is not known here; give "
                f"{mem} or a named device ({', '.join(n for n in DEVICES if n != 'cuda')})"
            )
        if self.memory_bytes is not None and total > self.memory_bytes:
            raise ValueError(
                f"{mem} {total / 2**30:.2f} GiB is more than the {self.label}'s "
                f"{self.memory_bytes / 2**30:.2f} GiB"
            )
        left = total - CONTEXT_BYTES
        if left <= 0:
            raise ValueError(
                f"{mem} {total / 2**20:,.0f} MiB is no more than the CUDA context alone "
                f"({CONTEXT_BYTES / 2**20:,.0f} MiB)"
            )
        return int(left * (1 - FRAGMENTATION))

    def refuses(self, precision: str) -> Optional[str]:
        """Why this device cannot run ``precision`` (a plan row's reason), or None: the precision's
        registry row says what it needs (bf16 compute, the fp8 hardware flag)."""
        import torch

        from ..step.precision import REGISTRY

        row = REGISTRY.get(precision.partition(":")[0])
        if row is None:
            return None
        sm = f"sm_{self.capability[0]}{self.capability[1]}"
        lacks = []  # everything the row needs that the device lacks, not only the first
        if torch.bfloat16 in (row.compute_dtype, row.param_dtype) and not self.bf16:
            lacks.append("bf16")
        if row.hardware is not None and not getattr(self, row.hardware, False):
            lacks.append(f"{row.hardware} matmuls")  # the row's DeviceInfo flag
        return f"the {self.label} ({sm}) has no {' and no '.join(lacks)}" if lacks else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.name,
            "device_name": self.label,
            "device_memory_bytes": self.memory_bytes,
            "capability": list(self.capability),
            "supports_bf16": self.bf16,
            "supports_fp8": self.fp8,
        }


def _gpu(name: str, label: str, mib: Optional[int], cap: tuple[int, int], fp8: bool = False) -> GPU:
    return GPU(
        name, label, mib * MiB if mib is not None else None, cap, bf16=cap >= (8, 0), fp8=fp8
    )


#: the named devices: nvidia-smi's total memory (MiB) of each card
DEVICES: dict[str, GPU] = {
    g.name: g
    for g in (
        _gpu("cuda", "CUDA GPU (Hopper-class, of the memory given)", None, (9, 0), fp8=True),
        _gpu("h200-141gb", "NVIDIA H200 141GB", 143771, (9, 0), fp8=True),
        _gpu("h100-80gb", "NVIDIA H100 80GB HBM3", 81559, (9, 0), fp8=True),
        _gpu("a100-80gb", "NVIDIA A100 80GB", 81920, (8, 0)),
        _gpu("a100-40gb", "NVIDIA A100 40GB", 40960, (8, 0)),
        _gpu("l40s-48gb", "NVIDIA L40S", 46068, (8, 9), fp8=True),
        _gpu("a6000-48gb", "NVIDIA RTX A6000", 49140, (8, 6)),
        _gpu("l4-24gb", "NVIDIA L4", 23034, (8, 9), fp8=True),
        _gpu("a10g-24gb", "NVIDIA A10G", 23028, (8, 6)),
        _gpu("rtx4090-24gb", "NVIDIA GeForce RTX 4090", 24564, (8, 9), fp8=True),
        _gpu("t4-16gb", "NVIDIA T4", 15360, (7, 5)),
        _gpu("v100-32gb", "NVIDIA V100 32GB", 32768, (7, 0)),
    )
}


def parse_device(name: str, flag: str = FLAGS[0]) -> Optional[GPU]:
    """``--device``: ``cpu`` (None: the CPU's own kernels, no allocator) or a name of :data:`DEVICES`
    (case and ``_`` for ``-`` are forgiven); anything else is a clear error listing the choices
    (``flag``: what it calls the value, :data:`FLAGS`)."""
    key = str(name).strip().lower().replace("_", "-")
    if key == "cpu":
        return None
    if key in DEVICES:
        return DEVICES[key]
    near = [d for d in DEVICES if d.startswith(key + "-")] or difflib.get_close_matches(
        key, list(DEVICES), n=1
    )
    hint = (
        f" (did you mean {near[0]!r}?)"
        if len(near) == 1
        else f" (did you mean one of {', '.join(map(repr, near))}?)"
        if near
        else ""
    )
    raise ValueError(
        f"{flag} {name!r} is not a device a plan knows{hint}; choose cpu or one of: "
        f"{', '.join(DEVICES)}"
    )


def plan_budget(
    target: Optional[GPU], memory: Optional[int], flags: tuple[str, str] = FLAGS
) -> int:
    """The bytes a plan's step may take on ``target`` (None: the CPU) given ``memory`` (None: not
    given): the CPU's is ``memory`` itself, which it needs; a GPU's is :meth:`GPU.budget`."""
    if target is not None:
        return target.budget(memory, flags)
    if memory is None:
        raise ValueError(
            f"{flags[1]} is needed for a plan of the CPU (its memory budget); or name the GPU the "
            f"plan is for: {flags[0]} h100-80gb"
        )
    return memory


def figures_for(target: Optional[GPU]) -> tuple[str, str]:
    """``(device, its name)`` a plan's figures are for: ``target``'s (its allocator, workspaces
    and fused attention, planned on fake CPU tensors), else this CPU's (its kernels' memory)."""
    if target is not None:
        return target.name, target.label
    from ..step.hardware import device_info, normalize_device

    return "cpu", device_info(normalize_device("cpu")).name


_CURRENT: contextvars.ContextVar[Optional[GPU]] = contextvars.ContextVar(
    "ampkit_plan_device", default=None
)


@contextlib.contextmanager
def use(device: Optional[GPU]) -> Iterator[None]:
    """Estimates made inside the block count ``device``'s memory (None: the CPU's, as measured)."""
    token = _CURRENT.set(device)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Optional[GPU]:
    """The device of the enclosing :func:`use`, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def gpu_attention() -> Iterator[None]:
    """Inside the block ``torch.nn.functional.scaled_dot_product_attention`` runs without dropout: on
    the CPU that is the fused (flash) kernel, which keeps what a GPU's fused kernel keeps with
    dropout (the output and the log-sum-exp rows; the math kernel the CPU takes for dropout keeps
    the whole attention matrix). The function is swapped on ``torch.nn.functional`` itself, not in a
    ``TorchFunctionMode``: a checkpointed block's recomputation in the backward does not see the
    modes of the forward, and would save other tensors than its forward did. Estimates hold a lock
    (:data:`ampkit.plan.session.LOCK`), so no other estimate runs meanwhile."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        return original(query, key, value, attn_mask, 0.0, *args, **kwargs)

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
