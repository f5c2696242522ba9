"""HTML forms for the API's request models: the inputs a model's fields need, the form's strings
turned into the JSON body a client would send, and pydantic's messages by field.

The body is then validated by the API's own model (``RunSpec``, ``OptimizeBody``), so a form is
checked exactly as a request is and shows the same messages: a number field sends the number it
holds (``"12"`` -> ``12``; ``"twelve"`` stays a string, which the model refuses as the API would),
a checkbox a boolean, a JSON field its parsed value, a list one item per line; an empty input is
left out (the model's default), and so is one left at the default it showed (the same value:
steps 100 beside a typed epochs is epochs alone, as a client that gave only epochs).
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ValidationError

__all__ = ["Field", "body", "errors", "fields"]


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # text | number | auto (a number or a word) | checkbox | select | json | lines
    default: str
    choices: tuple[str, ...] = ()
    required: bool = False
    suggest: tuple[str, ...] = ()  # offered while typing (any value may still be given)


def _kind(annotation: Any) -> tuple[str, tuple[str, ...]]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _kind(args[0])
    if origin is Union:
        kinds = {_kind(a)[0] for a in args}
        return (kinds.pop(), ()) if len(kinds) == 1 else ("auto", ())
    if origin is Literal:
        return "select", tuple(map(str, args))
    if origin is dict:
        return "json", ()
    if origin is list:
        return "lines", ()
    if annotation is bool:
        return "checkbox", ()
    if annotation in (int, float):
        return "number", ()
    return "text", ()


def fields(
    model: type[BaseModel],
    required: tuple[str, ...] = (),
    suggest: Optional[dict[str, tuple[str, ...]]] = None,
    choices: Optional[dict[str, tuple[str, ...]]] = None,
) -> list[Field]:
    """The form's inputs, one per field of ``model``, in its order (``suggest``: values offered for
    a text field while typing, e.g. the precision names; ``choices``: a text field shown as a
    select of these values, which the model still checks, e.g. the planner's devices)."""
    out = []
    for name, info in model.model_fields.items():
        kind, choices_of = _kind(info.annotation)
        if name in (choices or {}):
            kind, choices_of = "select", (choices or {})[name]
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        shown = (
            ""
            if default is None or default in ({}, [])
            else (
                json.dumps(default)
                if kind == "json"
                else str(default).lower()
                if isinstance(default, bool)
                else str(default)
            )
        )
        out.append(
            Field(
                name,
                kind,
                shown,
                choices_of,
                required=name in required or info.is_required(),
                suggest=(suggest or {}).get(name, ()),
            )
        )
    return out


def body(model: type[BaseModel], values: dict[str, str]) -> dict[str, Any]:
    """The JSON body a client would send for these form values (see the module's docstring)."""
    out: dict[str, Any] = {}
    for f in fields(model):
        raw = values.get(f.name)
        if f.kind == "checkbox":
            out[f.name] = raw is not None
            continue
        if raw is None or not raw.strip() or raw.strip() == f.default:
            continue  # empty, or the default the form showed: the model's default, not a choice
        if f.kind in ("number", "auto", "json"):
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw  # not a number (or not JSON): the model says why, as the API would
            if f.kind == "auto" and not isinstance(value, int):
                value = raw
            out[f.name] = value
        elif f.kind == "lines":
            out[f.name] = [line for line in raw.splitlines() if line.strip()]
        else:
            out[f.name] = raw
    return out


def errors(e: ValidationError, model: Optional[type[BaseModel]] = None) -> dict[str, str]:
    """Each field's messages (``""``: the form's own), as the API's 422 names them. A check of the
    whole body whose message starts with a field's name (``amp: ...``; ``gpu_memory_gb is needed
    ...`` of ``model``) is shown beside that field."""
    out: dict[str, list[str]] = {}
    for err in e.errors():
        loc = err.get("loc") or ()
        name = str(loc[0]) if loc else ""
        where = ".".join(map(str, loc[1:]))
        msg = err.get("msg", "")
        first = msg.removeprefix("Value error, ").split(" ", 1)[0].rstrip(":")
        if not name and msg.startswith("Value error, amp:"):
            name = "amp"  # the engine config's check (RunSpec._engine_config): about amp
        elif not name and model is not None and first in model.model_fields:
            name = first  # e.g. OptimizeBody's budget: about gpu_memory_gb, or the device
        out.setdefault(name, []).append(f"{where}: {msg}" if where else msg)
    return {k: "; ".join(v) for k, v in out.items()}
