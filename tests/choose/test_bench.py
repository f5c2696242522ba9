import json
import math

import pytest

from ampkit import MixedPrecisionConfig
from ampkit.choose.bench import compare
from ampkit.choose.recommend import tune
from ampkit.choose.speed import within_noise
from ampkit.cli import main
from ampkit.models.builtin import builtin

from ..support.helpers import savefig_dies_halfway


def tiny(name="mlp", batch_size=8):
    model, data = builtin(name, "tiny", batch_size=batch_size)
    return (lambda: builtin(name, "tiny", batch_size=batch_size)[0]), data


@pytest.fixture(scope="module")
def report():
    factory, data = tiny("mlp")
    return compare(
        factory,
        data,
        ["fp32", "bf16", "fp16", "fp8"],
        steps=8,
        warmup=2,
        repeats=4,
        device="cpu",
        model_name="mlp/tiny",
    )


@pytest.mark.slow
def test_compare_structure_and_sanity(report):
    names = [r.precision for r in report.results]
    assert names == ["fp32", "bf16", "fp16", "fp8"]
    ok = {r.precision: r for r in report.results if r.status == "ok"}
    assert set(ok) == {"fp32", "bf16", "fp16"}
    fp8 = report.result("fp8")
    assert fp8.status == "skipped" and "fp8 needs an NVIDIA GPU" in fp8.reason
    for r in ok.values():
        assert r.step_ms > 0 and r.speedup_vs_fp32 > 0 and r.samples_per_s > 0
        assert r.activation_bytes > 0 and r.static_bytes > 0
        assert len(r.losses) == 10 and all(math.isfinite(v) for v in r.losses)
    assert ok["fp32"].loss_gap == 0.0 and ok["fp32"].speedup_vs_fp32 == 1.0
    # same seed, same batches: reduced precision tracks fp32 closely (dtype-sized gaps)
    assert abs(ok["bf16"].loss_gap) < 0.02 and abs(ok["fp16"].loss_gap) < 0.005
    assert ok["fp32"].losses[0] == pytest.approx(ok["bf16"].losses[0], rel=0.02)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["results"][0]["precision"] == "fp32"


def test_tune_zero_tolerance_picks_fp32(report):
    rec = tune(report, tolerance=0.0)
    assert rec.precision == "fp32"
    assert "exceeds the tolerance" in rec.why_not["bf16"] or "slower" in rec.why_not["bf16"]
    assert "could not run here" in rec.why_not["fp8"]


def test_tune_picks_fastest_within_tolerance(report):
    rec = tune(report, tolerance=0.5)
    ok = [r for r in report.results if r.status == "ok"]
    # the fastest, unless its speed-up over fp32 is within the measured noise (then fp32 wins)
    clear = [
        r
        for r in ok
        if r.precision == "fp32" or not within_noise(r.speedup_vs_fp32, r.speedup_spread)
    ]
    assert rec.step_ms == min(r.step_ms for r in clear)
    assert set(rec.why_not) == {r.precision for r in report.results} - {rec.precision}
    assert all(rec.why_not.values())


def test_tune_writes_config_train_and_config_accept(tmp_path, report):
    rec = tune(report, tolerance=0.5)
    path = tmp_path / "t.toml"
    path.write_text(rec.to_toml())
    cfg = MixedPrecisionConfig.from_toml(str(path))
    assert cfg.precision == rec.precision and cfg.accumulation_steps == 1


def test_tune_bad_tolerance(report):
    with pytest.raises(ValueError, match="tolerance"):
        tune(report, tolerance=-1)


@pytest.mark.slow
def test_compare_cnn_with_batchnorm_and_bad_args():
    factory, data = tiny("cnn", batch_size=4)
    rep = compare(factory, data, ["bf16"], steps=2, warmup=1, repeats=1, device="cpu")
    assert [r.precision for r in rep.results] == ["fp32", "bf16"]  # fp32 is always the reference
    with pytest.raises(ValueError, match="steps"):
        compare(factory, data, steps=0)


@pytest.mark.slow
def test_bench_and_tune_cli(tmp_path, capsys):
    out = tmp_path / "b.json"
    png = tmp_path / "b.png"
    assert (
        main(
            [
                "bench",
                "--model",
                "mlp",
                "--precisions",
                "fp32,bf16",
                "--steps",
                "4",
                "--warmup",
                "1",
                "--device",
                "cpu",
                "--json",
                str(out),
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    assert "ampkit bench" in capsys.readouterr().out
    assert json.loads(out.read_text())["results"][1]["precision"] == "bf16"
    assert png.stat().st_size > 10_000
    cfg = tmp_path / "tune.toml"
    assert (
        main(
            [
                "tune",
                "--model",
                "mlp",
                "--precisions",
                "fp32,bf16",
                "--steps",
                "4",
                "--warmup",
                "1",
                "--device",
                "cpu",
                "--tolerance",
                "0",
                "--out",
                str(cfg),
                "--json",
            ]
        )
        == 0
    )
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["precision"] == "fp32"
    assert (
        main(
            [
                "train",
                "--config",
                str(cfg),
                "--model",
                "mlp",
                "--size",
                "tiny",
                "--steps",
                "3",
                "--json",
                "--device",
                "cpu",
                "--log_dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["precision"] == "fp32"


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["bench", "--steps", "0"], "must be >= 1"),
        (["bench", "--batch-size", "-2"], "must be >= 1"),
    ],
)
def test_bench_bad_numbers(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert fragment in capsys.readouterr().err


def test_train_config_file_errors_and_precedence(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[amp]\nprecision = "bf16"\nhysterisis = 2\n')
    assert main(["train", "--config", str(bad)]) == 2
    assert "hysterisis" in capsys.readouterr().err
    bad.write_text('[train]\nbatch_size = "big"\n')
    assert main(["train", "--config", str(bad)]) == 2
    assert "batch_size" in capsys.readouterr().err
    bad.write_text("[train]\nbatchsize = 4\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "unknown [train] key 'batchsize'" in capsys.readouterr().err
    good = tmp_path / "good.toml"
    good.write_text(
        '[amp]\nprecision = "fp16"\ninit_scale = 1024.0\n[train]\nsteps = 2\nmodel = "mlp"\nsize = "tiny"\n'
    )
    # the flag wins over the file's precision; the file's steps and model apply
    assert (
        main(
            [
                "train",
                "--config",
                str(good),
                "--precision",
                "fp32",
                "--json",
                "--device",
                "cpu",
                "--log_dir",
                str(tmp_path / "r"),
            ]
        )
        == 0
    )
    s = json.loads(capsys.readouterr().out)
    assert s["precision"] == "fp32" and s["optimizer_steps"] == 2
    assert (
        main(
            [
                "train",
                "--config",
                str(good),
                "--json",
                "--device",
                "cpu",
                "--log_dir",
                str(tmp_path / "r2"),
            ]
        )
        == 0
    )
    s = json.loads(capsys.readouterr().out)
    assert s["precision"] == "fp16" and s["final_scale"] == 1024.0


def test_fp8_where_it_runs_is_timed_with_no_activation_figure():
    """Where fp8 runs (emulated here; an H100/H200 for real) its row is timed like the others; only
    the activations column stays empty (activations() cannot follow torchao's casts yet). It used to
    raise and lose the whole comparison."""
    pytest.importorskip("torchao")
    factory, data = tiny("gpt")
    report = compare(
        factory, data, ["bf16", "fp8"], steps=2, warmup=1, repeats=1, device="cpu", fp8_emulate=True
    )
    fp8, bf16 = report.result("fp8"), report.result("bf16")
    assert fp8.status == bf16.status == "ok", fp8.reason
    assert fp8.activation_bytes is None and bf16.activation_bytes > 0
    assert fp8.step_ms > 0 and math.isfinite(fp8.final_loss)


@pytest.mark.parametrize(
    "names", [["fp32", "fp32"], ["bf16", "bfloat16"], ["bf16-pure", "bf16-pure:fp32"]]
)
def test_compare_refuses_a_precision_named_twice(names):
    """As the CLI's --precisions: each row is one precision, not silently one row for two names."""
    with pytest.raises(ValueError, match="one precision"):
        compare(lambda: None, lambda i: None, precisions=names)


def test_the_bench_plot_is_written_atomically(tmp_path, monkeypatch):
    """A bench stopped while saving its PNG leaves the previous image whole (and no temporary
    file), never a cut one (the report's images already were)."""
    pytest.importorskip("matplotlib")
    from ampkit.choose.bench import BenchReport, BenchResult

    report = BenchReport(
        results=[
            BenchResult(precision=p, speedup_vs_fp32=s, static_bytes=1 << 20, losses=[2.0, 1.5])
            for p, s in (("fp32", 1.0), ("bf16", 1.3))
        ],
        device="cpu",
        device_name="cpu",
        model="mlp/tiny",
        steps=2,
        batch_size=4,
        accumulation_steps=1,
    )
    path = tmp_path / "bench.png"
    report.plot(str(path))
    before = path.read_bytes()
    savefig_dies_halfway(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        report.plot(str(path))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.png"]
