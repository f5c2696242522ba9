"""What a new user touches first (hardening issue 34 §5), one test per failure, run as a user runs it."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from ampkit import MixedPrecision, Trainer

ROOT = pathlib.Path(__file__).resolve().parents[2]


# 1 ------------------------------------------------------------------------- every API takes what the Trainer takes
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.lin(x).float(), y)


def loader(n: int = 40, batch: int = 8, shuffle: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(
        TensorDataset(x, x.sum(1, keepdim=True)),
        batch_size=batch,
        shuffle=shuffle,
        generator=torch.Generator().manual_seed(2) if shuffle else None,
    )


def test_trainer_evaluates_on_a_dataloader():
    torch.manual_seed(0)
    model, opt = Net(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    val = loader(n=24, batch=8)  # 3 batches: fewer than eval_steps=4, so all 3 are used
    t = Trainer(model, opt, amp, loader(), progress=False, eval_batches=val, eval_every=2)
    summary = t.fit(4)
    assert [s for s, _ in summary.eval_losses] == [2, 4]
    with torch.no_grad():  # the same model, the same batches, the same process: bitwise
        ref = torch.stack([model(x, y).float() for x, y in val]).mean().item()
    assert summary.eval_losses[-1][1] == ref
    assert t.evaluate() == ref  # a DataLoader is read anew at each evaluation


def test_eval_batches_that_cannot_be_read_again_are_refused_at_construction():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    with pytest.raises(TypeError, match="eval_batches is a one-shot iterator"):
        Trainer(model, opt, amp, loader(), eval_batches=(b for b in loader()), eval_every=2)
    with pytest.raises(TypeError, match="eval_batches='int'"):
        Trainer(model, opt, amp, loader(), eval_batches=3, eval_every=2)


def test_compare_takes_a_dataloader_and_sees_its_batches_in_order():
    data = loader(n=24, batch=8, shuffle=True)  # 3 batches an epoch: compare reads several epochs
    rep = ampkit.compare(Net, data, ["fp32", "bf16"], steps=4, warmup=1, repeats=1, device="cpu")
    ok = {r.precision: r for r in rep.results if r.status == "ok"}
    assert set(ok) == {"fp32", "bf16"} and rep.batch_size == 8 and ok["fp32"].samples_per_s > 0
    # the fp32 row trained on the loader's batches, epoch after epoch, as the Trainer walks them
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    summary = Trainer(
        model, opt, amp, loader(n=24, batch=8, shuffle=True), progress=False, log_every=1
    ).fit(5)
    assert ok["fp32"].losses == pytest.approx(summary.losses, rel=0, abs=0)


def test_compare_takes_the_trainers_loss_fn_for_a_model_that_returns_outputs():
    """A plain model (``model(x)`` -> outputs) and a DataLoader of ``(x, y)``: the Trainer takes it
    with ``loss_fn``, so compare does too (it called ``model(x, y)``: a TypeError)."""

    def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).float(), y)

    data = loader(n=24, batch=8)
    rep = ampkit.compare(
        lambda: torch.nn.Linear(8, 1), data, ["fp32", "bf16"], steps=4, warmup=1, repeats=1,
        device="cpu", loss_fn=loss_fn,
    )  # fmt: skip
    ok = {r.precision: r for r in rep.results if r.status == "ok"}
    assert set(ok) == {"fp32", "bf16"} and ok["bf16"].activation_bytes
    torch.manual_seed(0)  # the fp32 row is the Trainer's run with the same loss_fn, loss for loss
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    summary = Trainer(
        model, opt, amp, loader(n=24, batch=8), loss_fn=loss_fn, progress=False, log_every=1
    ).fit(5)
    assert ok["fp32"].losses == pytest.approx(summary.losses, rel=0, abs=0)


def test_confirm_auto_takes_a_dataloader(tmp_path, monkeypatch):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    model = Net()
    amp = MixedPrecision("auto", device="cpu")
    choice = ampkit.confirm_auto(amp, model, loader(), use_cache=False)
    assert choice.precision == amp.precision.name


# 2 ------------------------------------------------------------------------- the seed guides' on/off switches
@pytest.mark.parametrize(
    "kwargs, precision",
    [
        # the seed guides' first config examples, as written
        (
            {
                "enabled": True,
                "dtype": torch.float16,
                "init_scale": 65536.0,
                "growth_factor": 2.0,
                "backoff_factor": 0.5,
                "growth_interval": 2000,
            },
            "fp16",
        ),
        (
            {
                "use_mixed_precision": True,
                "mixed_precision_dtype": "bfloat16",
                "gradient_accumulation_steps": 4,
                "max_grad_norm": 1.0,
            },
            "bf16",
        ),
        ({"use_mixed_precision": True}, "auto"),
        ({"enabled": False, "dtype": "float16"}, "fp32"),  # off: fp32, whatever dtype comes with it
        ({"use_mixed_precision": False}, "fp32"),
        # Accelerate-style ``mixed_precision`` given as a switch: "precision=True has type bool"
        # named a key the user had not typed
        ({"mixed_precision": True}, "auto"),
        ({"mixed_precision": True, "dtype": "float16"}, "fp16"),
        ({"mixed_precision": False, "dtype": "float16"}, "fp32"),
    ],
)
def test_seed_switches_turn_mixed_precision_on_and_off(kwargs, precision):
    cfg = ampkit.MixedPrecisionConfig(**kwargs)
    assert cfg.precision == precision
    assert ampkit.MixedPrecisionConfig.from_dict(dict(kwargs)).precision == precision
    assert MixedPrecision(device="cpu", **kwargs).config.precision == precision


def test_switch_off_in_the_engine_and_a_toml_file(tmp_path):
    assert MixedPrecision("bf16", device="cpu", enabled=False).precision.name == "fp32"
    assert (
        ampkit.MixedPrecisionConfig(precision="fp16").replace(use_mixed_precision=False).precision
        == "fp32"
    )
    path = tmp_path / "amp.toml"
    path.write_text('[amp]\nenabled = true\ndtype = "float16"\ninit_scale = 65536\n')
    assert ampkit.MixedPrecisionConfig.from_toml(str(path)).precision == "fp16"
    from ampkit.cli import main

    path.write_text("[amp]\nuse_mixed_precision = false\n[train]\nsteps = 1\n")
    assert (
        main(
            [
                "train",
                "--config",
                str(path),
                "--model",
                "mlp",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--no_progress",
                "--log_dir",
                str(tmp_path / "run"),
                "--json",
            ]
        )
        == 0
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"enabled": "yes"}, "invalid enabled='yes': must be true or false"),
        ({"use_mixed_precision": 1}, "invalid use_mixed_precision=1: must be true or false"),
        ({"enabled": True, "use_mixed_precision": False}, "contradict each other"),
        ({"use_mixed_precison": True}, "did you mean 'use_mixed_precision'"),
    ],
)
def test_switch_errors_say_what_is_valid(kwargs, message):
    with pytest.raises(ampkit.ConfigError, match=message):
        ampkit.MixedPrecisionConfig(**kwargs)


def test_coming_from_guide_config_example_prints_what_its_comments_say():
    text = (ROOT / "docs" / "guides" / "coming-from.md").read_text()
    block = next(
        b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "use_mixed_precision" in b
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "coming-from.md", "exec"), {})
    said = re.findall(r"#\s*(\S+)\s*$", block, re.M)  # each print's value, as its comment says
    assert out.getvalue().split() == said


# 4 ------------------------------------------------------------------------- typos: one line, the closest name
@pytest.mark.parametrize(
    "argv, line",
    [
        (
            ["train", "--precison", "bf16"],
            "ampkit train: unknown flag '--precison' (did you mean '--precision'?)",
        ),
        (
            ["train", "--precison=bf16", "--steps", "3"],
            "ampkit train: unknown flag '--precison' (did you mean '--precision'?)",
        ),
        (
            ["bench", "--precisons", "fp32"],
            "ampkit bench: unknown flag '--precisons' (did you mean '--precisions'?)",
        ),
        (
            ["trian"],
            "ampkit: unknown command 'trian' (did you mean 'train'?); choose one of: info, train",
        ),
        (["train", "--steps", "x"], "ampkit train: error: argument --steps: 'x' is not an integer"),
        # a mistyped choice: the closest one too (argparse listed the choices only)
        (["train", "--size", "tinny"], "invalid choice: 'tinny' (did you mean 'tiny'?)"),
        (["plan", "--size", "smal"], "invalid choice: 'smal' (did you mean 'small'?)"),
        (
            ["bench", "--precisions", "fp32,bf17"],
            "ampkit bench: error: argument --precisions: unknown precision "
            "'bf17' (did you mean 'bf16'?)",
        ),
        (["tune", "--precisions", "fp32,bf16-pure:splt"], "unknown ladder rung 'bf16-pure:splt'"),
        (["bench", "--precisions", "bf16-pure:splt"], "(did you mean 'bf16-pure:split'?)"),
        (
            ["plan", "--memory", "1GiB", "--precisions", "bf16-pure:stochastic+fp16"],
            "(did you mean 'bf16-pure:stochastic+bf16'?)",
        ),
        (["plan", "--memory", "1GiB", "--precisions", "bf17"], "(did you mean 'bf16'?)"),
        # a precision named twice (a plan printed the same row twice; bench kept one silently)
        (["bench", "--precisions", "fp32,bf16,fp32"], "'fp32' and 'fp32' are one precision"),
        (["plan", "--memory", "1GiB", "--precisions", "fp32,float32"], "'fp32' and 'float32'"),
        (["tune", "--precisions", "bf16,bfloat16"], "'bf16' and 'bfloat16' are one precision"),
        (["bench", "--precisions", "bf16-pure,bf16-pure:fp32"], "are one precision (bf16-pure)"),
        # a value typed without its flag: the flag it belongs to
        (
            ["explain", "bf16-pure"],
            "unexpected argument 'bf16-pure' (did you mean '--precision bf16-pure'?)",
        ),
        (["train", "mlp"], "unexpected argument 'mlp' (did you mean '--model mlp'?)"),
        (["bench", "fp32,bf16"], "(did you mean '--precisions fp32,bf16'?)"),
        # an output in a directory that is not there: refused before measuring (it measured, then
        # failed at the write, the results lost; tune's error named its temporary file)
        (["bench", "--json", "nodir/b.json"], "argument --json: 'nodir/b.json': the directory"),
        (["bench", "--plot", "nodir/b.png"], "argument --plot: 'nodir/b.png': the directory"),
        (["tune", "--out", "nodir/t.toml"], "argument --out: 'nodir/t.toml': the directory"),
        (["tune", "--out", "."], "argument --out: '.' is a directory"),
    ],
)
def test_usage_errors_are_one_line_with_the_closest_name(argv, line, capsys, tmp_path, monkeypatch):
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)  # (before the fix, tune ran and wrote its file here)

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and line in err, err


@pytest.mark.parametrize(
    "model, hint",
    [
        ("gtp", "(did you mean 'gpt'?)"),
        ("gtp2", "(did you mean 'gpt2'?)"),
        ("lama", "(did you mean 'llama'?)"),
        ("cfg", "(did you mean 'cfg.json'?)"),  # the config file, typed without .json
        ("emptydir", "emptydir holds no config.json"),
    ],
)
def test_a_mistyped_model_gets_the_closest_name(model, hint, capsys, tmp_path, monkeypatch):
    """``--model gtp`` listed the choices but named none as the closest."""
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "emptydir").mkdir()
    assert main(["plan", "--model", model, "--memory", "1GiB", "--precisions", "fp32"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and hint in err, err


def test_steps_and_epochs_typed_together_are_refused_before_training(capsys, tmp_path, monkeypatch):
    """``ampkit train --steps 3 --epochs 1`` trained 625 steps (--epochs won without a word)."""
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", "mlp", "--size", "tiny", "--steps", "3", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "ampkit train: error: --steps 3 and --epochs 1 both say how long to train" in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything ran


# 3 ------------------------------------------------------------------------- names and headers say what runs
MLP = [
    "train",
    "--model",
    "mlp",
    "--size",
    "tiny",
    "--device",
    "cpu",
    "--batch_size",
    "8",
    "--no_progress",
]


def test_auto_that_measures_fp32_names_the_run_fp32(tmp_path, monkeypatch, capsys):
    from ampkit.choose import autoselect
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        autoselect,
        "measured_choice",
        lambda model, batches, candidate, *a, **k: autoselect.Choice(
            "fp32",
            f"the hardware rule picks {candidate}, but it measured slower, so fp32",
            {},
            False,
        ),
    )
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    assert main([*MLP, "--steps", "1"]) == 0
    err = " ".join(capsys.readouterr().out.split())
    assert [p.name.rsplit("-", 1)[1] for p in (tmp_path / "runs").iterdir()] == ["fp32"]
    assert " in fp32 (opt level O0)" in err


def test_resumed_run_header_and_name_say_the_checkpoints_precision(tmp_path, monkeypatch, capsys):
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    ck = ["--checkpoint_dir", "ck", "--checkpoint_every", "1"]
    assert main([*MLP, "--precision", "fp32", "--steps", "1", *ck, "--log_dir", "first"]) == 0
    capsys.readouterr()
    assert (
        main([*MLP, "--steps", "2", *ck, "--resume"]) == 0
    )  # the default precision (auto) is not asked for
    out = " ".join(capsys.readouterr().out.split())
    header = out.split("ampkit train: ", 1)[1].split(" — ", 1)[0]
    assert header.endswith("in fp32 (opt level O0)"), out
    assert "at step 1 in fp32" in out
    assert [p.name.rsplit("-", 1)[1] for p in (tmp_path / "runs").iterdir()] == ["fp32"]


def test_a_resumed_ladder_run_says_its_rung(tmp_path, monkeypatch, capsys):
    """The header named ``bf16-pure:split``, the resume line after it "in bf16-pure"."""
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    ck = ["--checkpoint_dir", "ck", "--checkpoint_every", "1", "--precision", "bf16-pure:split"]
    assert main([*MLP, "--steps", "1", *ck]) == 0
    capsys.readouterr()
    assert main([*MLP, "--steps", "2", *ck, "--resume"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "at step 1 in bf16-pure:split" in out, out


# 5 ------------------------------------------------------------------------- what a run says
def test_epochs_print_a_line_per_epoch_and_the_total_time(tmp_path, capsys):
    from ampkit.cli import main

    argv = [
        "train",
        "--model",
        "mlp",
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--no_progress",
        "--batch_size",
        "2048",
        "--epochs",
        "2",
    ]
    assert main([*argv, "--log_dir", str(tmp_path / "a")]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    epochs = [line for line in lines if line.startswith("epoch ")]
    assert [line.split(" · ")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"], lines
    assert all(
        " steps · mean loss " in line and line.endswith(("s", "samples/s")) for line in epochs
    )
    total = next(line for line in lines if " steps in " in line)
    steps = sum(int(line.split(" · ")[1].split()[0]) for line in epochs)
    assert total.startswith(f"{steps} steps in ")
    import json

    assert main([*argv, "--log_dir", str(tmp_path / "b"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seconds"] > 0 and [e["epoch"] for e in out["epochs"]] == [0, 1]


def readme_commands() -> list[str]:
    """The README's ``ampkit ...`` command lines: its bash blocks and the quick start's table."""
    text = (ROOT / "README.md").read_text()
    lines = [
        ln.split("  #")[0].strip()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for ln in block.splitlines()
    ]
    lines += [
        c
        for row in text.splitlines()
        if row.startswith("| ")
        for c in re.findall(r"`(ampkit [^`]*)`", row)
    ]
    out = []
    for line in lines:
        for part in line.split("&&"):
            if part.strip().startswith("ampkit "):
                out.append(part.strip())
    return list(dict.fromkeys(out))


def test_readme_ampkit_commands_parse_as_typed():
    import shlex

    from ampkit.cli import build_parser

    commands = readme_commands()
    assert "ampkit report runs/" in commands and len(commands) >= 10
    for command in commands:
        assert not set(command) & set("<>|;$"), command  # nothing the shell would take for itself
        build_parser().parse_args(
            shlex.split(command)[1:]
        )  # SystemExit(2) on anything argparse refuses


def test_report_of_a_directory_of_runs_is_its_latest_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from ampkit.cli import main

    monkeypatch.chdir(tmp_path)
    for name in ("runs/a", "runs/b"):
        assert (
            main(
                [*MLP, "--precision", "fp32", "--steps", "2", "--log_every", "1", "--log_dir", name]
            )
            == 0
        )
    capsys.readouterr()
    assert main(["report", "runs/"]) == 0  # as the README types it
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "the latest run in runs/: runs/b" in out
        and (tmp_path / "runs/b/report/report.md").is_file()
    )
    assert not (tmp_path / "runs/a/report").exists()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_plan_says_which_device_its_figures_are_for(capsys):
    import json

    from ampkit.cli import main
    from ampkit.step.hardware import device_info

    name = device_info("cpu").name
    argv = [
        "plan",
        "--model",
        "mlp",
        "--size",
        "tiny",
        "--memory",
        "1GiB",
        "--precisions",
        "fp32",
        "--no_cache",
    ]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["device"], out["device_name"]) == ("cpu", name)
    assert main(argv) == 0
    assert f"figures for cpu ({name})" in " ".join(capsys.readouterr().out.split())


# 6 ------------------------------------------------------------------------- the quick start
EXTRAS = (
    "tensorboard",
    "matplotlib",
    "torchao",
    "transformers",
    "accelerate",
    "lightning",
    "lightning_fabric",
    "pytorch_lightning",
    "mlflow",
    "wandb",
    "fastapi",
    "uvicorn",
    "httpx",
    "pandas",
    "hypothesis",
)
_CORE_ONLY = f"""
import sys
from importlib.machinery import PathFinder

class Extras:  # the path finder, blind to what `pip install -e .` does not install (as on a fresh machine)
    def find_spec(self, name, path=None, target=None):
        return None if name.split(".")[0] in {EXTRAS!r} else PathFinder.find_spec(name, path, target)

    def invalidate_caches(self):
        PathFinder.invalidate_caches()

sys.meta_path[:] = [Extras() if f is PathFinder else f for f in sys.meta_path]
import importlib.util
assert importlib.util.find_spec("matplotlib") is None
from ampkit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_ampkit_train_runs_with_the_core_dependencies_only(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "AMPKIT_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _CORE_ONLY,
            "train",
            "--size",
            "tiny",
            "--steps",
            "1",
            "--no_progress",
            "--precision",
            "fp32",
        ],  # the default model and data; auto's timing would add steps
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0 and "Warning" not in r.stderr, (
        r.stderr
    )  # (torch warns without numpy: a core dependency)
    out = " ".join(r.stdout.split())
    assert "ampkit train: gpt/tiny" in out and list((tmp_path / "runs").iterdir())
    assert (
        'pip install "ampkit[tensorboard]"' in out
    )  # the note says how to get TensorBoard, in full


def test_quick_start_is_two_lines_and_ci_runs_exactly_them():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    line1, line2 = [ln.split("  #")[0].strip() for ln in block.strip().splitlines()]
    assert line1 == (
        "pip install torch --index-url https://download.pytorch.org/whl/cpu && pip install -e . "
        "&& ampkit train"
    )  # what the main job needs, then the main job: no extra
    assert line2 == 'pip install -e ".[dev]" && pytest'
    ci = (ROOT / ".ci" / "run").read_text()
    for line in (line1, line2):
        assert line in ci.splitlines() or any(
            ln.startswith(line + " ||") for ln in ci.splitlines()
        ), line


def test_explain_fp8_on_a_cpu_takes_the_flag_its_error_names(capsys):
    """``ampkit explain --precision fp8`` on a CPU said 'or fp8_emulate=True to emulate it', which
    explain had no way to give; the error names ``--fp8_emulate`` and explain takes it."""
    pytest.importorskip("torchao")
    from ampkit.cli import main

    base = ["explain", "--model", "mlp", "--size", "tiny", "--device", "cpu", "--precision", "fp8"]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert "--fp8_emulate" in err and "fp8_emulate=True" not in err, err
    assert main([*base, "--fp8_emulate", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"precision": "fp8"' in out, out[:500]


def test_audit_fp8_on_a_cpu_names_no_setting_audit_lacks(capsys):
    """``ampkit audit --precision fp8`` on a CPU pointed at 'fp8_emulate=True', which audit has no
    way to take (it audits autocast's half dtypes)."""
    from ampkit.cli import main

    argv = ["audit", "--model", "mlp", "--size", "tiny", "--device", "cpu", "--precision", "fp8"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot run here" in err and "fp8_emulate" not in err, err
