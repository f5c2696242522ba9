"""The frozen public surface (issue 35): every public name, config key and REST route, parameter
and body field of today keeps working. Additions are free; a removal or rename fails here and is a
deliberate, noted change. The command line's flags are frozen (exactly) in
tests/cli/test_cli_flags.py::FLAGS, the precision names and aliases in tests/step/test_aliases.py."""

from __future__ import annotations

import pytest

import ampkit
from ampkit.step.aliases import KEY_ALIASES
from ampkit.step.config import fields_help

PUBLIC_NAMES = """
    AuditReport BatchConfig BenchReport CheckpointConfig CheckpointError CheckpointManager CheckpointMismatch
    ConfigError ConsoleSink DeviceInfo EvalConfig Event JSONLSink LogConfig LossScaler MLflowSink Manifest
    MemoryBreakdown MemoryEstimate MixedPrecision MixedPrecisionConfig Monitor NonFiniteReport NumericsError
    Precision PrecisionError Recommendation SpikeGuard StepResult TensorBoardSink TrainSummary Trainer
    TrainingInterrupted WandbSink __version__ audit breakdown compare confirm_auto device_info estimate
    largest_batch load_checkpoint localize_nonfinite read_jsonl resolve_precision save_checkpoint tune
"""

CONFIG_KEYS = """
    precision init_scale growth_factor backoff_factor growth_interval hysteresis consecutive_hysteresis min_scale
    max_scale dynamic_scaling skip_nonfinite autocast_cache accumulation_steps clip_grad_norm keep_fp32 fallback
    fallback_patience fallback_check_every fallback_recover_after manifest_check_every compile fp8_recipe
    fp8_emulate deterministic memory_efficient masters state_dtype allow_stall
"""

CONFIG_ALIASES = """
    min_loss_scale max_loss_scale loss_scale_window initial_scale initial_loss_scale cache_enabled
    mixed_precision_autocast_cache_enabled mixed_precision_dtype dtype mixed_precision
    mixed_precision_grad_scaler_init_scale mixed_precision_grad_scaler_growth_factor
    mixed_precision_grad_scaler_backoff_factor mixed_precision_grad_scaler_growth_interval grad_scaler_init
    grad_scaler_growth_interval grad_scaler_backoff grad_accum_steps gradient_accumulation_steps max_grad_norm
    fallback_chain automatic_fallback
"""

# "METHOD path": its query parameters. Path parameters are in the path.
REST_ROUTES = {
    "GET /health": "",
    "POST /v1/runs": "",
    "GET /v1/runs": "status limit",
    "GET /v1/runs/{run_id}": "",
    "DELETE /v1/runs/{run_id}": "",
    "GET /v1/runs/{run_id}/metrics": "after limit",
    "POST /v1/runs/{run_id}/resume": "",
    "GET /v1/compare": "ids",
    "POST /v1/recommend": "",
    "POST /finetuning/setup-mixed-precision": "",
    "POST /finetuning/mixed-precision": "",
    "POST /finetuning/optimized": "",
    "GET /finetuning/runs/{run_id}": "",
    "GET /finetuning/mixed-precision-stats": "run_id",
    "POST /finetuning/optimize-mixed-precision": "",
    "GET /finetuning/optimize-mixed-precision/jobs/{job_id}": "",
}

# Request bodies: their fields, and whether an unknown field is refused (ampkit's own /v1 bodies) or
# ignored (the brief's bodies, SERVICE-API.md).
REST_BODIES = {
    "RunSpec": (
        "forbid",
        """model size precision steps batch_size accumulation_steps lr weight_decay seed init_scale
                device max_seconds checkpoint_every log_every model_overrides texts max_length epochs
                target_effective_batch_size activation_checkpointing save_model user_id amp""",
    ),
    "RecommendSpec": ("forbid", "model size batch_size steps precisions device max_seconds"),
    "SetupBody": ("ignore", "enabled dtype init_scale memory_efficient model_name model_overrides"),
    "MixedPrecisionBody": ("ignore", "enabled dtype init_scale memory_efficient"),
    "TrainBody": (
        "ignore",
        """model_name model_overrides dataset_config training_config user_id
                  mixed_precision_config device max_seconds""",
    ),
    "OptimizedBody": (
        "ignore",
        """model_name model_overrides dataset_config training_config user_id
                      mixed_precision_config device max_seconds use_mixed_precision use_gradient_accumulation
                      target_effective_batch_size""",
    ),
    "DatasetConfig": ("ignore", "texts max_length"),
    "TrainingConfig": ("ignore", "epochs learning_rate weight_decay batch_size"),
    "OptimizeBody": (
        "ignore",
        "model_name model_overrides size gpu_memory_gb batch_size max_length",
    ),
}


def test_public_names_keep_working():
    assert not set(PUBLIC_NAMES.split()) - set(ampkit.__all__)
    assert all(hasattr(ampkit, n) for n in PUBLIC_NAMES.split())


def test_config_keys_and_their_aliases_keep_working():
    fields = {f.name for f in fields_help()}
    assert not set(CONFIG_KEYS.split()) - fields
    assert not set(CONFIG_ALIASES.split()) - set(KEY_ALIASES)
    for alias in CONFIG_ALIASES.split():  # each still names a field
        assert KEY_ALIASES[alias] in fields, alias


@pytest.fixture(scope="module")
def openapi(tmp_path_factory):
    pytest.importorskip("fastapi")
    from ampkit.service.app import create_app
    from ampkit.service.schemas import ServiceConfig

    data_dir = tmp_path_factory.mktemp("surface")
    return create_app(ServiceConfig(data_dir=str(data_dir)), tokens={}).openapi()


def test_rest_routes_and_parameters_keep_working(openapi):
    routes = {
        f"{m.upper()} {p}": {x["name"] for x in op.get("parameters", []) if x["in"] == "query"}
        for p, ops in openapi["paths"].items()
        for m, op in ops.items()
    }
    for route, params in REST_ROUTES.items():
        assert route in routes, f"{route} is gone: a REST route keeps working"
        assert set(params.split()) <= routes[route], f"{route}: a query parameter is gone"


def test_rest_body_fields_keep_working(openapi):
    schemas = openapi["components"]["schemas"]
    for name, (extra, fields) in REST_BODIES.items():
        assert name in schemas, f"request body {name} is gone"
        assert not set(fields.split()) - set(schemas[name]["properties"]), (
            f"{name}: a field is gone"
        )
        forbids = schemas[name].get("additionalProperties") is False
        assert forbids == (extra == "forbid"), f"{name}: unknown fields must stay {extra}d"
