"""The checks a request's values pass at the edge, before anything is stored or started: strings
are valid, printable and bounded (a NUL byte, a lone surrogate or 200,000 characters would break
the run's file, its process or the listing), numbers are finite and in range, a Hugging Face config
class is a model config with a causal LM, and ``model_overrides`` name public fields of that config
with values of the field's type. Each failure is a ``ValueError`` whose message names the field, the
value, why, and the valid choices (a 422)."""

from __future__ import annotations

import difflib
import functools
import re
from typing import Annotated, Any, Union

from pydantic import AfterValidator, Field, Strict

__all__ = [
    "MAX_INT",
    "MAX_KEYS",
    "MAX_STR",
    "Bool",
    "Float",
    "Int",
    "Key",
    "Name",
    "OverrideValue",
    "Text",
    "check_hf_class",
    "check_overrides",
    "model_config_names",
    "plain",
    "shown",
]

MAX_STR = 256  # characters of a name, label or pattern
MAX_KEYS = 64  # entries of model_overrides / amp
MAX_INT = 2**63 - 1  # a TOML integer (and a torch seed) is a signed 64-bit number
_CONFIG_INT = 2**31 - 1  # a config field's integer: layers, heads, widths, token ids
_CONFIG_FLOAT = 1e6  # a config field's float: dropouts, epsilons, ranges
_TOKEN = re.compile(r"[A-Za-z0-9_.+-]{1,64}")  # a string override value: one word, no separator
# Config attributes that describe the file, the hub or the build rather than the model's shape.
_META = {
    "transformers_version",
    "architectures",
    "dtype",
    "torch_dtype",
    "problem_type",
    "id2label",
    "label2id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "is_encoder_decoder",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "name_or_path",
    "attn_implementation",
}


def shown(value: Any, n: int = 60) -> str:
    """``value`` for a message: its repr (escapes, so a surrogate or NUL prints), cut to ``n`` characters."""
    text = repr(value)
    return (
        text
        if len(text) <= n
        else f"{text[:n]}... ({len(value) if isinstance(value, str) else len(text)} chars)"
    )


def plain(value: str, limit: int = MAX_STR) -> str:
    """A name, label or pattern: valid Unicode, printable (no NUL or other control character) and at
    most ``limit`` characters; else ``ValueError`` saying which."""
    if len(value) > limit:
        raise ValueError(f"{len(value):,} characters is too long (at most {limit})")
    bad = next((ch for ch in value if not ch.isprintable()), None)
    if bad is not None:
        what = "a lone surrogate" if 0xD800 <= ord(bad) <= 0xDFFF else "a control character"
        raise ValueError(f"{shown(value)} holds {what} (U+{ord(bad):04X}); give printable text")
    return value


def _text(value: str) -> str:
    """A training text: any valid Unicode except NUL (texts are data; their size is the body's cap)."""
    bad = next((ch for ch in value if ch == "\0" or 0xD800 <= ord(ch) <= 0xDFFF), None)
    if bad is not None:
        what = "a NUL character" if bad == "\0" else f"a lone surrogate (U+{ord(bad):04X})"
        raise ValueError(f"text {shown(value, 40)} holds {what}, which is not valid text")
    return value


Name = Annotated[str, AfterValidator(plain)]
Key = Annotated[str, AfterValidator(plain), Field(max_length=MAX_STR)]
Text = Annotated[str, AfterValidator(_text)]
Int = Annotated[int, Strict()]  # true and "12" are not integers
Float = Annotated[float, Strict()]  # true and "0.1" are not numbers (an integer is: 1 -> 1.0)
Bool = Annotated[bool, Strict()]  # 1 and "yes" are not booleans
OverrideValue = Union[Annotated[bool, Strict()], Int, Float, Name, None]


@functools.lru_cache(maxsize=1)
def model_config_names() -> tuple[str, ...]:
    """transformers' config classes that have a causal LM (what ``AutoModelForCausalLM.from_config`` builds)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return tuple(
        sorted(
            {
                CONFIG_MAPPING_NAMES[t]
                for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                if t in CONFIG_MAPPING_NAMES
            }
        )
    )


def check_hf_class(path: str) -> None:
    """``transformers.<Name>Config`` where Name has a causal LM; else ``ValueError`` (``AutoConfig``,
    ``GPTQConfig``, another module's class)."""
    mod, _, name = path.rpartition(".")
    try:
        names = model_config_names()
    except ImportError:
        raise ValueError(
            f"model {path!r} needs transformers, which this server does not have "
            "(pip install 'ampkit[hf]')"
        ) from None
    if mod != "transformers" or name not in names:
        some = ", ".join(
            n for n in ("GPT2Config", "LlamaConfig", "BertConfig", "MistralConfig") if n in names
        )
        raise ValueError(
            f"model {shown(path)} is not a model config with a causal LM; choose "
            f"transformers.<Name>Config for one of {len(names)} ({some}, ...)"
        )


def _fields(config: Any) -> dict[str, Any]:
    """Public, scalar fields of a config instance (and the names its ``attribute_map`` aliases)."""
    out = {
        k: v
        for k, v in vars(config).items()
        if not k.startswith("_")
        and k not in _META
        and (v is None or isinstance(v, (bool, int, float, str)))
    }
    for alias, target in getattr(type(config), "attribute_map", {}).items():
        if target in out and not alias.startswith("_"):
            out[alias] = out[target]
    return out


def _check_value(cls_name: str, key: str, default: Any, value: Any) -> None:
    want = type(default)
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a word"}.get(
        want, "a scalar"
    )
    if isinstance(value, bool) or want is bool:
        ok = want in (bool, type(None)) and isinstance(value, bool)
    elif isinstance(value, int):
        ok = want in (int, float, type(None)) and -_CONFIG_INT <= value <= _CONFIG_INT
        kind = f"{kind} in [-{_CONFIG_INT}, {_CONFIG_INT}]" if want is not float else kind
    elif isinstance(value, float):
        ok = want in (float, type(None)) and abs(value) <= _CONFIG_FLOAT
        kind = f"a number within +-{_CONFIG_FLOAT:g}" if want is not int else kind
    elif isinstance(value, str):
        ok = (
            want in (str, type(None))
            and bool(_TOKEN.fullmatch(value))
            and value.lower() not in ("true", "false", "none", "null")
            and _not_number(value)
        )
        kind = (
            f"{kind} of letters, digits and _.+- (no separators)"
            if want in (str, type(None))
            else kind
        )
    else:
        ok = value is None
    if not ok:
        raise ValueError(
            f"model_overrides.{key}: {shown(value)} is not valid; {cls_name}.{key} takes {kind} "
            f"(its default is {default!r})"
        )


def _not_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return True
    return False


def check_overrides(model: str, overrides: dict[str, Any]) -> None:
    """``overrides`` of a Hugging Face config model: each key a public scalar field of its config
    class (no ``_private`` or ``__dunder__`` names, no metadata such as ``dtype``), each value of the
    field's type and in range; else ``ValueError`` naming the key, the value and the choices."""
    from ..models.hf_configs import ALIASES

    path = ALIASES.get(model, model)
    check_hf_class(path)
    import transformers

    cls = getattr(transformers, path.rpartition(".")[2])
    fields = _fields(cls())
    for key, value in overrides.items():
        if key not in fields:
            choices = ", ".join(sorted(fields))
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"model_overrides: {shown(key)} is not a field you may set on {cls.__name__}"
                f"{hint}; choose from {choices}"
            )
        _check_value(cls.__name__, key, fields[key], value)
