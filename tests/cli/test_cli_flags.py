"""The command line's names and flags have one source each (ampkit.cli.flags, MixedPrecisionConfig,
loop.models, step.precision), the flag set is frozen, and the generated references match."""

import argparse
import pathlib

import pytest

from ampkit.cli import build_parser, main
from ampkit.cli.config_file import NOT_FROM_FILE, explicit_flags, read_config_file
from ampkit.cli.docs import REFERENCES
from ampkit.cli.docs import main as docs_main
from ampkit.cli.flags import ALIASES, SIZE_CHOICES, TRAIN_DEFAULTS, Switch, Toggle, engine_config
from ampkit.cli.invocation import Invocation, parse_invocation, subparser
from ampkit.models.builtin import MODELS, SIZES
from ampkit.step.config import FP8_RECIPES, ConfigError, MixedPrecisionConfig, fields_help
from ampkit.step.precision import CANONICAL

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Every command's options (the underscore spellings; each has a hyphen twin, checked below). Adding or
# removing a flag is a deliberate change: update this list, and regenerate docs/reference/cli.md with
# `python -m ampkit.cli.docs` (torchtitan's test_no_new_cli_options.py does the same).
FLAGS = {
    "info": """
        --device --help --json --no_measure -h
    """,
    "train": """
        --accumulation_steps --allow_fresh --allow_stall --amp_opt_level --autocast_cache --backoff_factor
        --batch_size --block_size --checkpoint_dir --checkpoint_every --clip_grad_norm --compile --config
        --consecutive_hysteresis --data --debug --deterministic --device --dynamic_scaling --epochs
        --eval_every --eval_precision --fallback --fallback_chain --fallback_check_every
        --fallback_patience --fallback_recover_after --fp8_emulate --fp8_recipe --grad_accum_steps
        --grad_ckpt --grad_ckpt_modules --grad_scaler_backoff --grad_scaler_growth_interval
        --grad_scaler_init --growth_factor --growth_interval --help --hysteresis --init_scale --json
        --keep_fp32 --keep_last --ladder_scratch_mib --log_dir --log_every --lr --manifest_check_every --masters
        --max_grad_norm
        --max_length --max_scale --memory_budget --memory_efficient --min_scale --mixed_precision --mlflow
        --model --model_config --nnodes --no_allow_stall --no_autocast_cache --no_compile
        --no_consecutive_hysteresis --no_deterministic --no_diagnose --no_dynamic_scaling --no_fallback
        --no_fp8_emulate --no_memory_efficient --no_optimizer_in_backward --no_progress --no_skip_nonfinite
        --node_rank --nproc_per_node --optimizer_in_backward --overwrite --parallel --precision
        --print_config --rdzv_backend --rdzv_endpoint
        --rdzv_id --resume --save_model --seed --size --skip_nonfinite --state_dtype --steps
        --target_effective_batch_size --wandb --weight_decay -h
    """,
    "audit": """
        --batch_size --block_size --data --device --help --json --max_length --model --model_config
        --precision --seed --size --top -h
    """,
    "bench": """
        --accumulation_steps --batch_size --block_size --compile --data --device --fp8_emulate
        --grad_accum_steps --help --json --lr --max_length --model --model_config --plot --precisions
        --repeats --seed --size --steps --warmup -h
    """,
    "tune": """
        --accumulation_steps --batch_size --block_size --compile --data --device --fp8_emulate
        --grad_accum_steps --help --json --lr --max_length --model --model_config --out --precisions
        --repeats --rungs --seed --size --steps --tolerance --warmup -h
    """,
    "plan": """
        --batch_size --block_size --data --device --help --json --max_length --memory --model --model_config
        --no_cache --precisions --size --verify --workers -h
    """,
    "explain": """
        --accumulation_steps --all --batch_size --block_size --data --device --fp8_emulate --help --json --keep_fp32
        --max_length --model --model_config --precision --seed --size -h
    """,
    "report": """
        --compare --help --json --metrics --out -h
    """,
    "slurm": """
        --account --cpus_per_task --gpus_per_node --help --job_name --nodes --output --partition --port
        --signal_seconds --time -h
    """,
    "export": """
        --help -h
    """,
    "serve": """
        --data_dir --header_timeout --help --host --max_body --max_concurrent --max_gpu_temp --max_params
        --max_seconds --port --private_docs --queue_cap --run_memory_gb -h
    """,
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser) -> list[str]:
    return sorted(o for a in p._actions for o in a.option_strings)


def test_no_new_cli_options():
    commands = _commands()
    assert list(commands) == list(FLAGS), "a command was added or removed: update FLAGS"
    for name, p in commands.items():
        underscore = [o for o in _options(p) if not (o.startswith("--") and "-" in o[2:])]
        assert underscore == FLAGS[name].split(), (
            f"ampkit {name}: the flag set changed; update FLAGS deliberately"
        )


def test_every_underscore_flag_has_its_hyphen_twin_on_the_same_option():
    for name, p in _commands().items():
        for a in p._actions:
            for o in a.option_strings:
                if o.startswith("--") and "_" in o:
                    assert o.replace("_", "-") in a.option_strings, (name, o)


@pytest.mark.parametrize(
    "argv,dest,value",
    [  # the spellings users typed before the flags were generated
        (["--mixed_precision", "bf16"], "precision", "bf16"),
        (["--mixed-precision", "16-mixed"], "precision", "16-mixed"),
        (["--grad_scaler_init", "1024"], "init_scale", 1024.0),
        (["--init-scale", "8"], "init_scale", 8.0),
        (["--grad_scaler_growth_interval", "7"], "growth_interval", 7),
        (["--grad-scaler-backoff", "0.25"], "backoff_factor", 0.25),
        (["--grad_accum_steps", "3"], "accumulation_steps", 3),
        (["--max_grad_norm", "0.5"], "clip_grad_norm", 0.5),
        (["--clip_grad_norm", "none"], "clip_grad_norm", None),
        (["--fallback_chain", "fp16,fp32"], "fallback", "fp16,fp32"),
        (["--no_fallback"], "fallback", False),
        (["--no-fallback"], "fallback", False),
        (["--fallback"], "fallback", True),
        (["--keep_fp32", "lm_head,*.ln_*"], "keep_fp32", ("lm_head", "*.ln_*")),
        (["--deterministic"], "deterministic", True),
        (["--deterministic", "warn"], "deterministic", "warn"),
        (["--deterministic", "false"], "deterministic", False),
        (["--compile"], "compile", True),
        (["--fp8_emulate"], "fp8_emulate", True),
        (["--fp8_recipe", "rowwise"], "fp8_recipe", "rowwise"),
        (["--no_dynamic_scaling"], "dynamic_scaling", False),
        (["--hysteresis", "2"], "hysteresis", 2),
        (["--amp_opt_level", "O2"], "amp_opt_level", "O2"),
    ],
)
def test_train_spellings(argv, dest, value):
    args = build_parser().parse_args(["train", *argv])
    assert getattr(args, dest) == value


@pytest.mark.parametrize(
    "argv",
    [
        ["--deterministic", "sometimes"],
        ["--hysteresis", "0"],
        ["--min_scale", "-1"],
        ["--fp8_recipe", "nope"],
        ["--compile", "yes"],
        ["--seed", str(2**63)],
        ["--seed", str(-(2**63) - 1)],
    ],
)
def test_train_engine_flags_reject_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", *argv])
    assert e.value.code == 2


def test_engine_flags_are_generated_from_the_config_fields():
    train = subparser(build_parser(), "train")
    by_dest = {}
    for a in train._actions:
        by_dest.setdefault(a.dest, a)
    for f in fields_help():
        a = by_dest[f.name]
        assert (
            f"--{f.name}" in a.option_strings
            and f"--{f.name.replace('_', '-')}" in a.option_strings
        )
        assert f.help.replace("%", "%%") in a.help, f.name  # the field's help, word for word
        expected = TRAIN_DEFAULTS[f.name][0] if f.name in TRAIN_DEFAULTS else f.default
        assert a.default == expected, f.name
        for alias in ALIASES.get(f.name, ()):
            assert f"--{alias}" in a.option_strings
        if f.kind is bool and not f.toggle:
            assert isinstance(a, Switch) and f"--no_{f.name}" in a.option_strings
        if f.toggle:
            assert isinstance(a, Toggle)
    assert by_dest["fp8_recipe"].choices == FP8_RECIPES
    assert all(name in by_dest["precision"].help for name in CANONICAL)


def test_train_defaults_are_stated_and_used(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "defaults that differ from MixedPrecisionConfig's" in out
    for name, (value, _) in TRAIN_DEFAULTS.items():
        assert f"{name} = {value!r}" in out
    assert (
        "clip the (unscaled) total gradient norm" in out
        and "(default: 1 in ampkit train; the library's: none)" in out
    )
    assert (
        MixedPrecisionConfig().clip_grad_norm is None and MixedPrecisionConfig().fallback is False
    )
    cfg = _config([])
    assert cfg.clip_grad_norm == 1.0 and cfg.fallback is True and cfg.precision == "auto"
    assert _config(["--clip_grad_norm", "none", "--no_fallback"]).clip_grad_norm is None


def _invocation(argv, tmp_path=None, toml=None) -> Invocation:
    if toml is not None:
        path = tmp_path / "run.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    parser = build_parser()
    return parse_invocation(parser, parser.parse_args(["train", *argv]), ["train", *argv])


def _config(argv, tmp_path=None, toml=None) -> MixedPrecisionConfig:
    inv = _invocation(argv, tmp_path, toml)
    return engine_config(inv.args, inv.flags_given, inv.file.amp)


def test_precedence_command_line_then_train_then_amp_then_train_defaults(tmp_path):
    toml = (
        "[amp]\nclip_grad_norm = 3.0\nhysteresis = 4\nfallback = false\ninit_scale = 64.0\n"
        "[train]\nclip_grad_norm = 2.0\ngrad_scaler_init = 128\n"
    )
    cfg = _config([], tmp_path, toml)
    assert (cfg.clip_grad_norm, cfg.hysteresis, cfg.fallback, cfg.init_scale) == (
        2.0,
        4,
        False,
        128.0,
    )
    cfg = _config(["--max_grad_norm", "5", "--hysteresis", "2"], tmp_path, toml)
    assert (cfg.clip_grad_norm, cfg.hysteresis) == (5.0, 2)
    cfg = _config([], tmp_path, '[amp]\nprecision = "fp16"\n')
    assert cfg.precision == "fp16" and cfg.clip_grad_norm == 1.0 and cfg.fallback is True


def test_optimizer_in_backward_drops_trains_default_clipping_only(tmp_path):
    """``ampkit train``'s default clipping (1.0) needs every gradient before the first update: with
    ``--optimizer_in_backward`` it is off (a note says so); clipping asked for is refused."""
    notes: list = []
    inv = _invocation(["--precision", "bf16", "--optimizer_in_backward"])
    cfg = engine_config(inv.args, inv.flags_given, inv.file.amp, notes)
    assert cfg.optimizer_in_backward and cfg.clip_grad_norm is None
    assert any("clip" in n for n in notes)
    with pytest.raises(ConfigError, match="clip_grad_norm=1.0"):
        _config(["--precision", "bf16", "--optimizer_in_backward", "--clip_grad_norm", "1.0"])
    with pytest.raises(ConfigError, match="clip_grad_norm=2.0"):
        _config(
            ["--precision", "bf16", "--optimizer_in_backward"],
            tmp_path,
            "[amp]\nclip_grad_norm = 2.0\n",
        )


def test_amp_opt_level_maps_through_the_precision_aliases():
    assert _config(["--amp_opt_level", "O0"]).precision == "fp32"
    assert _config(["--amp_opt_level", "O1"]).precision == "auto"
    assert _config(["--amp_opt_level", "O2"]).precision == "O2"
    assert _config(["--amp_opt_level", "O0", "--precision", "32"]).precision == "fp32"
    # issue 24: the seed guide's lines combine the two: the level gives the form, the precision the dtype
    assert (
        _config(["--amp_opt_level", "O0", "--precision", "bf16"]).precision == "fp32"
    )  # O0 wins (a note says so)
    assert _config(["--mixed_precision", "bf16", "--amp_opt_level", "O2"]).precision == "bf16-pure"
    assert _config(["--mixed_precision", "fp16", "--amp_opt_level", "O1"]).precision == "fp16"
    with pytest.raises(ValueError, match="conflicting flags"):
        _config(["--amp_opt_level", "O2", "--precision", "fp32"])
    with pytest.raises(ValueError, match="conflicting flags"):
        _config(["--amp_opt_level", "O1", "--precision", "bf16-pure"])


def _sample(action: argparse.Action):
    """A TOML value for ``action`` and the value the flag would hold after it."""
    if action.nargs == 0:
        return "true", action.const is not False
    if action.choices:
        choice = list(action.choices)[-1]
        return f'"{choice}"', choice
    if isinstance(action, Toggle):
        return "true", True
    samples = {
        "positive_int": ("3", 3),
        "int": ("3", 3),
        "_batch_size_arg": ("3", 3),
        "positive_float": ("0.5", 0.5),
        "unit_float": ("0.25", 0.25),
        "_patterns": ('"a,b"', ("a", "b")),
        "memory size": ('"8GiB"', "8GiB"),
    }
    name = getattr(action.type, "__name__", None)
    return samples.get(name, ('"x"', "x"))


def test_every_train_option_can_be_set_from_the_train_table(tmp_path):
    """The service writes a run.toml: each `train` option (but --config and --json) under its own name."""
    train = subparser(build_parser(), "train")
    seen = set()
    for a in train._actions:
        if not a.option_strings or a.dest in NOT_FROM_FILE or a.option_strings[0] in seen:
            continue
        seen.add(a.option_strings[0])
        key = a.option_strings[0].lstrip("-")
        text, value = _sample(a)
        inv = _invocation([], tmp_path, f"[train]\n{key} = {text}\n")
        assert getattr(inv.args, a.dest) == value, key
        assert inv.flags_given == {a.dest, "config"} and a.dest not in inv.explicit


@pytest.mark.parametrize(
    "toml,dest,value",
    [
        ("no_fallback = true", "fallback", False),
        ('fallback_chain = "fp16,bf16,fp32"', "fallback", "fp16,bf16,fp32"),
        ("grad_scaler_growth_interval = 7", "growth_interval", 7),
        ("grad-accum-steps = 2", None, None),  # hyphens are flag spellings, not [train] keys
        ('deterministic = "warn"', "deterministic", "warn"),
        ("deterministic = true", "deterministic", True),
        ("no_compile = true", "compile", False),
        ('clip_grad_norm = "none"', "clip_grad_norm", None),
    ],
)
def test_train_table_takes_the_old_spellings(tmp_path, toml, dest, value):
    if dest is None:
        with pytest.raises(ValueError, match="unknown \\[train\\] key"):
            _invocation([], tmp_path, f"[train]\n{toml}\n")
        return
    assert getattr(_invocation([], tmp_path, f"[train]\n{toml}\n").args, dest) == value


@pytest.mark.parametrize(
    "toml,fragment",
    [
        ("compile = 1", "must be true or false"),
        ('deterministic = "sometimes"', "not a valid deterministic"),
        ("steps = true", "not a valid positive_int"),
        ("no_fallback = true\nfallback = true", "sets fallback twice"),
        ("model = 3", "must be a string"),
        ('size = "huge"', "choose one of"),
    ],
)
def test_train_table_errors_name_the_key(tmp_path, toml, fragment):
    with pytest.raises(ValueError, match=fragment):
        _invocation([], tmp_path, f"[train]\n{toml}\n")


def test_command_line_beats_the_train_table_and_argv_is_kept(tmp_path):
    inv = _invocation(["--steps=7", "--lr", "0.1"], tmp_path, "[train]\nsteps = 3\nseed = 5\n")
    assert (inv.args.steps, inv.args.seed, inv.args.lr) == (7, 5, 0.1)
    assert inv.explicit == {"steps", "lr", "config"} and set(inv.file.train) == {"steps", "seed"}
    assert inv.argv[:2] == ("train", "--steps=7")
    assert not [k for k in vars(inv.args) if k.startswith("_")]  # no private state on the Namespace
    assert explicit_flags(subparser(build_parser(), "train"), ["--grad-accum-steps", "2"]) == {
        "accumulation_steps"
    }
    assert read_config_file(
        subparser(build_parser(), "train"), str(tmp_path / "run.toml")
    ).train == {"steps": 3, "seed": 5}


def test_one_model_group_from_loop_models():
    assert tuple(dict.fromkeys(s for sizes in SIZES.values() for s in sizes)) == SIZE_CHOICES
    commands = _commands()
    defaults = {"train": "small", "bench": "tiny", "tune": "tiny", "plan": "small", "audit": "tiny"}
    for name, size in defaults.items():
        actions = {a.dest: a for a in commands[name]._actions}
        assert tuple(actions["size"].choices) == SIZE_CHOICES and actions["size"].default == size
        assert all(m in actions["model"].help for m in MODELS) and actions["model"].default == "gpt"
        # plan estimates on fake tensors: its --device is the device planned for, outside the model group
        group = next(g for g in commands[name]._action_groups if g.title == "model and data")
        assert ("device" in {a.dest for a in group._group_actions}) == (name != "plan")
        assert "device" in actions
        group = next(g for g in commands[name]._action_groups if g.title == "model and data")
        assert {a.dest for a in group._group_actions} >= {
            "model",
            "size",
            "model_config",
            "data",
            "block_size",
        }


def test_generated_references_are_current():
    """docs/reference/cli.md, config.md and rest-api.md are written by `python -m ampkit.cli.docs`
    (rest-api.md from the service's OpenAPI: tests/service/test_rest_reference.py)."""
    pytest.importorskip("fastapi")
    for name, make in REFERENCES.items():
        path = ROOT / "docs" / "reference" / name
        assert path.exists() and path.read_text(encoding="utf-8") == make(), (
            f"{path.relative_to(ROOT)} is out of date: run `python -m ampkit.cli.docs`"
        )
    assert docs_main(["--check", "--out", str(ROOT / "docs" / "reference")]) == 0


def test_references_cover_every_flag_and_field(tmp_path):
    pytest.importorskip("fastapi")  # rest-api.md is one of them
    assert docs_main(["--check", "--out", str(tmp_path)]) == 1  # missing files are stale
    assert (
        docs_main(["--out", str(tmp_path)]) == 0
        and docs_main(["--check", "--out", str(tmp_path)]) == 0
    )
    cli, config = (tmp_path / "cli.md").read_text(), (tmp_path / "config.md").read_text()
    for name, flags in FLAGS.items():
        assert f"## `ampkit {name}`" in cli
        for o in flags.split():
            assert o in ("-h", "--help") or f"`{o}" in cli, o
    for f in fields_help():
        assert f"| `{f.name}` | `{f.annotation}` | `{f.default!r}`" in config


def test_serve_max_seconds_is_the_default_run_limit_and_bad_values_are_refused(capsys):
    parser = build_parser()
    assert parser.parse_args(["serve"]).max_seconds == 86_400.0
    assert parser.parse_args(["serve", "--max_seconds", "600"]).max_seconds == 600.0
    for bad in ("0", "inf", "nan", "1e9", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--max_seconds", bad])
        assert "--max_seconds" in capsys.readouterr().err


def test_weight_decay_flag_reaches_train_and_is_checked(capsys):
    parser = build_parser()
    assert parser.parse_args(["train"]).weight_decay == 0.01
    assert parser.parse_args(["train", "--weight_decay", "0"]).weight_decay == 0.0
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--weight-decay", "-0.1"])
    assert "-0.1 must be >= 0 and at most 1" in capsys.readouterr().err


def test_data_that_is_no_file_is_one_clear_line(capsys, tmp_path):
    """``--data`` naming no file: the value, why, what to give -- not a raw ``[Errno 2]``."""
    from ampkit.cli import main

    missing = str(tmp_path / "nonexist.txt")
    assert (
        main(["train", "--model", "gpt", "--size", "tiny", "--steps", "1", "--data", missing]) != 0
    )
    err = capsys.readouterr().err
    assert "no such file" in err and "nonexist.txt" in err and "Errno" not in err


def test_a_warning_from_ampkit_is_one_line_naming_the_command(capsys):
    """A damaged checkpoint skipped on resume is a warning from the library; the command prints it
    as one line of its own (``ampkit train: warning: ...``), not Python's file:line and source."""
    import warnings

    from ampkit.cli import _status
    from ampkit.loop import checkpoint

    def run():
        msg = "checkpoint 'ck/ckpt-00000002.pt' is damaged; falling back"
        warnings.warn_explicit(msg, UserWarning, checkpoint.__file__, 250)
        warnings.warn_explicit("not ours", UserWarning, "/elsewhere/x.py", 3)
        return 0

    assert _status("train", run) == (0, False)
    err = capsys.readouterr().err
    assert (
        "ampkit train: warning: checkpoint 'ck/ckpt-00000002.pt' is damaged; falling back\n" in err
    )
    assert "UserWarning: checkpoint" not in err and "warning: not ours" not in err  # Python's own


# A value that starts with '-' and a digit is a (bad) value, not a flag: argparse alone answers
# "expected one argument". Each case: the words after the command, and what the one line says.
NEGATIVE_VALUES = [
    ("train", ["--memory_budget", "-1GiB"], "memory size '-1GiB' must be > 0"),
    ("train", ["--memory_budget=-1GiB"], "memory size '-1GiB' must be > 0"),
    ("train", ["--memory-budget", "-.5GiB"], "memory size '-.5GiB' must be > 0"),
    ("train", ["--lr", "-1e-3"], "-0.001 must be > 0"),
    ("train", ["--init_scale", "-1e4"], "-10000.0 must be > 0"),
    ("train", ["--steps", "-5"], "-5 must be >= 1"),
    ("bench", ["--repeats", "-1e1"], "-10 must be >= 1"),
    ("bench", ["--warmup", "-1e0"], "invalid int value: '-1e0'"),
    ("tune", ["--tolerance", "-1e-2"], "-0.01 must be >= 0"),
    ("plan", ["--memory", "-1GiB"], "memory size '-1GiB' must be > 0"),
    ("plan", ["--memory=-1GiB"], "memory size '-1GiB' must be > 0"),
    ("serve", ["--max_body", "-1MiB"], "memory size '-1MiB' must be > 0"),
    ("serve", ["--max_seconds", "-5m"], "'-5m' is not a number of seconds"),
    ("serve", ["--max_seconds", "-1e3"], "-1000.0 must be > 0"),
    ("slurm", ["--signal_seconds", "-1e2"], "invalid int value: '-1e2'"),
]


@pytest.mark.parametrize(
    "command,words,says", NEGATIVE_VALUES, ids=[f"{c}{w}" for c, w, _ in NEGATIVE_VALUES]
)
def test_a_negative_value_is_one_line_naming_the_flag_and_why(command, words, says, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, *words])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ampkit {command}: error: "), err
    assert "expected one argument" not in err and "not understood" not in err, err
    assert f"argument {words[0].split('=')[0].replace('-', '_').replace('__', '--')}" in err, err
    assert says in err, err


def test_each_rank_labels_its_lines_with_its_own_rank(capsys, monkeypatch):
    """Under torchrun each process names its own rank in its error lines (every rank said "(rank
    0)": the label was made before the process group existed)."""
    from ampkit.cli import _status

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")

    def run():
        raise ValueError("refused")

    assert _status("train", run) == (2, False)
    assert "ampkit train (rank 1): error: refused" in capsys.readouterr().err
