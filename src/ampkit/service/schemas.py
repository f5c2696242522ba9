"""What the service reads and answers: its settings, the request bodies (ampkit's own and the
fine-tuning brief's, ``../shared/SERVICE-API.md``) and the shape of a run in an answer.

Names come from their homes: precisions from :mod:`ampkit.step.precision` (through
:class:`ampkit.MixedPrecisionConfig`), built-in models and their sizes from :mod:`ampkit.models.builtin`.
A request is checked once, at the edge: each field here (strings, numbers and override values by
:mod:`ampkit.service.checks`), then against the model and this server in
:func:`ampkit.service.deps.submit`; what passes is stored and written to the run's file as is.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from ..loop.seed import SEED_RANGE
from ..models.builtin import SIZES
from ..plan.devices import DEVICES, GPU, parse_device, plan_budget
from ..step.config import SCALE_RANGE, MixedPrecisionConfig, canonical_config_keys
from ..step.hardware import normalize_device
from ..step.precision import parse_precision
from ..step.rung import spec_list, split_spec
from .checks import MAX_INT, MAX_KEYS, Bool, Float, Int, Key, Name, OverrideValue, Text, shown
from .runfile import SERVICE_DEFAULTS
from .settings import MAX_SECONDS, SERVE_NUMBERS

__all__ = [
    "DatasetConfig",
    "MixedPrecisionBody",
    "OptimizeBody",
    "OptimizedBody",
    "RecommendSpec",
    "RunSpec",
    "ServiceConfig",
    "SetupBody",
    "TrainBody",
    "TrainingConfig",
    "run_view",
]

# Every size name of the built-in models, in their order (all share tiny ... large today).
SIZE_NAMES = tuple(dict.fromkeys(size for sizes in SIZES.values() for size in sizes))
SizeName = Literal[SIZE_NAMES]  # type: ignore[valid-type]  # Literal of a tuple: one choice per name
Scalar = Union[Bool, Int, Float, Name, None]  # checked as MixedPrecisionConfig fields too


def _check_overrides(v: dict[str, Any]) -> dict[str, Any]:
    """Keys are identifiers and string values hold no separator: the run's file carries the overrides
    as ``k=v,...`` for ``ampkit train --model_config``, and a ``,`` or ``=`` inside a value would add
    a field that no check saw."""
    bad = [k for k in v if not k.isidentifier()]
    if bad:
        raise ValueError(
            f"model_overrides: keys must be identifiers (bad: {', '.join(map(shown, bad))})"
        )
    for k, x in v.items():
        if isinstance(x, str) and ("," in x or "=" in x):
            raise ValueError(
                f"model_overrides.{k}: {shown(x)} holds a ',' or '=' (a value is one word, not "
                "more key=value pairs)"
            )
    return v


# a Hugging Face config's fields
Overrides = Annotated[
    dict[Key, OverrideValue], Field(max_length=MAX_KEYS), AfterValidator(_check_overrides)
]
UserId = Optional[
    Union[Annotated[Int, Field(ge=-MAX_INT - 1, le=MAX_INT)], Name]
]  # a label (the owner is the token's)

# Field meanings shared by several bodies (the OpenAPI description, and docs/reference/rest-api.md)
MODEL = (
    "`gpt`, `mlp`, `cnn`, a Hugging Face config (`gpt2`, `llama`, `bert`, `transformers.<Name>Config`), or a "
    "factory listed in `AMPKIT_ALLOWED_FACTORIES`"
)
PRECISION = (
    "any precision name or alias (`bf16`, `fp16`, `bf16-pure`, `16-mixed`, `bfloat16`, `O2`, ...)"
)
DEVICE = "`cpu`, `cuda`, `cuda:1`, `mps`: one this server has"
MAX_SECONDS_TEXT = (
    "the run fails with `timeout` after this long; null: the server's `--max_seconds` "
    "(default 24 h)"
)
OVERRIDES = (
    "a Hugging Face config's public scalar fields, each a value of the field's type (see Errors); only "
    "for Hugging Face models"
)
USER_ID = "a label kept with the run (the owner is the token's)"


def _device(v: str) -> str:
    try:
        normalize_device(v)
    except Exception as e:  # whatever the parser raises is a 422
        raise ValueError(str(e) or f"device {shown(v)} is not valid") from None
    return v


def _precision(v: str) -> str:
    try:
        parse_precision(split_spec(v)[0])  # "bf16-pure:split": a rung of bf16-pure's memory ladder
    except Exception as e:
        raise ValueError(str(e) or f"precision {shown(v)} is not valid") from None
    return v


def _own(name: str) -> Any:
    """A RunSpec default that is not ``ampkit train``'s: the service's, with its reason
    (:data:`ampkit.service.runfile.SERVICE_DEFAULTS`)."""
    return SERVICE_DEFAULTS[name][0]


def _serve_field(name: str) -> Any:
    """A ServiceConfig field whose default and bounds are ``ampkit serve``'s flag's (:mod:`.settings`)."""
    b = SERVE_NUMBERS[name]
    return Field(b.default, **b.bounds())


class ServiceConfig(BaseModel):
    data_dir: str = "ampkit-service"
    # Int/Float/Bool are strict: True is not 1, nor "8" a number (as in the request models)
    max_concurrent: Int = _serve_field("max_concurrent")
    queue_cap: Int = _serve_field("queue_cap")  # queued runs per owner before 429
    body_cap: Int = Field(1 << 20, ge=1024)  # bytes; training texts travel in the body
    poll_s: Float = Field(0.2, gt=0)
    allowed_factories: tuple[str, ...] = ()
    # Hugging Face configs larger than max_params: 422; max_seconds: a run's limit when it gives none;
    # max_gpu_temp (°C): queued runs wait while a GPU is hotter. Bounds: ampkit serve's flags' (settings.py).
    max_params: Optional[Int] = _serve_field("max_params")
    max_seconds: Optional[Float] = _serve_field("max_seconds")
    max_gpu_temp: Optional[Float] = _serve_field("max_gpu_temp")
    run_memory_gb: Optional[Float] = _serve_field("run_memory_gb")  # None: service.memcap's default
    private_docs: Bool = False  # /docs and /openapi.json need a token too


class RunSpec(BaseModel):
    """A training run (``POST /v1/runs``): the same names and checks as ``ampkit train``; each field
    travels to the run as a ``[train]`` key of its ``run.toml`` (``ampkit.service.runfile``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)
    model: Name = Field(_own("model"), description=MODEL)
    size: SizeName = Field(_own("size"), description="the built-in model's size preset")
    precision: Name = Field("auto", description=PRECISION)
    steps: Int = Field(100, ge=1, le=1_000_000, description="optimizer steps")
    batch_size: Int = Field(16, ge=1, le=65_536, description="micro-batch size")
    accumulation_steps: Int = Field(1, ge=1, le=4096, description="micro-steps per optimizer step")
    lr: Float = Field(1e-3, gt=0, le=10, description="AdamW learning rate")
    weight_decay: Float = Field(0.01, ge=0, le=1, description="AdamW weight decay")
    seed: Int = Field(
        0,
        ge=SEED_RANGE[0],
        le=SEED_RANGE[1],
        description="seed of every generator the run uses: a signed 64-bit integer, as `--seed`",
    )
    init_scale: Optional[Float] = Field(
        None,
        ge=SCALE_RANGE[0],
        le=SCALE_RANGE[1],
        description="initial loss scale (fp16 forms); null: 65536",
    )
    device: Name = Field(_own("device"), description=DEVICE)
    max_seconds: Optional[Float] = Field(None, gt=0, le=MAX_SECONDS, description=MAX_SECONDS_TEXT)
    checkpoint_every: Int = Field(
        _own("checkpoint_every"),
        ge=1,
        le=1_000_000,
        description="checkpoint every N optimizer steps (a resume continues from the newest)",
    )
    log_every: Int = Field(
        _own("log_every"), ge=1, le=1_000_000, description="log metrics every N optimizer steps"
    )
    model_overrides: Overrides = Field(default_factory=dict, description=OVERRIDES)
    texts: Optional[list[Text]] = Field(
        None,
        min_length=1,
        description="training texts (bytes as tokens, each at "
        "least 2 bytes, no NUL) for `gpt` and Hugging Face models; null: the "
        "built-in corpus",
    )
    max_length: Optional[Int] = Field(
        None,
        ge=1,
        le=8192,
        description="tokens per sample for text models "
        "(`--block_size`); null: the model's maximum, up to 1024",
    )
    epochs: Optional[Int] = Field(
        None, ge=1, le=100_000, description="train this many epochs instead of `steps` (not both)"
    )
    target_effective_batch_size: Optional[Int] = Field(
        None,
        ge=1,
        le=1_000_000,
        description="derive "
        "`accumulation_steps` so that batch_size x accumulation_steps "
        "equals this (the micro-batch becomes its largest divisor "
        "<= batch_size)",
    )
    activation_checkpointing: Bool = Field(
        False,
        description="activation checkpointing (`--grad_ckpt`): the "
        "GPT's blocks, a Hugging Face model's layers",
    )
    save_model: Bool = Field(
        False,
        description="write the trained fp32 weights to the run's `model/` "
        "(`model_path` in the answer)",
    )
    user_id: UserId = Field(None, description=USER_ID)
    amp: Annotated[
        dict[Key, Union[Scalar, Annotated[list[Name], Field(max_length=MAX_KEYS)]]],
        Field(max_length=MAX_KEYS),
    ] = Field(
        default_factory=dict,
        description="other `MixedPrecisionConfig` fields (docs/reference/config.md) or their "
        "aliases, checked as a `--config` file's [amp] table; `precision`, `accumulation_steps` and `init_scale` "
        "are the run's own fields",
    )

    @field_validator("texts")
    @classmethod
    def _texts(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        short = [i for i, t in enumerate(v or []) if len(t.encode("utf-8")) < 2]
        if short:
            raise ValueError(
                f"texts {short[:10]} have fewer than 2 bytes: each text needs at least one next "
                "byte to predict"
            )
        return v

    @field_validator("amp")
    @classmethod
    def _amp(cls, v: dict[str, Any]) -> dict[str, Any]:
        typed = dict(v)
        v = canonical_config_keys(
            v
        )  # aliases (min_loss_scale, dtype, ...) become fields: the one table
        clash = [k for k in ("precision", "accumulation_steps", "init_scale") if k in v]
        if clash:
            said = ", ".join(f"{k}={x!r}" for k, x in typed.items() if k not in clash)
            raise ValueError(
                (f"amp: {said} set(s) {', '.join(clash)}; " if said else "amp: ")
                + f"give {', '.join(clash)} as the run's own field(s), not inside amp"
            )
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return _device(v)

    @model_validator(mode="after")
    def _one_length(self) -> RunSpec:
        """``steps`` and ``epochs`` both given: refused, as ``ampkit train --steps N --epochs M``."""
        if self.epochs is not None and "steps" in self.model_fields_set:
            raise ValueError(
                f"steps ({self.steps}) and epochs ({self.epochs}) both say how long to train "
                "(epochs trains whole passes over the data instead of steps); give one"
            )
        return self

    @model_validator(mode="after")
    def _engine_config(self) -> RunSpec:
        """The engine's whole config (``amp`` with the run's precision, accumulation and initial
        scale), checked once by MixedPrecisionConfig itself: unknown keys and bad values get its
        message. On a CPU the engine is made from it too, as ``ampkit train`` makes it before its
        first step (fp8 without emulation, a ladder rung with a precision that has no ladder are
        refused now, not at start); a GPU's is left to the run: the server never initializes
        CUDA. ``amp`` keeps the keys given, in the config's canonical form."""
        from ..step.engine import MixedPrecision

        fields = {"precision": self.precision, "accumulation_steps": self.accumulation_steps}
        if self.init_scale is not None:
            fields["init_scale"] = self.init_scale
        try:
            made = MixedPrecisionConfig.from_dict({**self.amp, **fields})
            if self.device.startswith("cpu"):
                MixedPrecision(config=made, device=self.device)
        except (TypeError, KeyError, OverflowError, RuntimeError) as e:  # a 422 too, never a 500
            raise ValueError(f"amp: {e}") from None
        config = made.to_dict()
        self.amp = {k: config[k] for k in self.amp}
        return self


class RecommendSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)
    model: Name = Field("mlp", description=MODEL)
    size: SizeName = Field("tiny", description="the built-in model's size preset")
    batch_size: Int = Field(16, ge=1, le=65_536, description="micro-batch size")
    steps: Int = Field(10, ge=1, le=10_000, description="steps measured per precision")
    precisions: Name = Field(
        "fp32,bf16,fp16", description="the precisions to compare, comma-separated"
    )
    device: Name = Field("cpu", description=DEVICE)
    max_seconds: Optional[Float] = Field(None, gt=0, le=MAX_SECONDS, description=MAX_SECONDS_TEXT)

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, v: str) -> str:
        try:
            spec_list(v)  # each a precision, none named twice
        except Exception as e:
            raise ValueError(str(e) or f"precisions {shown(v)} is not valid") from None
        return v

    _device = field_validator("device")(_device)


def run_view(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the API answers it (a store row): the brief's names (``model_path``, ``scaler_scale``,
    ``user_id``) next to ampkit's. The training texts are not echoed (a listing of 20 runs would carry
    megabytes): ``texts_count`` and ``texts_bytes`` say what the run trains on."""
    summary = run.get("summary") or {}
    texts = run["spec"].get("texts") or []
    spec = {
        k: v for k, v in run["spec"].items() if k != "texts"
    }  # the data is not echoed: its count and size
    return {
        "id": run["id"],
        "kind": run["kind"],
        "status": run["status"],
        "spec": spec,
        "texts_count": len(texts),
        "texts_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in texts),
        "created": run["created"],
        "started": run["started"],
        "ended": run["ended"],
        "error": run["error"],
        "resumes": run["resumes"],
        "summary": summary or None,
        "skipped_steps": summary.get("skipped_steps"),
        "model_path": summary.get("model_path"),
        "scaler_scale": summary.get("final_scale"),
        "user_id": run["spec"].get("user_id"),
    }


# --- the fine-tuning brief's bodies: unknown fields ignored, missing optional ones defaulted -----


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)
    _ignored: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored(cls, data: Any, handler: Any) -> Any:
        """Ignore unknown fields, as the brief asks, but remember them: each with the closest
        field (``lerning_rate (did you mean 'learning_rate'?)``)."""
        body = handler(data)
        if isinstance(data, dict) and isinstance(body, _Body):
            for key in data:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), list(cls.model_fields), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    plain = isinstance(key, str) and key.isprintable() and len(key) <= 80
                    body._ignored.append(f"{key if plain else shown(key, 80)}{hint}")
        return body

    def ignored_fields(self) -> list[str]:
        """The fields this body (and the bodies inside it) ignored, by their path."""
        out = list(self._ignored)
        for name in type(self).model_fields:
            inner = getattr(self, name)
            if isinstance(inner, _Body):
                out += [f"{name}.{x}" for x in inner.ignored_fields()]
        return out


class MixedPrecisionBody(_Body):
    enabled: Bool = Field(True, description="false: fp32, whatever `dtype` says")
    dtype: Name = Field("float16", description=PRECISION)
    init_scale: Optional[Float] = Field(
        65536.0, ge=SCALE_RANGE[0], le=SCALE_RANGE[1], description="initial loss scale (fp16 forms)"
    )
    memory_efficient: Bool = Field(False, description="activation checkpointing")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return _precision(v)  # lists the valid names


class SetupBody(MixedPrecisionBody):
    model_name: Name = Field("gpt2", description=MODEL)
    model_overrides: Overrides = Field(default_factory=dict, description=OVERRIDES)


class DatasetConfig(_Body):
    texts: list[Text] = Field(
        min_length=1, description="training texts (bytes as tokens, each at least 2 bytes)"
    )
    max_length: Int = Field(512, ge=1, le=8192, description="tokens per sample")


class TrainingConfig(_Body):
    epochs: Int = Field(1, ge=1, le=100_000, description="passes over the texts")
    learning_rate: Float = Field(5e-5, gt=0, le=10, description="AdamW learning rate")
    weight_decay: Float = Field(0.01, ge=0, le=1, description="AdamW weight decay")
    batch_size: Int = Field(
        8, ge=1, le=65_536, description="micro-batch size, capped at the number of texts"
    )


class TrainBody(_Body):
    model_name: Name = Field("gpt2", description=MODEL)
    model_overrides: Overrides = Field(default_factory=dict, description=OVERRIDES)
    dataset_config: DatasetConfig
    training_config: TrainingConfig = Field(default_factory=TrainingConfig)
    user_id: UserId = Field(None, description=USER_ID)
    mixed_precision_config: Optional[MixedPrecisionBody] = Field(
        None, description="null: the owner's stored setup (`setup-mixed-precision`), else fp16"
    )
    device: Name = Field("cpu", description=DEVICE)
    max_seconds: Optional[Float] = Field(None, gt=0, le=MAX_SECONDS, description=MAX_SECONDS_TEXT)

    _device = field_validator("device")(_device)


class OptimizedBody(TrainBody):
    use_mixed_precision: Bool = Field(
        True, description="`auto`'s hardware pick, or bf16 where `auto` stays fp32; false: fp32"
    )
    use_gradient_accumulation: Bool = Field(
        True, description="reach `target_effective_batch_size` by accumulation"
    )
    target_effective_batch_size: Int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="the micro-batch is its largest "
        "divisor <= the batch, the accumulation the quotient",
    )


PLAN_DEVICE = (
    "the device the plan is for, planned on this server without it (fake tensors): `cpu` (this "
    "server's kernels), `cuda` (a Hopper-class GPU of `gpu_memory_gb`) or a named GPU ("
    + ", ".join(f"`{n}`" for n in DEVICES if n != "cuda")
    + "): its caching allocator's blocks, cuBLAS workspaces and fused attention, its memory less "
    "the CUDA context and fragmentation as the budget; rows of a precision it cannot run are "
    "refused (`why_not`). As `ampkit plan --device`; the answer's `device` and `device_name` "
    "name it"
)
PLAN_FLAGS = ("device", "gpu_memory_gb")  # what the planner's messages call them


class OptimizeBody(_Body):
    model_name: Name = Field("gpt2", description="a text model: a Hugging Face config or `gpt`")
    model_overrides: Overrides = Field(default_factory=dict, description=OVERRIDES)
    size: SizeName = Field("small", description="for `model_name` `gpt`")
    device: Name = Field("cpu", description=PLAN_DEVICE)
    gpu_memory_gb: Optional[Float] = Field(
        None,
        gt=0,
        le=1_000_000,
        description="the memory, GiB (2^30 bytes): needed for `cpu` and `cuda`; for a named GPU at "
        "most its memory (null: all of it)",
    )
    batch_size: Int = Field(16, ge=1, le=65_536, description="micro-batch size")
    max_length: Int = Field(
        512, ge=1, le=8192, description="tokens per sample (as `dataset_config.max_length`)"
    )

    @field_validator("device")
    @classmethod
    def _plan_device(cls, v: str) -> str:
        target = parse_device(v, PLAN_FLAGS[0])  # lists the choices
        return target.name if target is not None else "cpu"

    @model_validator(mode="after")
    def _budget(self) -> OptimizeBody:
        self.budget_bytes()  # cpu and cuda need a memory; a named GPU's is at most its own
        return self

    def target(self) -> Optional[GPU]:
        """The GPU the plan is for (:mod:`ampkit.plan.devices`), or None: this server's CPU."""
        return parse_device(self.device, PLAN_FLAGS[0])

    def memory_bytes(self) -> Optional[int]:
        """``gpu_memory_gb`` in bytes, else a named GPU's memory (None: not given, for cpu/cuda)."""
        if self.gpu_memory_gb is not None:
            return int(self.gpu_memory_gb * 2**30)
        target = self.target()
        return target.memory_bytes if target is not None else None

    def budget_bytes(self) -> int:
        """The bytes a step may take (:func:`ampkit.plan.devices.plan_budget`)."""
        memory = int(self.gpu_memory_gb * 2**30) if self.gpu_memory_gb is not None else None
        return plan_budget(self.target(), memory, PLAN_FLAGS)
