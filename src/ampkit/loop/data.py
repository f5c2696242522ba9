"""Local data, nothing downloaded: the Python standard library's own source as a byte corpus.

Batches are a pure function of ``(seed, index)``: batch ``i`` is the same in every process,
so a resumed run sees exactly the batches an uninterrupted run would (the data position is
just the next index).
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ClassificationBatches", "ImageBatches", "TextBatches", "batch_size", "split_batch", "stdlib_corpus"]


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Up to ``max_bytes`` of the stdlib's ``.py`` sources (sorted, so identical everywhere) as uint8."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        if total >= max_bytes:
            break
    if total < 10_000:
        raise RuntimeError(f"found only {total} bytes of Python source under {root!r}; cannot build the corpus")
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


@dataclass
class TextBatches:
    """Random windows of the stdlib corpus: ``batches(i)`` -> ``(x, y)`` int64 ``[batch, block]``.

    The last ``val_fraction`` of the corpus is held out; ``split="val"`` samples from it.
    """

    batch_size: int = 16
    block_size: int = 128
    seed: int = 0
    split: str = "train"
    val_fraction: float = 0.1
    device: Optional[torch.device] = None
    max_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.block_size < 1:
            raise ValueError(f"batch_size={self.batch_size} and block_size={self.block_size} must be >= 1")
        if self.split not in ("train", "val"):
            raise ValueError(f"split={self.split!r}; choose 'train' or 'val'")
        corpus = stdlib_corpus(self.max_bytes)
        cut = int(len(corpus) * (1 - self.val_fraction))
        self._data = corpus[:cut] if self.split == "train" else corpus[cut:]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    @property
    def batches_per_epoch(self) -> int:
        """Batches that together hold as many tokens as the split (windows are random, so an
        epoch is a token count, not a permutation)."""
        return max(1, len(self._data) // self.tokens_per_batch)

    @property
    def samples_per_batch(self) -> int:
        return self.batch_size

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + (7 if self.split == "val" else 0))
        starts = torch.randint(len(self._data) - self.block_size - 1, (self.batch_size,), generator=g)
        offsets = torch.arange(self.block_size + 1)
        windows = self._data[starts[:, None] + offsets].long()
        x, y = windows[:, :-1], windows[:, 1:]
        if self.device is not None and self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y


class _Generated:
    """What the generated datasets share: no tokens, and a fixed number of samples per epoch."""

    batch_size: int
    epoch_samples: int

    @property
    def tokens_per_batch(self) -> Optional[int]:
        return None

    @property
    def samples_per_batch(self) -> int:
        return self.batch_size

    @property
    def batches_per_epoch(self) -> int:
        return max(1, self.epoch_samples // self.batch_size)


@dataclass
class ClassificationBatches(_Generated):
    """Gaussian features labelled by a fixed random teacher network: learnable, and local."""

    batch_size: int = 64
    in_features: int = 256
    n_classes: int = 10
    seed: int = 0
    device: Optional[torch.device] = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        g = torch.Generator().manual_seed(10_007 + self.seed)
        self._teacher = torch.randn(self.in_features, self.n_classes, generator=g) / self.in_features**0.5

    epoch_samples: int = 10_000  # generated data has no natural epoch; this many samples make one

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = torch.randn(self.batch_size, self.in_features, generator=g)
        y = (x @ self._teacher).argmax(dim=1)
        if self.device is not None and self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y


@dataclass
class ImageBatches(_Generated):
    """Generated image-like data: class ``k`` adds a fixed smooth random pattern to noise."""

    batch_size: int = 32
    image_size: int = 32
    n_classes: int = 10
    seed: int = 0
    device: Optional[torch.device] = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.image_size < 4:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1 and image_size={self.image_size} >= 4")
        g = torch.Generator().manual_seed(20_011 + self.seed)
        coarse = torch.randn(self.n_classes, 3, 4, 4, generator=g)
        self._patterns = torch.nn.functional.interpolate(coarse, size=self.image_size, mode="bilinear",
                                                         align_corners=False)

    epoch_samples: int = 10_000  # generated data has no natural epoch; this many samples make one

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        y = torch.randint(self.n_classes, (self.batch_size,), generator=g)
        x = torch.randn(self.batch_size, 3, self.image_size, self.image_size, generator=g) + self._patterns[y]
        if self.device is not None and self.device.type != "cpu":
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        return x, y


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor with one."""
    for t in (batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else [batch]):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise TypeError("cannot split this batch: it holds no tensor with a batch dimension")


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut into ``parts`` micro-batches along dim 0 (tensors; other values repeated)."""
    if parts == 1:
        return [batch]

    def cut(t: Any) -> list[Any]:
        return list(torch.tensor_split(t, parts)) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * parts

    if isinstance(batch, dict):
        cols = {k: cut(v) for k, v in batch.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(parts)]
    if isinstance(batch, (tuple, list)):
        cols = [cut(v) for v in batch]
        return [type(batch)(c[i] for c in cols) for i in range(parts)]
    return cut(batch)
