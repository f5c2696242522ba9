"""What every route shares, as FastAPI dependencies: the service's parts (``Svc``), the caller
(``Owner``: the bearer token's owner, else 401) and one of the caller's runs (``OwnedRun``: another
owner's run is a 404, as if it did not exist). ``submit`` is the one way a run is accepted."""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Optional

from fastapi import Depends, HTTPException, Request

from .checks import check_hf_class, check_overrides, shown
from .runfile import run_tables, write_run_file
from .runner import Runner
from .schemas import ServiceConfig
from .store import Store

__all__ = [
    "OwnedRun",
    "Owner",
    "Service",
    "Svc",
    "allowed_model",
    "check_size",
    "check_starts",
    "hf_parameters",
    "lookup",
    "owner",
    "owned_run",
    "service",
    "submit",
]


@dataclass(frozen=True)
class Service:
    """The parts of one server, built by ``create_app`` and shared by every route."""

    config: ServiceConfig
    store: Store
    runner: Runner
    tokens: dict[str, str]  # token -> owner


def service(request: Request) -> Service:
    return request.app.state.service


def owner(request: Request, svc: Annotated[Service, Depends(service)]) -> str:
    """The owner of the request's bearer token (401 without a valid one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    who = svc.tokens.get(token.strip()) if scheme.lower() == "bearer" else None
    if who is None:
        raise HTTPException(
            401,
            "missing or invalid token: send Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return who


def each_query_once(request: Request) -> None:
    """A query parameter given twice is a 422 naming it (the API routers' dependency): a scalar
    parameter keeps its last value, so ``/v1/runs?status=succeeded&status=failed`` answered the
    failed runs alone, as if none had succeeded."""
    keys = [k for k, _ in request.query_params.multi_items()]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        raise HTTPException(
            422,
            f"query parameter {shown(twice)} is given {keys.count(twice)} times; give it once "
            "(each takes one value)",
        )
    route = request.scope.get("route")
    if not getattr(route, "path", "").startswith("/v1/"):  # the brief's routes ignore extras
        return
    known = sorted(_query_names(route.dependant))
    unknown = next((k for k in keys if k not in known), None)
    if unknown is not None:  # ?staus=running answered every run, as if filtered
        close = difflib.get_close_matches(unknown, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        takes = f"takes {', '.join(known)}" if known else "takes none"
        raise HTTPException(
            422, f"unknown query parameter {shown(unknown)}{hint}; {route.path} {takes}"
        )


def _query_names(dependant: Any) -> set[str]:
    """The query parameters a route (its dependencies included) reads."""
    names = {q.alias for q in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def lookup(svc: Service, run_id: str, who: str) -> dict[str, Any]:
    """``who``'s run ``run_id`` (404 when there is none, or it is another owner's)."""
    run = svc.store.get(run_id, owner=who)
    if run is None:
        raise HTTPException(404, f"no run {run_id!r}")
    return run


def owned_run(
    run_id: str, who: Annotated[str, Depends(owner)], svc: Annotated[Service, Depends(service)]
) -> dict[str, Any]:
    return lookup(svc, run_id, who)


Svc = Annotated[Service, Depends(service)]
Owner = Annotated[str, Depends(owner)]
OwnedRun = Annotated[dict[str, Any], Depends(owned_run)]


def submit(svc: Service, who: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Accept a validated spec as ``who``'s queued run: the model is one this server may build (422),
    the queue has room (429), and a training run's ``run.toml`` is written before the row exists."""
    from ..models.hf_configs import is_hf, parse_overrides

    try:
        allowed_model(spec["model"], svc.config.allowed_factories)
        if spec.get("model_overrides") and not is_hf(spec["model"]):
            raise ValueError(
                f"model_overrides are for Hugging Face config models, not {spec['model']!r}"
            )
        if is_hf(spec["model"]):
            check_overrides(spec["model"], spec.get("model_overrides") or {})
        # the size of the config the run builds: its overrides as `ampkit train` reads them back from run.toml
        built = (
            parse_overrides(run_tables(spec, "")["train"]["model_config"])
            if kind == "train"
            else {}
        )
        check_size(spec["model"], built or spec.get("model_overrides") or {}, svc.config.max_params)
        check_starts(spec, built)
    except ValueError as e:
        raise HTTPException(422, str(e)) from None
    if (
        svc.store.count("queued", owner=who) >= svc.config.queue_cap
    ):  # per owner: one owner cannot fill it for all
        raise HTTPException(
            429,
            f"you have {svc.config.queue_cap} runs waiting, this server's limit per owner; "
            "retry when one has started",
            headers={"Retry-After": "10"},
        )
    if spec.get("max_seconds") is None and svc.config.max_seconds:
        spec = {
            **spec,
            "max_seconds": svc.config.max_seconds,
        }  # the server's default limit (ampkit serve)
    run_id = uuid.uuid4().hex[:12]
    run_dir = os.path.join(os.path.abspath(svc.config.data_dir), "runs", run_id)
    try:
        if kind == "train":
            try:
                write_run_file(spec, run_dir)
            except (TypeError, ValueError) as e:  # a value TOML cannot carry
                raise HTTPException(422, f"this run cannot be written as run.toml: {e}") from None
        return svc.store.create(run_id, who, kind, spec, run_dir)
    except BaseException:  # not stored (a full disk: 507): its new directory goes too
        shutil.rmtree(run_dir, ignore_errors=True)
        raise


def allowed_model(model: str, factories: tuple[str, ...]) -> str:
    """``model`` if this server builds it: a built-in, an allowed ``module:factory``, or a Hugging
    Face config (built from its config class, never downloaded); else ``ValueError``."""
    from ..models.builtin import MODELS
    from ..models.hf_configs import ALIASES, is_hf

    if model in MODELS or model in factories:
        return model
    if model in ALIASES:
        return model
    if is_hf(model) and model.startswith("transformers."):
        check_hf_class(model)  # a model config with a causal LM: not AutoConfig, GPTQConfig, ...
        return model
    extra = (
        f" or an allowed factory ({', '.join(factories)})"
        if factories
        else " (module:factory models must be allowed by the operator: AMPKIT_ALLOWED_FACTORIES)"
    )
    import difflib

    close = difflib.get_close_matches(model, [*MODELS, *ALIASES, *factories], n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"model {shown(model)} is not available here{hint}; choose {', '.join(MODELS)}, a Hugging "
        f"Face config ({', '.join(ALIASES)}, transformers.<Name>Config){extra}"
    )


@functools.lru_cache(maxsize=128)
def hf_parameters(model: str, overrides: tuple[tuple[str, Any], ...]) -> int:
    """Parameters of a Hugging Face config model, counted on the meta device (nothing allocated).

    A stack of ``L > 3`` blocks is counted from its 1-, 2- and 3-block copies: ``p(1) + (L - 1) *
    (p(2) - p(1))`` when ``p(3) - p(2)`` is that same step (identical blocks); else the whole model
    is built. Building 8000 blocks, even on the meta device, takes a minute and 160 MB."""
    import torch

    from ..models.hf_configs import build_hf
    from ..plan.depth import stack_for

    def count(factory: Any) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in factory().parameters())

    try:
        stack = stack_for(model, overrides=dict(overrides))
        if stack is not None and stack.depth > 3:
            p1, p2, p3 = (count(stack.factory(n)) for n in (1, 2, 3))
            if p3 - p2 == p2 - p1:
                return p1 + (stack.depth - 1) * (p2 - p1)
        return count(functools.partial(build_hf, model, dict(overrides)))
    except ValueError:
        raise
    except (
        Exception
    ) as e:  # the config's own checks (a width not divisible by the heads, ...): a 422
        raise ValueError(
            f"model {model!r} cannot be built with {dict(overrides) or 'its defaults'}: "
            f"{type(e).__name__}: {e}"
        ) from None


def warm_size_check() -> None:
    """Import what :func:`hf_parameters` builds on (transformers' modeling code, torch._dynamo
    underneath: 1.5-2 s and ~130 MB the first time) while the server starts, so that the first
    request's size check answers at once instead of importing inside the request. Without
    transformers (no ``serve`` extra) there is nothing to warm; a failure here is the request's to
    report, never the start's."""
    with contextlib.suppress(Exception):  # ImportError without transformers; else: the request's
        hf_parameters("gpt2", (("n_layer", 1),))


def check_size(model: str, overrides: dict[str, Any], max_params: Optional[int]) -> None:
    """A Hugging Face config model over ``max_params`` parameters: ValueError (a 422)."""
    from ..models.hf_configs import is_hf

    if not (is_hf(model) and max_params):
        return
    n = hf_parameters(model, tuple(sorted(overrides.items())))
    if n > max_params:
        raise ValueError(
            f"model {model!r} with {overrides or 'its defaults'} has {n / 1e6:,.0f}M parameters, over "
            f"this server's limit of {max_params / 1e6:,.0f}M (ampkit serve --max_params)"
        )


def check_device(device: str) -> None:
    """A device this server has (``cuda`` without CUDA, ``cuda:3`` on a one-GPU server, ``meta``: ValueError)."""
    import torch

    from ..step.hardware import normalize_device

    dev = normalize_device(device)
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"device {device!r}: this server has no CUDA device; choose cpu")
        if dev.index is not None and dev.index >= n:
            raise ValueError(
                f"device {device!r}: this server has {n} CUDA device(s); choose cpu or cuda:0..{n - 1}"
            )
        return
    mps = getattr(torch.backends, "mps", None)
    if dev.type == "mps" and mps is not None and mps.is_available():
        return
    raise ValueError(
        f"device {device!r} is not available on this server; choose cpu"
        + (" or cuda" if torch.cuda.is_available() else "")
    )


@functools.lru_cache(maxsize=16)
def _module_tree(model: str, size: str, overrides: tuple[tuple[str, Any], ...]) -> Any:
    """The run's model built on the meta device (nothing allocated): what ``keep_fp32`` must match."""
    import torch

    from ..models.builtin import build
    from ..models.hf_configs import build_hf, is_hf

    with torch.device("meta"):
        return build_hf(model, dict(overrides)) if is_hf(model) else build(model, size)


def check_starts(spec: dict[str, Any], overrides: dict[str, Any]) -> None:
    """What a run would otherwise fail on when it starts, as a ValueError now: its device is here,
    ``texts`` go to a text model, and each ``amp.keep_fp32`` pattern matches a module of the model."""
    from ..models.builtin import MODELS
    from ..models.hf_configs import is_hf
    from ..step.overrides import match_modules

    check_device(spec["device"])
    text_model = spec["model"] == "gpt" or is_hf(spec["model"])
    if spec.get("texts") and not text_model:
        raise ValueError(
            f"texts are training data for text models (gpt, Hugging Face configs), not "
            f"{spec['model']!r}, which trains on its own generated data"
        )
    keep = (spec.get("amp") or {}).get("keep_fp32")
    if keep and (text_model or spec["model"] in MODELS):
        tree = _module_tree(
            spec["model"], spec.get("size", "tiny"), tuple(sorted(overrides.items()))
        )
        try:
            match_modules(tree, keep)
        except (TypeError, ValueError) as e:
            raise ValueError(f"amp.keep_fp32: {e}") from None
