"""Built-in models, built from configs (no downloads): a byte-level tiny GPT, an MLP and a CNN.

Each model returns its loss from ``forward`` when given targets, so a training loop needs no
model-specific loss code. ``build(name, size)`` is what the CLI uses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CNN",
    "CNNConfig",
    "GPT",
    "GPTConfig",
    "MLP",
    "MLPConfig",
    "MODELS",
    "SIZES",
    "build",
    "builtin",
    "load_factory",
    "user_model",
]


@dataclass(frozen=True)
class GPTConfig:
    """A GPT-2 style decoder. ``vocab_size=256``: bytes, so any text is its own tokenization."""

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = _Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Tiny GPT: ``forward(idx, targets=None)`` returns logits, or the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # GPT-2: scale residual projections by 1/sqrt(2 * n_layer)
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # cross_entropy autocasts to fp32: the loss is computed in full precision.
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@dataclass(frozen=True)
class MLPConfig:
    in_features: int = 256
    hidden: int = 1024
    n_layer: int = 3
    n_classes: int = 10

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if v < 1:
                raise ValueError(f"MLPConfig.{name}={v} must be >= 1")


class MLP(nn.Module):
    """A plain MLP classifier: ``forward(x, targets=None)`` returns logits or the loss."""

    def __init__(self, cfg: MLPConfig = MLPConfig()) -> None:
        super().__init__()
        self.config = cfg
        layers: list[nn.Module] = []
        width = cfg.in_features
        for _ in range(cfg.n_layer):
            layers += [nn.Linear(width, cfg.hidden), nn.GELU()]
            width = cfg.hidden
        layers.append(nn.Linear(width, cfg.n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.net(x)
        return logits if targets is None else F.cross_entropy(logits, targets)


@dataclass(frozen=True)
class CNNConfig:
    channels: int = 32
    n_blocks: int = 2
    image_size: int = 32
    n_classes: int = 10

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if v < 1:
                raise ValueError(f"CNNConfig.{name}={v} must be >= 1")


class CNN(nn.Module):
    """A small conv net with BatchNorm (the layer mixed precision must treat with care)."""

    def __init__(self, cfg: CNNConfig = CNNConfig()) -> None:
        super().__init__()
        self.config = cfg
        layers: list[nn.Module] = []
        c_in, c = 3, cfg.channels
        for _ in range(cfg.n_blocks):
            layers += [
                nn.Conv2d(c_in, c, 3, padding=1, bias=False),
                nn.BatchNorm2d(c),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            c_in, c = c, c * 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, cfg.n_classes)

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.head(self.features(x).mean(dim=(2, 3)))
        return logits if targets is None else F.cross_entropy(logits, targets)


SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {
        "tiny": dict(block_size=64, n_layer=2, n_head=2, n_embd=64),
        "small": dict(block_size=128, n_layer=4, n_head=4, n_embd=128),
        "medium": dict(block_size=256, n_layer=6, n_head=6, n_embd=384),
        "large": dict(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    },
    "mlp": {
        "tiny": dict(in_features=64, hidden=128, n_layer=2),
        "small": dict(in_features=256, hidden=1024, n_layer=3),
        "medium": dict(in_features=1024, hidden=4096, n_layer=4),
        "large": dict(in_features=4096, hidden=8192, n_layer=6),
    },
    "cnn": {
        "tiny": dict(channels=8, n_blocks=2, image_size=16),
        "small": dict(channels=32, n_blocks=2, image_size=32),
        "medium": dict(channels=64, n_blocks=3, image_size=64),
        "large": dict(channels=128, n_blocks=4, image_size=128),
    },
}
MODELS = tuple(SIZES)


def config_of(name: str, size: str = "small") -> Any:
    """The configuration of a built-in model (``GPTConfig``, ``MLPConfig``, ``CNNConfig``) by name and size."""
    if name not in SIZES:
        raise ValueError(
            f"unknown built-in model {name!r}; choose one of: {', '.join(MODELS)} "
            "(or give your own as module:factory)"
        )
    if size not in SIZES[name]:
        raise ValueError(
            f"unknown size {size!r} for model {name!r}; choose one of: {', '.join(SIZES[name])}"
        )
    kwargs = SIZES[name][size]
    return (
        GPTConfig(**kwargs)
        if name == "gpt"
        else CNNConfig(**kwargs)
        if name == "cnn"
        else MLPConfig(**kwargs)
    )


def build(name: str, size: str = "small") -> nn.Module:
    """Build a built-in model by name (``gpt``, ``mlp``) and size (``tiny``/``small``/``medium``/``large``)."""
    cfg = config_of(name, size)
    return GPT(cfg) if name == "gpt" else CNN(cfg) if name == "cnn" else MLP(cfg)


def _closest_model(spec: str, names: list[str]) -> str:
    """What ``spec`` (no model ampkit knows) was probably meant to be, as ``" (did you mean
    'gpt'?)"``: a model's name, or the config file it names without ``.json``; a directory
    without a config.json says so; else ``""``."""
    import difflib
    import os

    if os.path.isdir(spec):
        return f" ({spec} holds no config.json)"
    close = difflib.get_close_matches(spec, names, n=1, cutoff=0.6)
    if not close and os.path.isfile(spec + ".json"):
        close = [spec + ".json"]
    return f" (did you mean {close[0]!r}?)" if close else ""


def load_factory(spec: str) -> Any:
    """Import ``package.module:factory`` and return the callable. Clear errors when it does not resolve."""
    import importlib
    import os
    import sys

    from .hf_configs import ALIASES

    if ":" not in spec:
        raise ValueError(
            f"model {spec!r} is neither a built-in ({', '.join(MODELS)}), a Hugging Face config "
            f"({', '.join(ALIASES)}, transformers.<Name>Config, a config.json or a model directory "
            f"holding one) nor 'module:factory'{_closest_model(spec, list(MODELS) + list(ALIASES))}"
        )
    mod_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # let users name a module in the current directory
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"cannot import {mod_name!r} from --model {spec!r}: {e}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{mod_name!r} has no callable {attr!r} (from --model {spec!r})")
    return factory


def user_model(spec: str, **kwargs: Any) -> tuple[nn.Module, Any]:
    """Call a ``module:factory`` and check what it returned.

    The factory returns ``(model, batch_fn)``: ``model`` an ``nn.Module`` whose
    ``model(*batch)`` returns the scalar loss, and ``batch_fn(i)`` the i-th batch (a tuple of
    inputs). Keyword arguments the factory accepts (``batch_size``, ``seed``, ``size``,
    ``device``) are passed to it.
    """
    import inspect

    factory = load_factory(spec)
    params = inspect.signature(factory).parameters
    accepted = {
        k: v
        for k, v in kwargs.items()
        if k in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    }
    try:
        out = factory(**accepted)
    except TypeError as e:
        raise ValueError(
            f"calling factory {spec!r} failed: {e}; a factory takes no arguments or some of "
            "batch_size, seed, size, device, and returns (model, batch_fn)"
        ) from None
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], nn.Module)
        and callable(out[1])
    ):
        raise ValueError(
            f"factory {spec!r} must return (model, batch_fn): an nn.Module whose model(*batch) "
            f"returns the scalar loss, and a function batch_fn(i) -> batch tuple; got "
            f"{type(out).__name__}{'' if not isinstance(out, tuple) else ' of ' + str(len(out))}"
        )
    return out


def builtin(
    name: str,
    size: str = "small",
    *,
    batch_size: int = 16,
    seed: int = 0,
    device: Optional[torch.device] = None,
    meta: bool = False,
) -> tuple[nn.Module, Any]:
    """A built-in model and its local data: ``(model, batch_fn)``, like a user factory. ``meta``:
    the data only (the model is None: a caller that wants the data's shapes builds nothing)."""
    from .data import ClassificationBatches, ImageBatches, TextBatches

    cfg = config_of(name, size)
    model: Any = None if meta else build(name, size)
    if name == "gpt":
        data: Any = TextBatches(
            batch_size=batch_size, block_size=cfg.block_size, seed=seed, device=device
        )
    elif name == "cnn":
        data = ImageBatches(
            batch_size=batch_size,
            image_size=cfg.image_size,
            n_classes=cfg.n_classes,
            seed=seed,
            device=device,
        )
    else:
        data = ClassificationBatches(
            batch_size=batch_size,
            in_features=cfg.in_features,
            n_classes=cfg.n_classes,
            seed=seed,
            device=device,
        )
    return model, data
