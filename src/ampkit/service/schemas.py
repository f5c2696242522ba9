"""What the service reads and answers: its settings, the request bodies (ampkit's own and the
fine-tuning brief's, ``../shared/SERVICE-API.md``) and the shape of a run in an answer.

Names come from their homes: precisions from :mod:`ampkit.step.precision` (through
:class:`ampkit.MixedPrecisionConfig`), built-in models and their sizes from :mod:`ampkit.loop.models`.
A request is checked once, at the edge: each field here (strings, numbers and override values by
:mod:`ampkit.service.checks`), then against the model and this server in
:func:`ampkit.service.deps.submit`; what passes is stored and written to the run's file as is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..loop.models import SIZES
from ..step.config import MixedPrecisionConfig, canonical_config_keys
from ..step.hardware import normalize_device
from ..step.precision import parse_precision
from ..step.rung import split_spec
from .checks import MAX_INT, MAX_KEYS, Bool, Float, Int, Key, Name, OverrideValue, Text, shown
from .settings import MAX_SECONDS, SERVE_NUMBERS

__all__ = ["DatasetConfig", "MixedPrecisionBody", "OptimizeBody", "OptimizedBody", "RecommendSpec", "RunSpec",
           "ServiceConfig", "SetupBody", "TrainBody", "TrainingConfig", "run_view"]

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
        raise ValueError(f"model_overrides: keys must be identifiers (bad: {', '.join(map(shown, bad))})")
    for k, x in v.items():
        if isinstance(x, str) and ("," in x or "=" in x):
            raise ValueError(f"model_overrides.{k}: {shown(x)} holds a ',' or '=' (a value is one word, not "
                             "more key=value pairs)")
    return v


# a Hugging Face config's fields
Overrides = Annotated[dict[Key, OverrideValue], Field(max_length=MAX_KEYS), AfterValidator(_check_overrides)]
MAX_SCALE = 2.0**127  # an initial loss scale fp32 can hold
UserId = Optional[Union[Annotated[Int, Field(ge=-MAX_INT, le=MAX_INT)], Name]]  # a label (the owner is the token's)


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


def _serve_field(name: str) -> Any:
    """A ServiceConfig field whose default and bounds are ``ampkit serve``'s flag's (:mod:`.settings`)."""
    b = SERVE_NUMBERS[name]
    return Field(b.default, **b.bounds())


class ServiceConfig(BaseModel):
    data_dir: str = "ampkit-service"
    max_concurrent: int = _serve_field("max_concurrent")
    queue_cap: int = _serve_field("queue_cap")  # queued runs per owner before 429
    body_cap: int = Field(1 << 20, ge=1024)  # bytes; training texts travel in the body
    poll_s: Float = Field(0.2, gt=0)
    allowed_factories: tuple[str, ...] = ()
    # Hugging Face configs larger than max_params: 422; max_seconds: a run's limit when it gives none;
    # max_gpu_temp (°C): queued runs wait while a GPU is hotter. Bounds: ampkit serve's flags' (settings.py).
    max_params: Optional[int] = _serve_field("max_params")
    max_seconds: Optional[Float] = _serve_field("max_seconds")
    max_gpu_temp: Optional[Float] = _serve_field("max_gpu_temp")
    private_docs: bool = False  # /docs and /openapi.json need a token too


class RunSpec(BaseModel):
    """A training run (``POST /v1/runs``): the same names and checks as ``ampkit train``; each field
    travels to the run as a ``[train]`` key of its ``run.toml`` (``ampkit.service.runfile``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)
    model: Name = "mlp"
    size: SizeName = "tiny"
    precision: Name = "auto"
    steps: Int = Field(100, ge=1, le=1_000_000)
    batch_size: Int = Field(16, ge=1, le=65_536)
    accumulation_steps: Int = Field(1, ge=1, le=4096)
    lr: Float = Field(1e-3, gt=0, le=10)
    weight_decay: Float = Field(0.01, ge=0, le=1)
    seed: Int = Field(0, ge=-MAX_INT - 1, le=MAX_INT)  # a signed 64-bit number (TOML's and torch's range)
    init_scale: Optional[Float] = Field(None, gt=0, le=MAX_SCALE)
    device: Name = "cpu"
    max_seconds: Optional[Float] = Field(None, gt=0, le=MAX_SECONDS)
    checkpoint_every: Int = Field(10, ge=1, le=1_000_000)
    log_every: Int = Field(5, ge=1, le=1_000_000)
    model_overrides: Overrides = Field(default_factory=dict)  # a Hugging Face config's fields
    texts: Optional[list[Text]] = Field(None, min_length=1)  # training texts (bytes as tokens), else the stdlib
    max_length: Optional[Int] = Field(None, ge=2, le=8192)  # tokens per sample for text models
    epochs: Optional[Int] = Field(None, ge=1, le=100_000)  # instead of steps
    target_effective_batch_size: Optional[Int] = Field(None, ge=1, le=1_000_000)
    activation_checkpointing: Bool = False
    save_model: Bool = False  # write the trained fp32 weights to <run dir>/model
    user_id: UserId = None
    amp: Annotated[dict[Key, Union[Scalar, Annotated[list[Name], Field(max_length=MAX_KEYS)]]],
                   Field(max_length=MAX_KEYS)] = Field(default_factory=dict)  # more MixedPrecisionConfig fields

    @field_validator("texts")
    @classmethod
    def _texts(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        short = [i for i, t in enumerate(v or []) if len(t.encode("utf-8")) < 2]
        if short:
            raise ValueError(f"texts {short[:10]} have fewer than 2 bytes: each text needs at least one next "
                             "byte to predict")
        return v

    @field_validator("amp")
    @classmethod
    def _amp(cls, v: dict[str, Any]) -> dict[str, Any]:
        v = canonical_config_keys(v)  # aliases (min_loss_scale, dtype, ...) become fields: the one table
        clash = [k for k in ("precision", "accumulation_steps", "init_scale") if k in v]
        if clash:
            raise ValueError(f"amp: give {', '.join(clash)} as the run's own field(s), not inside amp")
        return v


    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return _device(v)

    @model_validator(mode="after")
    def _engine_config(self) -> RunSpec:
        """The engine's whole config (``amp`` with the run's precision, accumulation and initial
        scale), checked once by MixedPrecisionConfig itself: unknown keys and bad values get its
        message. ``amp`` keeps the keys given, in the config's canonical form."""
        fields = {"precision": self.precision, "accumulation_steps": self.accumulation_steps}
        if self.init_scale is not None:
            fields["init_scale"] = self.init_scale
        try:
            config = MixedPrecisionConfig.from_dict({**self.amp, **fields}).to_dict()
        except (TypeError, KeyError, OverflowError, RuntimeError) as e:  # a 422 too, never a 500
            raise ValueError(f"amp: {e}") from None
        self.amp = {k: config[k] for k in self.amp}
        return self


class RecommendSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)
    model: Name = "mlp"
    size: SizeName = "tiny"
    batch_size: Int = Field(16, ge=1, le=65_536)
    steps: Int = Field(10, ge=1, le=10_000)
    precisions: Name = "fp32,bf16,fp16"
    device: Name = "cpu"
    max_seconds: Optional[Float] = Field(None, gt=0, le=MAX_SECONDS)

    @field_validator("precisions")
    @classmethod
    def _precisions(cls, v: str) -> str:
        for p in v.split(","):
            _precision(p.strip())
        return v

    _device = field_validator("device")(_device)


def run_view(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the API answers it (a store row): the brief's names (``model_path``, ``scaler_scale``,
    ``user_id``) next to ampkit's. The training texts are not echoed (a listing of 20 runs would carry
    megabytes): ``texts_count`` and ``texts_bytes`` say what the run trains on."""
    summary = run.get("summary") or {}
    texts = run["spec"].get("texts") or []
    spec = {k: v for k, v in run["spec"].items() if k != "texts"}  # the data is not echoed: its count and size
    return {"id": run["id"], "kind": run["kind"], "status": run["status"], "spec": spec,
            "texts_count": len(texts), "texts_bytes": sum(len(t.encode("utf-8", "surrogatepass")) for t in texts),
            "created": run["created"], "started": run["started"], "ended": run["ended"], "error": run["error"],
            "resumes": run["resumes"], "summary": summary or None, "skipped_steps": summary.get("skipped_steps"),
            "model_path": summary.get("model_path"), "scaler_scale": summary.get("final_scale"),
            "user_id": run["spec"].get("user_id")}


# --- the fine-tuning brief's bodies: unknown fields ignored, missing optional ones defaulted -----

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), allow_inf_nan=False)


class MixedPrecisionBody(_Body):
    enabled: Bool = True
    dtype: Name = "float16"  # any precision name or alias ampkit knows
    init_scale: Optional[Float] = Field(65536.0, gt=0, le=MAX_SCALE)
    memory_efficient: Bool = False  # -> activation checkpointing

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return _precision(v)  # lists the valid names


class SetupBody(MixedPrecisionBody):
    model_name: Name = "gpt2"
    model_overrides: Overrides = Field(default_factory=dict)


class DatasetConfig(_Body):
    texts: list[Text] = Field(min_length=1)
    max_length: Int = Field(512, ge=2, le=8192)


class TrainingConfig(_Body):
    epochs: Int = Field(1, ge=1, le=100_000)
    learning_rate: Float = Field(5e-5, gt=0, le=10)
    weight_decay: Float = Field(0.01, ge=0, le=1)
    batch_size: Int = Field(8, ge=1, le=65_536)


class TrainBody(_Body):
    model_name: Name = "gpt2"
    model_overrides: Overrides = Field(default_factory=dict)
    dataset_config: DatasetConfig
    training_config: TrainingConfig = Field(default_factory=TrainingConfig)
    user_id: UserId = None
    mixed_precision_config: Optional[MixedPrecisionBody] = None
    device: Name = "cpu"
    max_seconds: Optional[Float] = Field(None, gt=0, le=MAX_SECONDS)

    _device = field_validator("device")(_device)


class OptimizedBody(TrainBody):
    use_mixed_precision: Bool = True
    use_gradient_accumulation: Bool = True
    target_effective_batch_size: Int = Field(64, ge=1, le=1_000_000)


class OptimizeBody(_Body):
    model_name: Name = "gpt2"
    model_overrides: Overrides = Field(default_factory=dict)
    size: SizeName = "small"  # for model_name "gpt"
    gpu_memory_gb: Float = Field(gt=0, le=1_000_000)
    batch_size: Int = Field(16, ge=1, le=65_536)
    max_length: Int = Field(512, ge=2, le=8192)
