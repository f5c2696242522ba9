"""Hugging Face models built from their config class -- never downloaded.

``--model gpt2`` (an alias: gpt2, llama, mistral, qwen2, bert), ``--model transformers.GPT2Config``
(any config class path) or ``--model path/to/config.json`` (a model's ``config.json``, or the
directory holding it: its ``model_type`` names the family) builds
``AutoModelForCausalLM.from_config(Config(**overrides))`` with fresh weights, wrapped so that
``model(idx, targets)`` returns the next-token loss, like the built-in GPT. Tokens are bytes
(0-255), so the config's ``vocab_size`` must be at least 256. ``overrides`` (``--model_config
n_layer=2,n_embd=64``) change the config's fields.
"""

from __future__ import annotations

import difflib
import importlib
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ALIASES",
    "CausalLM",
    "build_hf",
    "config_file",
    "hf_config",
    "is_hf",
    "parse_overrides",
]

ALIASES = {
    "gpt2": "transformers.GPT2Config",
    "llama": "transformers.LlamaConfig",
    "mistral": "transformers.MistralConfig",
    "qwen2": "transformers.Qwen2Config",
    "bert": "transformers.BertConfig",
}


def config_file(spec: str) -> Optional[str]:
    """The ``config.json`` that ``spec`` names: ``spec`` itself when it ends in ``.json``, or
    ``spec/config.json`` for a model directory (``save_pretrained``'s); else None."""
    if ":" in spec:
        return None
    if spec.endswith(".json"):
        return spec
    inside = os.path.join(spec, "config.json")
    return inside if os.path.isfile(inside) else None


def is_hf(spec: str) -> bool:
    """A config alias (``gpt2``), a dotted path to a class named ``...Config``, a ``.json`` config
    file or a model directory holding one."""
    if spec in ALIASES or config_file(spec):
        return True
    return ":" not in spec and "." in spec and spec.rsplit(".", 1)[1].endswith("Config")


def _config_file(path: str) -> tuple[Any, dict[str, Any]]:
    """The config class (by ``model_type``) and fields of a Hugging Face ``config.json`` (read here,
    nothing downloaded)."""
    import json

    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(
            f"--model {path!r}: the config file cannot be read ({e.strerror or e})"
        ) from None
    except ValueError as e:
        raise ValueError(f"--model {path!r} is not a JSON config file: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"--model {path!r}: a config file holds one JSON object (a model's config.json)"
        )
    try:
        from transformers import CONFIG_MAPPING
    except ImportError as e:
        raise ValueError(
            f"model {path!r} needs transformers (pip install 'ampkit[hf]'): {e}"
        ) from None
    kind = raw.get("model_type")
    if kind not in CONFIG_MAPPING:
        raise ValueError(
            f"--model {path!r}: model_type {kind!r} is not a transformers model family; e.g. "
            f"{', '.join(a for a in ALIASES)} (the config.json of a Hugging Face model names its own)"
        )
    fields = {
        k: v
        for k, v in raw.items()
        if k not in ("model_type", "transformers_version", "architectures")
    }
    return CONFIG_MAPPING[kind], fields


def parse_overrides(text: Optional[str]) -> dict[str, Any]:
    """``"n_layer=2,n_embd=64,tie_word_embeddings=false"`` -> ``{"n_layer": 2, ...}`` (ints,
    floats, booleans, ``none``; anything else stays a string)."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(
                f"--model_config item {item!r} is not key=value (e.g. n_layer=2,n_embd=64)"
            )
        value: Any = raw.strip()
        low = value.lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low in ("none", "null"):
            value = None
        else:
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
        key = key.strip()
        if key in out:
            raise ValueError(
                f"--model_config gives {key!r} twice ({key}={out[key]!r} and {key}={value!r}); "
                "give it once"
            )
        out[key] = value
    return out


def hf_config(spec: str, overrides: Optional[dict[str, Any]] = None) -> Any:
    """The config object for ``spec`` with ``overrides`` applied (clear errors for each failure)."""
    fields: dict[str, Any] = {}
    path = config_file(spec)
    if path:
        cls, fields = _config_file(path)
        cls_name = cls.__name__
        _refuse_mistyped_fields(path, cls, cls_name, fields)
    else:
        path = ALIASES.get(spec, spec)
        mod_name, _, cls_name = path.rpartition(".")
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            extra = (
                " (pip install 'ampkit[hf]')" if mod_name.split(".")[0] == "transformers" else ""
            )
            raise ValueError(
                f"model {spec!r} needs {mod_name!r}, which cannot be imported{extra}: {e}"
            ) from None
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise ValueError(
                f"{mod_name!r} has no config class {cls_name!r} (from --model {spec!r})"
            )
    given = dict(overrides or {})
    overrides = {**fields, **_per_layer_follows_depth(fields, given)}
    config = _made(cls, fields, cls_name)
    unknown = [k for k in overrides if not hasattr(config, k)]
    if unknown:
        names = [n for n in dir(config) if not n.startswith("_")]
        hints = [difflib.get_close_matches(k, names, n=1) for k in unknown]
        said = "; ".join(f"did you mean {h[0]!r} for {k!r}" for k, h in zip(unknown, hints) if h)
        raise ValueError(
            f"{cls_name} has no field(s) {', '.join(map(repr, unknown))} (from --model_config)"
            + (f"; {said}" if said else "")
        )
    for key, value in given.items():
        _check_field(cls_name, key, getattr(config, key), value)
    for key in SIZES:
        value = overrides.get(key)
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(
                f"{cls_name} {key}={value!r}: a size or count, it must be an integer at least 1"
            )
    config = _made(cls, overrides, cls_name) if overrides else config
    if getattr(config, "vocab_size", 256) < 256:
        raise ValueError(
            f"{cls_name}.vocab_size={config.vocab_size}: ampkit's text data is bytes, it needs >= 256"
        )
    return config


def _refuse_mistyped_fields(path: str, cls: Any, cls_name: str, fields: dict[str, Any]) -> None:
    """Refuse a config file's key that is no field of ``cls`` but nearly spells one (``n_layr``):
    transformers keeps any key as an attribute, so the model would silently get the field's
    default. Other extra keys (a saved config's ``n_ctx``, ``_name_or_path``, ...) are kept."""
    default = _made(cls, {}, cls_name)
    known = set(dir(default)) | set(getattr(cls, "attribute_map", {}))
    names = sorted(
        {n for n in default.to_dict() if not n.startswith("_")}
        | set(getattr(cls, "attribute_map", {}))
    )
    for key in fields:
        if key in known:
            continue
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.85)
        if close:
            raise ValueError(
                f"--model {path!r}: {key!r} is not a {cls_name} field (did you mean {close[0]!r}?); "
                f"the model would get {close[0]}'s default ({getattr(default, close[0], None)!r})"
            )


def _per_layer_follows_depth(fields: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given``, plus the file's ``layer_types`` (one entry per layer, which transformers writes
    into a saved config) resized to a layer count ``given`` sets, its pattern repeated: the class
    refuses a list of another length. A ``layer_types`` given too is the user's own."""
    types = fields.get("layer_types")
    if "layer_types" in given or not isinstance(types, list) or not types:
        return given
    counts = [given.get(k) for k in ("num_hidden_layers", "n_layer", "num_layers")]
    n = next((c for c in counts if isinstance(c, int) and not isinstance(c, bool)), None)
    if n is None or n < 1 or n == len(types):
        return given
    return {**given, "layer_types": [types[i % len(types)] for i in range(n)]}


#: config fields that are sizes or counts (layers, widths, heads, vocabulary, positions): >= 1
SIZES = (
    "n_layer",
    "num_hidden_layers",
    "n_embd",
    "hidden_size",
    "n_head",
    "num_attention_heads",
    "num_key_value_heads",
    "n_inner",
    "intermediate_size",
    "head_dim",
    "vocab_size",
    "n_positions",
    "max_position_embeddings",
)
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a word"}


def _check_field(cls_name: str, key: str, default: Any, value: Any) -> None:
    """``value`` for field ``key`` has the type of the field's default (None: any value; a number
    field takes an integer too); else ``ValueError`` with the value, the type and the default."""
    want = type(default)
    if want not in _KINDS or value is None:
        return
    if want is bool or isinstance(value, bool):
        ok = want is bool and isinstance(value, bool)
    elif want is float:
        ok = isinstance(value, (int, float))
    else:
        ok = isinstance(value, want)
    if not ok:
        raise ValueError(
            f"{cls_name} {key}={value!r} (from --model_config): the field takes {_KINDS[want]} "
            f"(its default is {default!r})"
        )


def _made(cls: Any, fields: dict[str, Any], cls_name: str) -> Any:
    """``cls(**fields)``, its own refusal (transformers' strict field checks) as a ``ValueError``."""
    try:
        return cls(**fields)
    except Exception as e:  # noqa: BLE001 - any refusal of the config class, reported as bad input
        reason = " ".join(str(e).split())
        raise ValueError(f"{cls_name} refuses these fields: {reason}") from None


def max_positions(config: Any) -> int:
    """The longest sequence the model takes (``n_positions``/``max_position_embeddings``), or 1024."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1024


class CausalLM(nn.Module):
    """A Hugging Face causal LM whose ``forward(idx, targets)`` returns the mean next-token loss
    (targets of ``-100`` are padding and ignored), like :class:`ampkit.models.builtin.GPT`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from ..step.logs import quiet_imports

        self.config = config
        with quiet_imports():  # transformers' quantizers import torchao (lazily: in from_config)
            from transformers import AutoModelForCausalLM

            self.hf = AutoModelForCausalLM.from_config(config)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = self.hf(input_ids=idx).logits
        if targets is None:
            return logits
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100
        )

    def save(self, directory: str) -> None:
        """``save_pretrained`` (safetensors + config.json): ``AutoModelForCausalLM.from_pretrained`` loads it."""
        self.hf.save_pretrained(directory)


def build_hf(spec: str, overrides: Optional[dict[str, Any]] = None) -> CausalLM:
    return CausalLM(hf_config(spec, overrides))
