"""``docs/reference/rest-api.md``, generated from the app's OpenAPI description (``app.openapi()``):
every route, its parameters and its body's fields (type, default, bounds, meaning) come from the
routes and the request models themselves, so the reference cannot drift from the API
(``python -m ampkit.cli.docs`` writes it, ``--check`` and tests/cli/test_cli_flags.py compare it).

The prose that no schema holds -- connections, authentication, errors, the run object every
training route answers with -- is :data:`API_TEXT`, written here and emitted as the reference's
introduction (not put in the app's description: its links are relative to docs/reference/). A
route's text is its function's docstring (up to a ``\\f``, FastAPI's cut), shown by ``/docs`` too;
a field's meaning is its ``Field(description=...)``.
"""

from __future__ import annotations

import json
import math
import tempfile
from typing import Any, Optional

__all__ = ["API_TEXT", "GENERATED", "rest_reference"]

API_TEXT = r"""The service started by `ampkit serve` ([guide](../guides/service.md)): JSON over HTTP on
`http://HOST:PORT` (default `127.0.0.1:8000`). FastAPI also serves its generated OpenAPI schema at
`/openapi.json` and interactive docs at `/docs`; with `ampkit serve --private_docs`
(`ServiceConfig.private_docs`) both need the bearer token (401 without) and `/redoc` is off.

Connections: a request head must arrive within `--header_timeout` seconds (default 10) of the
connection opening or the previous answer, and a body may not pause longer than that; an idle
kept-alive connection is closed after 5 s. Each call is one line of the request log
(`ampkit.service` logger): owner, method, route, status, milliseconds.

## Authentication

Every route below but `GET /health` needs `Authorization: Bearer TOKEN`. Tokens map to owners:
`AMPKIT_TOKENS=alice:TOKEN_A,bob:TOKEN_B`, or `AMPKIT_TOKEN=TOKEN` (owner `default`), or else
`DATA_DIR/tokens.json` (a JSON object token → owner, mode 0600; written on first start with one
generated token for `default`; read at start). A run belongs to the owner whose token created it;
for anyone else it does not exist (404). The brief's `user_id` is a label, not an owner.

## Errors

Errors are JSON: `{"detail": "..."}` with a sentence, or, for body validation, FastAPI's list
`{"detail": [{"type": ..., "loc": ["body", "precision"], "msg": "Value error, unknown precision 'fp61' (did you mean 'fp16'?); choose one of: ...", "input": "'fp61'"}]}`.
Bad input is never a 500: `input` is the value as sent, as a Python repr cut to 120 characters (a
200,000-character string is not echoed back), and every answer is ASCII-escaped JSON, so a lone
surrogate a client sent (or an older server stored) is written `\ud800` instead of breaking the answer.
A field the body does not have, or a value that is none of a field's choices, names the closest
one: `"msg": "Extra inputs are not permitted (did you mean 'steps'?)"` for `stepz`. (The brief's
`/finetuning/...` bodies ignore fields they do not have, as the brief asks, and their training
and setup answers list them in `ignored_fields`, each with the closest field.)

Checked at submit, so that a run accepted is a run that can start (each a 422 naming the field, the
value, why, and the valid choices):

- **strings** (`model`, `precision`, `device`, `user_id`, `precisions`, `dtype`, `model_name`,
  `amp` keys and values, `keep_fp32` entries, `model_overrides` keys and values): printable text, no
  NUL or other control character, no lone surrogate, at most 256 characters; `texts`: any text but
  NUL and lone surrogates (their size is the body's cap); `model_overrides` and `amp` at most 64 entries.
- **numbers**: finite (`NaN`, `Infinity`, `1e400` are refused), in range (`seed` a signed 64-bit
  integer, `init_scale` ≤ 2^127, `max_seconds` ≤ 30 days); integer fields take integers only
  (`true`, `"5"` and `1e300` are not), number fields (`lr`, `learning_rate`, `weight_decay`,
  `init_scale`, `max_seconds`, `gpu_memory_gb`, ...) numbers only (`1` is 1.0; `true` and `"0.1"`
  are not), boolean fields booleans only -- in every request body.
- **Hugging Face models**: `transformers.<Name>Config` only where `<Name>` has a causal LM
  (`AutoConfig`, `GPTQConfig`, `PretrainedConfig` are refused). `model_overrides` keys are the config's
  public scalar fields (no `_private` or `__dunder__` names, no metadata such as `dtype`,
  `architectures`); each value has the field's type (an integer field takes an integer within
  ±2^31, a float field a number within ±10^6, a string field one word of letters, digits and `_.+-`,
  no `,` or `=`). A config that cannot be built (the config's own checks) and one over `--max_params`
  (counted on the config the run builds, on the meta device; a stack of identical blocks from its
  1-, 2- and 3-block copies, so `n_layer: 8000` is answered in well under a second) are 422 too.
- **what the run would fail on at start**: a device this server does not have (`cuda` without CUDA,
  `cuda:N` past the count, `meta`), `texts` for a model that is not a text model (`mlp`, `cnn`), and
  `amp.keep_fp32` patterns that match no module of the run's model (checked on the model built on
  the meta device).

A queued run whose launch still raises (say, one stored by an older server) is marked `failed`
with `error` `could not start: ...`, and the scheduler goes on to the next run.

| code | when |
| --- | --- |
| 401 | no or unknown bearer token (`WWW-Authenticate: Bearer`) |
| 404 | no run with that id for this owner |
| 409 | the run is in the wrong state: cancelling an ended run, resuming one that is not `interrupted`/`failed`/`cancelled` or has no checkpoint, comparing runs without a summary |
| 413 | the body is larger than `--max_body` (default 1 MiB): by its `Content-Length` before it is read, or, chunked, as soon as the bytes read pass the cap (`Connection: close`) |
| 422 | a body that fails validation (unknown field on `/v1/*` bodies, out-of-range value, unknown precision, device or config key), a model that is not available (not built-in, not a Hugging Face config, not an allowed factory), a Hugging Face model over `--max_params`, `compare` with fewer than two ids |
| 429 | this owner already has `--queue_cap` runs queued (`Retry-After: 10`); the cap is per owner, so one owner filling the queue does not block the others |
| 507 | the server's disk (or database) is full: nothing was stored (`Retry-After: 60`) |

## The run object

`POST /v1/runs`, `GET /v1/runs/{id}`, `DELETE`, `resume`, `POST /v1/recommend` and the brief's
training routes answer with this view of a run:

| field | type | meaning |
| --- | --- | --- |
| `id` | string | 12 hex characters |
| `kind` | string | `train` or `recommend` |
| `status` | string | `queued`, `running`, `succeeded`, `failed`, `cancelled`, `interrupted` |
| `spec` | object | the validated request (every field, defaults filled in; `max_seconds` the server's default when the request gave none), without `texts` |
| `texts_count`, `texts_bytes` | integer | how many training texts the run has and their UTF-8 size (0 without texts); the texts themselves are never echoed, so listings stay small |
| `created`, `started`, `ended` | number or null | Unix times |
| `error` | string or null | why it failed (the run's failure, the tail of its stderr, `killed by signal 9 (SIGKILL)`, `timeout: still running after max_seconds=...`, `cancelled by its owner`, or how to resume an interrupted run) |
| `resumes` | integer | how many times it was resumed |
| `summary` | object or null | when it ended: `ampkit train --json`'s summary (precision, optimizer_steps, skipped_steps, final_loss, ms_per_step, samples_per_s, final_scale, peak_mem_bytes, eval_losses, model_path, failure, ...) or, for `recommend`, `ampkit tune --json`'s answer (`recommendation`, `bench`) |
| `skipped_steps` | integer or null | from the summary |
| `model_path` | string or null | where `save_model` wrote the weights |
| `scaler_scale` | number or null | the final loss scale (fp16 forms) |
| `user_id` | any or null | the label given in the request |

`GET /v1/runs/{id}` adds `events`: the run's `type == "event"` [JSONL records](jsonl-schema.md#events).
"""


GENERATED = (
    "<!-- generated from the app's OpenAPI by `python -m ampkit.cli.docs`; do not edit: "
    "tests/cli/test_cli_flags.py checks it -->"
)


def rest_reference(openapi: Optional[dict[str, Any]] = None) -> str:
    """Markdown of ``openapi`` (default: the OpenAPI description of an app built in a temporary
    data directory, with the default :class:`~ampkit.service.schemas.ServiceConfig`)."""
    if openapi is None:
        from .app import create_app
        from .schemas import ServiceConfig

        with tempfile.TemporaryDirectory() as d:  # the app opens its store; nothing is served
            openapi = create_app(ServiceConfig(data_dir=d), tokens={}).openapi()
    schemas = openapi.get("components", {}).get("schemas", {})
    out = [
        GENERATED,
        "",
        "# REST API reference (`ampkit serve`)",
        "",
        API_TEXT.strip(),
        "",
        "## Routes",
        "",
    ]
    shown: set[str] = set()
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            out += _route(method.upper(), path, op, schemas, shown)
    return "\n".join(out).rstrip() + "\n"


def _route(
    method: str, path: str, op: dict[str, Any], schemas: dict[str, Any], shown: set[str]
) -> list[str]:
    ok = next((c for c in op.get("responses", {}) if c.startswith("2")), "200")
    out = [f"### `{method} {path}`" + (f" → {ok}" if ok != "200" else ""), ""]
    if op.get("description"):
        out += [op["description"].strip(), ""]
    params = [p for p in op.get("parameters", []) if p.get("in") == "query"]
    if params:
        out += [
            "| query parameter | type | default | constraint | meaning |",
            "| --- | --- | --- | --- | --- |",
        ]
        out += [
            _row(p["name"], p.get("schema", {}), p.get("required", False), p.get("description", ""))
            for p in params
        ]
        out.append("")
    body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if body:
        out += _model(_ref_name(body), schemas, shown)
    return out


def _model(name: str, schemas: dict[str, Any], shown: set[str]) -> list[str]:
    """The body ``name``'s field table (once; a later route refers to it), then the models it nests."""
    if name in shown:
        return [f"Body: [`{name}`](#{name.lower()}), as above.", ""]
    shown.add(name)
    schema = schemas[name]
    unknown = (
        "an unknown field is a 422"
        if schema.get("additionalProperties") is False
        else "unknown fields are ignored"
    )
    out = [
        f"#### `{name}`",
        "",
        f"Body (JSON object; {unknown}):",
        "",
        "| field | type | default | constraint | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    required = set(schema.get("required", ()))
    nested = []
    for field, prop in schema.get("properties", {}).items():
        out.append(_row(field, prop, field in required, prop.get("description", "")))
        nested += [n for n in _refs(prop) if n not in shown and n not in nested]
    out.append("")
    for n in nested:
        out += _model(n, schemas, shown)
    return out


def _row(name: str, schema: dict[str, Any], required: bool, meaning: str) -> str:
    if required:
        default = "required"
    elif "default" in schema:
        default = f"`{_json(schema['default'])}`"
    else:  # pydantic leaves out None and default factories' values
        types = {v.get("type") for v in _variants(schema)}
        default = (
            "`null`"
            if "null" in types
            else "`{}`"
            if "object" in types
            else "`[]`"
            if "array" in types
            else "—"
        )
    cells = [f"`{name}`", _type(schema), default, _constraint(schema), " ".join(meaning.split())]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _variants(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return schema.get("anyOf") or [schema]


def _type(schema: dict[str, Any]) -> str:
    names = []
    for v in _variants(schema):
        if "$ref" in v:
            names.append(f"[`{_ref_name(v)}`](#{_ref_name(v).lower()})")
        elif v.get("type") == "array":
            names.append(f"array of {_type(v.get('items', {}))}")
        elif v.get("type") == "object" and "additionalProperties" in v:
            names.append(f"object of {_type(v['additionalProperties'])}")
        else:
            names.append(v.get("type", "any"))
    return " or ".join(dict.fromkeys(names))


def _constraint(schema: dict[str, Any]) -> str:
    parts = []
    for v in _variants(schema):
        lo = (
            f"> {_num(v['exclusiveMinimum'])}"
            if "exclusiveMinimum" in v
            else f"≥ {_num(v['minimum'])}"
            if "minimum" in v
            else ""
        )
        hi = (
            f"< {_num(v['exclusiveMaximum'])}"
            if "exclusiveMaximum" in v
            else f"≤ {_num(v['maximum'])}"
            if "maximum" in v
            else ""
        )
        if v.get("type") == "integer" and v.get("maximum") == 2.0**63:
            hi = "≤ 2^63 - 1"  # the signed 64-bit maximum, which the JSON schema's float rounds up
        parts.append(", ".join(x for x in (lo, hi) if x))
        if "enum" in v:
            parts.append("one of " + ", ".join(f"`{x}`" for x in v["enum"]))
        for key, what in (
            ("minItems", "at least {} item(s)"),
            ("maxItems", "at most {} items"),
            ("minLength", "at least {} characters"),
            ("maxLength", "at most {} characters"),
            ("maxProperties", "at most {} entries"),
        ):
            if key in v:
                parts.append(what.format(v[key]))
    return "; ".join(p for p in parts if p)


def _num(x: float) -> str:
    """``1,000,000``, ``0.001``, ``2^127`` (a power of two too long to read as digits)."""
    if x and float(x).is_integer() and abs(x) >= 2**20 and math.log2(abs(x)).is_integer():
        return ("-" if x < 0 else "") + f"2^{int(math.log2(abs(x)))}"
    if x and abs(x) < 1e-6 and math.log2(abs(x)).is_integer():
        return f"2^{int(math.log2(abs(x)))}"
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def _refs(schema: Any) -> list[str]:
    if isinstance(schema, dict):
        own = [_ref_name(schema)] if "$ref" in schema else []
        return own + [n for v in schema.values() for n in _refs(v)]
    if isinstance(schema, list):
        return [n for v in schema for n in _refs(v)]
    return []


def _ref_name(schema: dict[str, Any]) -> str:
    return str(schema["$ref"]).rsplit("/", 1)[-1]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
