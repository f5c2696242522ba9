"""The service's contract with training is one file: every RunSpec field travels in ``run.toml`` as
a key ``ampkit train --config`` accepts, the command line holds only the fixed flags, the TOML
writer escapes what TOML needs, and a request's engine config is validated once, at submit.
No server and no training process here (the real-server tests are in test_service.py)."""

from __future__ import annotations

import argparse
import ast
import math
import os
import pathlib

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ampkit.service.runfile import (  # noqa: E402
    RUN_FILE,
    SERVICE_ONLY,
    dumps_toml,
    run_tables,
    train_key,
    write_run_file,
)
from ampkit.service.runner import command_for  # noqa: E402
from ampkit.service.schemas import RecommendSpec, RunSpec  # noqa: E402

SERVICE = pathlib.Path(__file__).resolve().parents[2] / "src" / "ampkit" / "service"

# Every field away from its default, so that every key is written (epochs added after the check:
# a request may not give both steps and epochs; the run file carries both keys all the same).
FULL = RunSpec(
    model="gpt2",
    size="small",
    precision="fp16",
    steps=7,
    batch_size=3,
    accumulation_steps=2,
    lr=5e-5,
    seed=11,
    init_scale=1024.0,
    device="cpu",
    max_seconds=30.0,
    checkpoint_every=4,
    log_every=2,
    model_overrides={"n_layer": 2, "n_embd": 64, "tie_word_embeddings": False},
    texts=['say "hi"\n', "tab\there", "ünïcode ✓ 🙂"],
    max_length=32,
    target_effective_batch_size=6,
    activation_checkpointing=True,
    save_model=True,
    user_id=123,
    amp={"growth_interval": 3, "hysteresis": 2, "keep_fp32": ["lm_head", "*.ln_*"], "min_scale": 1},
).model_copy(update={"epochs": 2})


def _subparser(command: str) -> argparse.ArgumentParser:
    from ampkit.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _options(command: str) -> dict[str, argparse.Action]:
    """dest -> action of the command's options (the names its --config [train] table takes)."""
    return {
        a.dest: a for a in _subparser(command)._actions if a.option_strings and a.dest != "help"
    }


def test_every_runspec_field_is_a_train_option(tmp_path):
    options = _options("train")
    fields = set(RunSpec.model_fields) - set(SERVICE_ONLY)
    assert set(SERVICE_ONLY) <= set(RunSpec.model_fields)  # no stale exemptions
    assert {train_key(f) for f in fields} <= set(options) - {"config", "json"}, sorted(
        {train_key(f) for f in fields} - set(options)
    )
    tables = run_tables(FULL.model_dump(), str(tmp_path))
    assert set(tables["train"]) == {train_key(f) for f in fields}  # every field travels, none twice
    assert tables["amp"] == FULL.amp


def test_every_train_value_parses_as_its_flag(tmp_path):
    """Each [train] value, given to its flag on a command line, means what the runner meant."""
    train, options = _subparser("train"), _options("train")
    for key, value in run_tables(FULL.model_dump(), str(tmp_path))["train"].items():
        if value is None:
            continue
        flag = options[key].option_strings[0]
        if isinstance(value, bool):
            assert isinstance(options[key], argparse._StoreTrueAction) and value is True, key
            args = train.parse_args([flag])
        else:
            args = train.parse_args([flag, str(value)])
        assert getattr(args, key) == value, (key, value, getattr(args, key))


def test_run_file_is_read_back_exactly(tmp_path):
    spec = FULL.model_dump()
    path = write_run_file(spec, str(tmp_path))
    assert path == os.path.join(str(tmp_path), RUN_FILE)
    with open(path, "rb") as f:
        data = tomllib.load(f)
    want = run_tables(spec, str(tmp_path))
    assert data == {t: {k: v for k, v in want[t].items() if v is not None} for t in want}
    assert data["train"]["model_config"] == "n_layer=2,n_embd=64,tie_word_embeddings=False"
    from ampkit.models.data import load_texts

    assert load_texts(data["train"]["data"]) == FULL.texts
    assert data["train"]["save_model"] == os.path.join(str(tmp_path), "model")
    from ampkit.step.config import MixedPrecisionConfig

    assert MixedPrecisionConfig.from_dict(data["amp"]).keep_fp32 == ("lm_head", "*.ln_*")


def test_command_line_holds_only_the_fixed_flags():
    d = "/data/runs/abc"
    run = {"kind": "train", "spec": FULL.model_dump(), "run_dir": d, "resumes": 0}
    cmd = command_for(run)
    assert cmd[1:4] == ["-m", "ampkit", "train"]
    assert cmd[4:] == [
        "--config",
        f"{d}/run.toml",
        "--json",
        "--log_dir",
        f"{d}/log-0",
        "--checkpoint_dir",
        f"{d}/ckpt",
    ]
    again = command_for({**run, "resumes": 2})
    assert again[4:] == [
        "--config",
        f"{d}/run.toml",
        "--json",
        "--log_dir",
        f"{d}/log-2",
        "--checkpoint_dir",
        f"{d}/ckpt",
        "--resume",
    ]
    options = {o for a in _options("train").values() for o in a.option_strings}
    assert all(w in options for w in again[4:] if w.startswith("--"))


def test_recommend_command_uses_tune_options(tmp_path):
    spec = RecommendSpec(precisions="fp32,bf16").model_dump()
    # the run's directory exists when its command runs (tune checks where --out goes first)
    cmd = command_for({"kind": "recommend", "spec": spec, "run_dir": str(tmp_path), "resumes": 0})
    assert cmd[3] == "tune"
    args = _subparser("tune").parse_args(cmd[4:])
    assert (args.model, args.size, args.precisions, args.batch_size) == (
        "mlp",
        "tiny",
        ["fp32", "bf16"],
        16,
    )


# --- the TOML writer ------------------------------------------------------------------------------


def test_toml_strings_escape_quotes_backslashes_and_control_characters():
    nasty = 'a"b\\c\n\r\t\b\f\x00\x01\x1f\x7f é ✓ 🙂 """ \'\'\' [x] = #'
    text = dumps_toml({"t": {"s": nasty, "odd key": 1, "k.ey": [nasty, "x"]}})
    assert "\x00" not in text and "\x7f" not in text and "\x1f" not in text
    assert tomllib.loads(text) == {"t": {"s": nasty, "odd key": 1, "k.ey": [nasty, "x"]}}


def test_toml_numbers_bools_lists_and_none():
    values = {
        "i": -3,
        "big": 2**62,
        "f": 5e-05,
        "g": 65536.0,
        "h": 1e300,
        "neg0": -0.0,
        "inf": math.inf,
        "ninf": -math.inf,
        "t": True,
        "fl": False,
        "l": [1, 2.5, "x", True],
        "nested": [[1], ["a"]],
        "tup": ("a", "b"),
        "none": None,
    }
    back = tomllib.loads(dumps_toml({"amp": values}))["amp"]
    assert "none" not in back  # TOML has no null: left out, the reader's default
    for k, v in values.items():
        if v is not None:
            assert back[k] == (list(v) if isinstance(v, tuple) else v), k
    assert math.isnan(tomllib.loads(dumps_toml({"t": {"nan": math.nan}}))["t"]["nan"])
    assert isinstance(back["g"], float) and isinstance(back["i"], int) and back["t"] is True


def test_toml_writer_refuses_what_toml_cannot_carry():
    with pytest.raises(ValueError, match="surrogate"):
        dumps_toml({"t": {"s": "bad \ud800"}})
    with pytest.raises(TypeError):
        dumps_toml({"t": {"d": {"nested": 1}}})
    with pytest.raises(TypeError):
        dumps_toml({"t": {"l": [1, None]}})


@given(
    st.text(st.characters(blacklist_categories=("Cs",))),
    st.lists(st.text(max_size=5), max_size=4),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
)
def test_toml_round_trips_any_text_and_number(s, items, i, x):
    assert tomllib.loads(dumps_toml({"t": {"s": s, "l": items, "i": i, "x": x, s or "k": 1}})) == {
        "t": {"s": s, "l": items, "i": i, "x": x, s or "k": 1}
    }


# --- validation once, at submit; the routes' wiring ------------------------------------------------


def test_submit_validates_the_engine_config_once_and_writes_run_toml(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app
    from ampkit.step.config import MixedPrecisionConfig

    app = create_app(ServiceConfig(data_dir=str(tmp_path)), tokens={"tok": "alice"})
    client = TestClient(app)  # no lifespan: the runner does not start, nothing is launched
    calls = []
    real = MixedPrecisionConfig.__post_init__
    monkeypatch.setattr(
        MixedPrecisionConfig, "__post_init__", lambda self: (calls.append(1), real(self))[1]
    )
    body = {
        "model": "mlp",
        "steps": 3,
        "precision": "fp16",
        "init_scale": 1024,
        "amp": {"growth_interval": 3, "fallback": "16-mixed,bf16-mixed", "keep_fp32": "net.0"},
    }
    r = client.post("/v1/runs", json=body, headers={"Authorization": "Bearer tok"})
    assert r.status_code == 201, r.text
    assert len(calls) == 1  # one MixedPrecisionConfig for the whole request
    run = r.json()
    assert run["spec"]["amp"] == {
        "growth_interval": 3,
        "fallback": "fp16,bf16",
        "keep_fp32": ["net.0"],
    }
    with open(os.path.join(str(tmp_path), "runs", run["id"], RUN_FILE), "rb") as f:
        data = tomllib.load(f)
    assert data["amp"] == run["spec"]["amp"]
    assert data["train"]["precision"] == "fp16" and data["train"]["init_scale"] == 1024.0
    calls.clear()
    r = client.post(
        "/v1/runs",
        json={**body, "amp": {"max_scale": 512}},
        headers={"Authorization": "Bearer tok"},
    )
    assert (
        r.status_code == 422 and "init_scale" in r.text and len(calls) == 1
    )  # init_scale 1024 > max_scale
    assert (
        not os.path.exists(os.path.join(str(tmp_path), "runs"))
        or len(os.listdir(tmp_path / "runs")) == 1
    )


def test_sizes_and_models_come_from_their_home():
    from ampkit.models.builtin import MODELS, SIZES
    from ampkit.service.deps import allowed_model

    assert RunSpec.model_json_schema()["properties"]["size"]["enum"] == list(
        next(iter(SIZES.values()))
    )
    with pytest.raises(ValueError, match=", ".join(MODELS)):
        allowed_model("nope", ())


def _service_modules():
    return sorted(SERVICE.rglob("*.py"))


def test_no_import_circle_in_the_service():
    graph = {}
    for path in _service_modules():
        mod = ".".join(path.relative_to(SERVICE).with_suffix("").parts)
        pkg = path.relative_to(SERVICE).parent.parts
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = list(pkg[: len(pkg) - (node.level - 1)])
                if len(pkg) - (node.level - 1) < 0:
                    continue  # above the service package
                target = ".".join(base + (node.module.split(".") if node.module else []))
                deps.add(target)
                deps |= {
                    f"{target}.{a.name}".lstrip(".") for a in node.names
                }  # submodules imported by name
        graph[mod.removesuffix(".__init__")] = deps

    def visit(node, stack):
        assert node not in stack, f"import circle: {' -> '.join([*stack, node])}"
        for dep in graph.get(node, ()):
            visit(dep, [*stack, node])

    assert graph["app"] >= {"routes.runs", "routes.finetuning"}  # the edges are seen
    for mod in graph:
        visit(mod, [])


def test_service_functions_stay_short():
    long = []
    for path in _service_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.name}:{node.name} {n} lines")
    assert not long
