"""What several commands share: flag spellings, value parsers, the model and data, a wide console."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional

import torch

from ..loop.seed import SEED_RANGE

__all__ = [
    "bounded",
    "data_flags",
    "estimate_inputs",
    "flag",
    "memory_size",
    "model_label",
    "model_and_data",
    "positive_float",
    "positive_int",
    "seed_int",
    "unit_float",
    "wide_console",
]


def flag(parser: argparse.ArgumentParser, name: str, *aliases: str, **kwargs: Any) -> None:
    """Add ``--name`` with its hyphen spelling (and any aliases) as one option (``dest`` defaults to ``name``)."""
    spellings = [f"--{name}"]
    for n in (name, *aliases):
        for s in (f"--{n}", f"--{n.replace('_', '-')}"):
            if s not in spellings:
                spellings.append(s)
    parser.add_argument(*spellings, **{"dest": name, **kwargs})


def bounded(
    kind: type,
    *,
    gt: Optional[float] = None,
    ge: Optional[float] = None,
    le: Optional[float] = None,
    unit: str = "",
    name: str = "",
) -> Any:
    """An argparse type for a finite ``kind`` (int or float) within the bounds; the error names the
    value and the range (``'1e9' must be > 0 and at most 2.592e+06 seconds``). Every number flag
    with bounds is one of these."""
    noun = "an integer" if kind is int else "a number"
    parts = [
        f"> {gt:g}" if gt is not None else "",
        f">= {ge:g}" if ge is not None else "",
        f"at most {le:g}" if le is not None else "",
    ]
    allowed = " and ".join(x for x in parts if x) + (f" {unit}" if unit else "")

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            v = _integral_exponent(text) if kind is int else None
            if v is None:
                raise argparse.ArgumentTypeError(
                    f"{text!r} is not {noun}{f' of {unit}' if unit else ''}"
                ) from None
        if (
            not math.isfinite(v)
            or (gt is not None and not v > gt)
            or (ge is not None and not v >= ge)
            or (le is not None and not v <= le)
        ):
            raise argparse.ArgumentTypeError(f"{v} must be {allowed}")
        return v

    parse.__name__ = name or kind.__name__  # messages name the type ("is not a valid positive_int")
    return parse


def output_file(text: str) -> str:
    """An argparse type for a file a command writes when it is done (``--json``, ``--plot``,
    ``--out``): its directory must exist and the path must not be a directory, checked before any
    work, so that a typo never costs a whole measurement."""
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is a directory; give a file name in it, e.g. {os.path.join(text, 'out')}"
        )
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"{text!r}: the directory {os.path.dirname(text) or parent!r} does not exist "
            "(create it first, or give another path)"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {parent!r} is not writable")
    return text


def _integral_exponent(text: str) -> Optional[int]:
    """``"2e9"`` -> 2000000000: an integer written in exponent form (as help texts show defaults);
    None for anything else (``"2.5e0"``, ``"2.0"``, ``"nan"``)."""
    if "e" not in text.strip().lower():
        return None
    try:
        f = float(text)
    except ValueError:
        return None
    return int(f) if math.isfinite(f) and f.is_integer() else None


def memory_size(text: str) -> str:
    """An argparse type for a memory size (``--memory_budget``, ``--memory``, ``--max_body``):
    checked when the flag is read (``memory size '-1GiB' must be > 0``), kept as typed (a run's
    settings and ``--print_config`` show ``8GiB``, not a byte count)."""
    from ..plan.estimate import parse_bytes

    try:
        parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


memory_size.__name__ = "memory size"  # a --config [train] value: "is not a valid memory size"

positive_int = bounded(int, ge=1, name="positive_int")
positive_float = bounded(float, gt=0, name="positive_float")
unit_float = bounded(float, ge=0, le=1, name="unit_float")  # e.g. a weight decay
seed_int = bounded(
    int, ge=SEED_RANGE[0], le=SEED_RANGE[1], name="int"
)  # --seed: what a run file can carry


def model_and_data(
    args: argparse.Namespace, device: Optional[torch.device], *, meta: bool = False
) -> tuple[torch.nn.Module, Any]:
    """A built-in model with its local data, a Hugging Face config (``gpt2``,
    ``transformers.GPT2Config``) on byte-level text, or a user's ``module:factory``. ``--data``
    replaces the text data of the GPTs: a ``.txt`` corpus, or ``.json``/``.jsonl`` texts.
    ``meta``: the data's shapes is all the caller wants: a built-in or Hugging Face model is not
    built (None; its config gives the sequence length); a user's factory is called as is."""
    from ..models.builtin import MODELS, builtin, config_of, user_model
    from ..models.hf_configs import build_hf, hf_config, is_hf, max_positions, parse_overrides

    data_path, block = getattr(args, "data", None), getattr(args, "block_size", None)
    overrides = getattr(args, "model_config", None)
    if overrides and not is_hf(args.model):
        raise ValueError(
            f"--model_config is for Hugging Face config models (gpt2, transformers.GPT2Config); "
            f"--model {args.model} takes none"
        )
    if is_hf(args.model):
        if meta:  # the config is enough (and needs none of the modelling code)
            model: Any = None
            limit = max_positions(hf_config(args.model, parse_overrides(overrides)))
        else:
            model = build_hf(args.model, parse_overrides(overrides))
            limit = max_positions(model.config)
    elif args.model in MODELS:
        model, data = builtin(
            args.model,
            args.size,
            batch_size=args.batch_size,
            seed=args.seed,
            device=device,
            meta=meta,
        )
        if data_path is None and block is None:
            return model, data
        if args.model != "gpt":
            raise ValueError(
                f"--data and --block_size are for text models (gpt, Hugging Face configs), "
                f"not --model {args.model}"
            )
        limit = config_of(args.model, args.size).block_size
    else:
        if data_path is not None or block is not None:
            raise ValueError(
                "--data and --block_size are for built-in and Hugging Face models; a module:factory "
                "brings its own data"
            )
        return user_model(
            args.model, batch_size=args.batch_size, seed=args.seed, size=args.size, device=device
        )
    if block is not None and block > limit:
        raise ValueError(
            f"--block_size {block} exceeds the model's maximum sequence length ({limit})"
        )
    return model, text_data(
        data_path, args.batch_size, block or min(limit, 1024), args.seed, device
    )


def model_label(args: argparse.Namespace) -> str:
    """``gpt/small``; a Hugging Face config by name (and its overrides); a factory by its path."""
    from ..models.builtin import MODELS
    from ..models.hf_configs import is_hf

    if is_hf(args.model):
        return args.model + (
            f"({args.model_config})" if getattr(args, "model_config", None) else ""
        )
    return (
        f"{args.model}/{args.size}" if args.model in MODELS else f"{args.model} (size {args.size})"
    )


def estimate_inputs(args: argparse.Namespace) -> tuple[Any, Any]:
    """``(factory, batch_of)`` for the memory estimate: ``factory()`` builds the model (called under
    fake tensors), ``batch_of(b)`` a batch of ``b`` samples shaped like the real data (the data is
    built once, at batch 1, and repeated: only shapes matter)."""
    one = argparse.Namespace(**{**vars(args), "batch_size": 1})
    sample = model_and_data(one, None, meta=True)[1](0)

    def batch_of(b: int) -> Any:
        def grow(t: Any) -> Any:
            return (
                t.repeat(b, *[1] * (t.dim() - 1)) if isinstance(t, torch.Tensor) and t.dim() else t
            )

        if isinstance(sample, dict):
            return {k: grow(v) for k, v in sample.items()}
        return (
            type(sample)(map(grow, sample)) if isinstance(sample, (tuple, list)) else grow(sample)
        )

    return (lambda: model_and_data(one, None)[0]), batch_of


def data_flags(p: argparse.ArgumentParser) -> None:
    """``--model_config``, ``--data``, ``--block_size``: Hugging Face configs and text data."""
    flag(
        p,
        "model_config",
        default=None,
        metavar="K=V,...",
        help="fields of a Hugging Face config model (--model gpt2 or transformers.GPT2Config), "
        "e.g. n_layer=2,n_embd=64",
    )
    flag(
        p,
        "data",
        default=None,
        metavar="FILE",
        help="text for gpt / Hugging Face models: a .txt corpus, or .json/.jsonl texts (default: the stdlib's source)",
    )
    flag(
        p,
        "block_size",
        "max_length",
        type=positive_int,
        default=None,
        help="tokens per sample for text models (default: the model's maximum, up to 1024)",
    )


def text_data(
    path: Optional[str], batch: int, block: int, seed: int, device: Optional[torch.device]
) -> Any:
    """Byte-level text batches: the stdlib corpus, a ``.txt`` file, or ``.json``/``.jsonl`` texts."""
    from ..models.data import TextBatches, TextSamples, load_texts

    if path is not None and not os.path.isfile(path):
        raise ValueError(
            f"--data {path!r}: no such file; give a .txt corpus, or texts as .json (a list of "
            "strings) or .jsonl"
        )
    if path is None or path.endswith(".txt"):
        return TextBatches(batch_size=batch, block_size=block, seed=seed, device=device, path=path)
    if path.endswith((".json", ".jsonl")):
        return TextSamples(
            load_texts(path),
            batch_size=batch,
            max_length=block,
            seed=seed,
            device=device,
            path=path,
        )
    raise ValueError(
        f"--data {path!r}: give a .txt corpus, or texts as .json (a list of strings) or .jsonl"
    )


def wide_console() -> Any:
    """Wide tables stay readable when stdout is not a terminal (rich would fall back to 80 columns)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)
