import json
import os
import subprocess
import sys

import pytest

from ampkit.cli import build_parser, main


def test_info_json(capsys):
    assert main(["info", "--json", "--no-measure"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = [p["name"] for p in report["precisions"]]
    assert names == ["fp32", "tf32", "bf16", "fp16", "bf16-pure", "fp16-pure", "fp8", "fp8-rowwise"]
    assert report["auto"]["precision"] in ("fp32", "bf16", "fp16")
    assert report["auto"]["reason"]
    assert isinstance(report["cpu"]["flags"], list)
    fp8 = next(p for p in report["precisions"] if p["name"] == "fp8")
    if report["device"] == "cpu":
        assert fp8["runs"] is False and "fp8" in fp8["reason"]


@pytest.mark.slow
def test_info_measures_matmul(capsys):
    assert main(["info", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matmul_tflops"]["fp32"] > 0


def test_info_table(capsys):
    assert main(["info", "--no-measure"]) == 0
    out = capsys.readouterr().out
    assert "auto →" in out and "fp16" in out


def test_info_says_that_train_confirms_autos_cpu_pick_by_timing(capsys):
    """``ampkit info`` said "auto → bf16" and ``ampkit train`` then trained in fp32 (its timing of
    the model found bf16 slower), with nothing in info saying that train times the pick."""
    assert main(["info", "--json", "--no-measure", "--device", "cpu"]) == 0
    auto = json.loads(capsys.readouterr().out)["auto"]
    assert main(["info", "--no-measure", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    said = "`ampkit train` confirms it by timing" in out
    assert said == (auto["precision"] != "fp32"), out[-600:]


@pytest.mark.parametrize("spelling", ["--batch_size", "--batch-size"])
def test_hyphen_and_underscore_flags(spelling):
    args = build_parser().parse_args(
        ["train", spelling, "3", "--mixed-precision", "bf16", "--grad_accum_steps", "2"]
    )
    assert args.batch_size == 3 and args.precision == "bf16" and args.accumulation_steps == 2


@pytest.mark.slow
def test_train_json_summary(capsys, tmp_path):
    rc = main(
        [
            "train",
            "--model",
            "gpt",
            "--size",
            "tiny",
            "--steps",
            "6",
            "--batch-size",
            "4",
            "--precision",
            "fp32",
            "--no-progress",
            "--json",
            "--device",
            "cpu",
            "--log_every",
            "3",
            "--log_dir",
            str(tmp_path / "run"),
        ]
    )
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert s["precision"] == "fp32" and s["optimizer_steps"] == 6
    assert s["final_loss"] < s["first_loss"]  # it learns
    assert s["tokens_per_s"] > 0 and s["ms_per_step"] > 0 and s["skipped_steps"] == 0
    assert (tmp_path / "run" / "log.jsonl").exists() and (
        tmp_path / "run" / "summary.json"
    ).exists()


@pytest.mark.slow
def test_train_fp16_progress_summary_and_report(capsys, tmp_path):
    run = tmp_path / "fp16run"
    rc = main(
        [
            "train",
            "--model",
            "mlp",
            "--size",
            "tiny",
            "--steps",
            "12",
            "--precision",
            "16-mixed",
            "--device",
            "cpu",
            "--log-dir",
            str(run),
            "--log_every",
            "4",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert (
        "fp16" in out and "run summary" in out and "skipped steps" in out and "ampkit report" in out
    )
    assert any((run / "tb").iterdir())  # TensorBoard events written
    assert main(["report", str(run), "--metrics", "loss,scale"]) == 0
    assert (run / "report" / "loss.png").exists() and (run / "report" / "scale.png").exists()
    assert not (run / "report" / "memory.png").exists()


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["train", "--precision", "fp61"], "unknown precision 'fp61'"),
        (["train", "--precision", "fp8", "--device", "cpu"], "fp8 needs an NVIDIA GPU"),
        (
            [
                "train",
                "--precision",
                "bf16-pure",
                "--device",
                "cpu",
                "--steps",
                "1",
                "--keep_fp32",
                "nosuch",
            ],
            "matches no module",
        ),
        (["report", "/nonexistent/run"], "does not exist"),
        (  # issue 34's fp16 line without its directory: flag names, as for --resume
            [
                "train",
                "--model",
                "mlp",
                "--size",
                "tiny",
                "--steps",
                "1",
                "--checkpoint_every",
                "1",
            ],
            "--checkpoint_every needs --checkpoint_dir DIR (where to write the checkpoints)",
        ),
    ],
)
def test_train_bad_input_is_a_clear_error(argv, fragment, capsys):
    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["train", "--steps", "0"], ["train", "--batch-size", "-1"], ["train", "--lr", "x"]]
)
def test_argparse_rejects(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "must be" in err or "not a number" in err


@pytest.mark.slow
def test_console_script_installed():
    """The `ampkit` entry point runs as a real subprocess."""
    env = {**os.environ, "COLUMNS": "120"}
    out = subprocess.run(
        [sys.executable, "-m", "ampkit", "info", "--json", "--no-measure"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ampkit"]


@pytest.mark.slow
def test_audit_cli_json_and_user_factory(capsys, monkeypatch):
    import pathlib

    monkeypatch.chdir(
        pathlib.Path(__file__).resolve().parents[2]
    )  # examples/ importable from the repo root
    assert (
        main(
            [
                "audit",
                "--model",
                "examples.unstable_gpt:factory",
                "--size",
                "tiny",
                "--json",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    rep = json.loads(capsys.readouterr().out)
    assert rep["recommended_keep_fp32"] == ["blocks.0.mlp.0", "blocks.0.mlp.2"]
    assert main(["audit", "--model", "mlp", "--precision", "bf16", "--device", "cpu"]) == 0
    assert "numerics audit" in capsys.readouterr().out


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("no_such_module_xyz:factory", "cannot import"),
        ("ampkit.models.builtin:nothing_here", "no callable"),
        ("ampkit.step.hardware:cpu_features", "must return (model, batch_fn)"),
        ("ampkit.models.builtin:build", "calling factory"),
        ("justaname", "neither a built-in"),
    ],
)
def test_bad_user_model(spec, fragment, capsys):
    assert main(["audit", "--model", spec, "--device", "cpu"]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow
def test_train_falls_back_and_diagnoses(capsys, tmp_path, monkeypatch):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])
    rc = main(
        [
            "train",
            "--model",
            "examples.unstable_gpt:factory",
            "--size",
            "tiny",
            "--precision",
            "fp16",
            "--steps",
            "24",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--log_dir",
            str(tmp_path / "r"),
            "--no-progress",
            "--json",
        ]
    )
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert s["precision"] == "bf16" and s["skipped_steps"] == 20
    from ampkit.observe.monitor import read_jsonl

    kinds = [
        r["kind"] for r in read_jsonl(str(tmp_path / "r" / "log.jsonl")) if r["type"] == "event"
    ]
    assert "diagnosis" in kinds and "fallback" in kinds
    diag = next(
        r for r in read_jsonl(str(tmp_path / "r" / "log.jsonl")) if r.get("kind") == "diagnosis"
    )
    assert diag["module"] == "blocks.0.mlp.0" and diag["phase"] == "forward"


@pytest.mark.slow
def test_no_fallback_flag_is_respected(tmp_path, capsys, monkeypatch):
    import pathlib

    monkeypatch.chdir(pathlib.Path(__file__).resolve().parents[2])
    rc = main(
        [
            "train",
            "--model",
            "examples.unstable_gpt:factory",
            "--size",
            "tiny",
            "--precision",
            "fp16",
            "--steps",
            "22",
            "--batch-size",
            "2",
            "--device",
            "cpu",
            "--log_dir",
            str(tmp_path / "r"),
            "--no-progress",
            "--json",
            "--no_fallback",
        ]
    )
    assert rc == 3  # every step skipped: not a success, even though the flags asked for no fallback
    captured = capsys.readouterr()
    s = json.loads(captured.out)
    assert s["precision"] == "fp16" and s["skipped_steps"] == 22
    assert "all 22 optimizer steps" in captured.err and "blocks.0" in captured.err


def test_resume_honours_a_ladder_rung_given_and_a_requeue_keeps_the_runs_own(tmp_path, capsys):
    """``--masters split --resume`` on a ``stochastic+bf16`` checkpoint trained on in
    stochastic+bf16 without a word (the flag was dropped); a rung given on resume is a switch, said,
    as ``--precision`` is; the same command line again (a requeue) changes nothing."""
    from ampkit import CheckpointManager, load_checkpoint

    ck = str(tmp_path / "ck")
    base = ["train", "--model", "mlp", "--size", "tiny", "--batch_size", "8", "--device", "cpu"]
    base += ["--no_progress", "--checkpoint_dir", ck, "--checkpoint_every", "2"]
    first = ["--precision", "bf16-pure:stochastic+bf16"]

    def run(*flags: str, steps: int) -> str:
        log = str(tmp_path / f"l{steps}")
        assert main([*base, *flags, "--steps", str(steps), "--log_dir", log]) == 0
        return " ".join(capsys.readouterr().out.split())

    def rung() -> tuple[str, str]:
        cfg = load_checkpoint(CheckpointManager(ck).list()[-1][1])["amp"]["config"]
        return cfg["masters"], cfg["state_dtype"]

    run(*first, steps=2)
    out = run(*first, "--resume", steps=4)  # a requeue: the same line
    assert "switches" not in out and rung() == ("stochastic", "bf16")
    out = run("--precision", "bf16-pure", "--masters", "split", "--resume", steps=6)
    assert (
        "--masters split switches the checkpoint's bf16-pure:stochastic+bf16 to bf16-pure:split"
        in out
    ), out
    assert "in bf16-pure:split (opt level O2)" in out and rung() == ("split", "fp32")


def test_the_run_directory_and_summary_name_the_ladder_rung(tmp_path, capsys, monkeypatch):
    """Without --log_dir, ``runs/<stamp>-<precision>`` names the rung when it is not the plain one
    (the colon written ``+``: a file name on every system), as the header does; ``--json`` says
    ``precision_spec``. A plain run keeps its plain name."""
    monkeypatch.chdir(tmp_path)
    base = ["train", "--model", "mlp", "--size", "tiny", "--batch_size", "8", "--device", "cpu"]
    base += ["--steps", "1", "--no_progress"]
    rung = ["--precision", "bf16-pure", "--masters", "stochastic", "--state_dtype", "bf16"]
    assert main([*base, *rung]) == 0
    out = " ".join(capsys.readouterr().out.split())
    (made,) = os.listdir("runs")
    assert made.endswith("-bf16-pure+stochastic+bf16"), made
    assert "in bf16-pure:stochastic+bf16 (opt level O2)" in out and f"runs/{made}" in out
    assert main([*base, "--precision", "bf16-pure", "--masters", "split", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision_spec"] == "bf16-pure:split"
    assert any(n.endswith("-bf16-pure+split") for n in os.listdir("runs"))
    assert main([*base, "--precision", "bf16-pure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision_spec"] == "bf16-pure"
    assert {n.rpartition("-pure")[2] for n in os.listdir("runs")} == {
        "",
        "+split",
        "+stochastic+bf16",
    }
