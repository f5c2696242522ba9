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

__all__ = [
    "ClassificationBatches",
    "ImageBatches",
    "TextBatches",
    "TextSamples",
    "batch_size",
    "load_texts",
    "split_batch",
    "stdlib_corpus",
]


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 4 << 20) -> torch.Tensor:
    """Up to ``max_bytes`` of the stdlib's ``.py`` sources (sorted, so identical everywhere) as uint8."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__")
        )
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
        raise RuntimeError(
            f"found only {total} bytes of Python source under {root!r}; cannot build the corpus"
        )
    blob = b"".join(chunks)[:max_bytes]
    from torch.utils._python_dispatch import _disable_current_modes

    # cached for the whole process: made real even when the first call runs under a fake-tensor
    # (or any dispatch) mode -- `ampkit plan` shapes its batches inside the estimate's fake mode
    with _disable_current_modes():
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
    path: Optional[str] = None  # a text file to use instead of the stdlib corpus

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.block_size < 1:
            raise ValueError(
                f"batch_size={self.batch_size} and block_size={self.block_size} must be >= 1"
            )
        if self.split not in ("train", "val"):
            raise ValueError(f"split={self.split!r}; choose 'train' or 'val'")
        corpus = (
            stdlib_corpus(self.max_bytes)
            if self.path is None
            else _file_bytes(self.path, self.max_bytes)
        )
        if len(corpus) * min(self.val_fraction, 1 - self.val_fraction) < self.block_size + 2:
            raise ValueError(
                f"{self.path or 'the corpus'} holds {len(corpus)} bytes: too few for windows of "
                f"{self.block_size} tokens in both splits; give more text or a smaller block size"
            )
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
        g = torch.Generator().manual_seed(
            self.seed * 1_000_003 + index + (7 if self.split == "val" else 0)
        )
        starts = torch.randint(
            len(self._data) - self.block_size - 1, (self.batch_size,), generator=g
        )
        offsets = torch.arange(self.block_size + 1)
        windows = self._data[starts[:, None] + offsets].long()
        x, y = windows[:, :-1], windows[:, 1:]
        return _on(self.device, x, y)


def _on(
    device: Optional[torch.device], x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch moved to ``device`` (asynchronously; CPU batches stay as they are)."""
    if device is not None and device.type != "cpu":
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return x, y


def _file_bytes(path: str, max_bytes: int) -> torch.Tensor:
    with open(path, "rb") as f:
        blob = f.read(max_bytes)
    return (
        torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()
        if blob
        else torch.zeros(0, dtype=torch.uint8)
    )


def load_texts(path: str) -> list[str]:
    """Texts from ``.json`` (a list of strings, or ``{"texts": [...]}``) or ``.jsonl`` (a string or
    ``{"text": ...}`` per line)."""
    import json

    with open(path, encoding="utf-8") as f:
        if path.endswith(".jsonl"):
            items = [json.loads(line) for line in f if line.strip()]
        else:
            items = json.load(f)
    if isinstance(items, dict):
        items = items.get("texts")
    texts = [t.get("text") if isinstance(t, dict) else t for t in (items or [])]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError(
            f'{path}: expected a list of strings (or {{"texts": [...]}}; .jsonl: one string or '
            '{"text": ...} per line)'
        )
    return texts


@dataclass
class TextSamples:
    """One sample per text (bytes as tokens), padded to a common length: ``batches(i)`` -> ``(x, y)``
    int64 ``[batch, length]`` with ``y`` the next byte and ``-100`` (ignored by the loss) on padding.

    Each epoch visits every text once in a seeded random order; a last partial batch is filled from
    the start of the next order, so every batch has ``batch_size`` samples.
    """

    texts: list[str]
    batch_size: int = 8
    max_length: int = 512
    seed: int = 0
    device: Optional[torch.device] = None
    path: Optional[str] = None  # the file the texts came from (recorded in checkpoints), if any

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_length < 1:
            raise ValueError(
                f"batch_size={self.batch_size} and max_length={self.max_length} must be >= 1"
            )
        encoded = [t.encode("utf-8")[: self.max_length + 1] for t in self.texts]
        short = [i for i, b in enumerate(encoded) if len(b) < 2]
        if not encoded or short:
            raise ValueError(
                f"texts {short} have fewer than 2 bytes: each text needs at least one next byte to "
                "predict"
                if encoded
                else "no texts given"
            )
        self._orders: dict[int, list[int]] = {}
        length = max(len(b) for b in encoded) - 1
        self._x = torch.zeros(len(encoded), length, dtype=torch.long)
        self._y = torch.full((len(encoded), length), -100, dtype=torch.long)
        for i, b in enumerate(encoded):
            t = torch.tensor(list(b), dtype=torch.long)
            self._x[i, : len(b) - 1], self._y[i, : len(b) - 1] = t[:-1], t[1:]

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if len(self._orders) > 4:
                self._orders.clear()
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(len(self.texts), generator=g).tolist()
        return self._orders[epoch]

    @property
    def length(self) -> int:
        return self._x.shape[1]

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.texts) // self.batch_size)

    @property
    def samples_per_batch(self) -> int:
        return self.batch_size

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.length

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.texts)
        first = index * self.batch_size
        rows = []
        for k in range(first, first + self.batch_size):
            epoch, pos = divmod(k, n)
            rows.append(self._order(epoch)[pos])
        x, y = self._x[rows], self._y[rows]
        return _on(self.device, x, y)


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
        self._teacher = (
            torch.randn(self.in_features, self.n_classes, generator=g) / self.in_features**0.5
        )

    epoch_samples: int = 10_000  # generated data has no natural epoch; this many samples make one

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = torch.randn(self.batch_size, self.in_features, generator=g)
        y = (x @ self._teacher).argmax(dim=1)
        return _on(self.device, x, y)


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
            raise ValueError(
                f"batch_size={self.batch_size} must be >= 1 and image_size={self.image_size} >= 4"
            )
        g = torch.Generator().manual_seed(20_011 + self.seed)
        coarse = torch.randn(self.n_classes, 3, 4, 4, generator=g)
        self._patterns = torch.nn.functional.interpolate(
            coarse, size=self.image_size, mode="bilinear", align_corners=False
        )

    epoch_samples: int = 10_000  # generated data has no natural epoch; this many samples make one

    def __call__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        y = torch.randint(self.n_classes, (self.batch_size,), generator=g)
        x = (
            torch.randn(self.batch_size, 3, self.image_size, self.image_size, generator=g)
            + self._patterns[y]
        )
        return _on(self.device, x, y)


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor with one."""
    for t in (
        batch.values()
        if isinstance(batch, dict)
        else batch
        if isinstance(batch, (tuple, list))
        else [batch]
    ):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise TypeError("cannot split this batch: it holds no tensor with a batch dimension")


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut into ``parts`` micro-batches along dim 0 (tensors; other values repeated)."""
    if parts == 1:
        return [batch]

    def cut(t: Any) -> list[Any]:
        return (
            list(torch.tensor_split(t, parts))
            if isinstance(t, torch.Tensor) and t.dim() > 0
            else [t] * parts
        )

    if isinstance(batch, dict):
        cols = {k: cut(v) for k, v in batch.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(parts)]
    if isinstance(batch, (tuple, list)):
        cols = [cut(v) for v in batch]
        return [type(batch)(c[i] for c in cols) for i in range(parts)]
    return cut(batch)
