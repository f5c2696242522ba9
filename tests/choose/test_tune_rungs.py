"""``tune`` over the rungs of bf16-pure's memory ladder (loop/bench.py)."""

import json
import math

import pytest

from ampkit import MixedPrecisionConfig
from ampkit.choose.bench import RUNGS, compare, with_rungs
from ampkit.choose.recommend import tune
from ampkit.choose.speed import within_noise
from ampkit.cli import main
from ampkit.models.builtin import builtin

EXPECTED_BYTES = {
    "fp32": 12,
    "bf16-pure:fp32": 14,
    "bf16-pure:split": 12,
    "bf16-pure:kahan": 12,
    "bf16-pure:stochastic": 10,
    "bf16-pure:stochastic+bf16": 6,
}


@pytest.fixture(scope="module")
def report():
    def factory():
        return builtin("mlp", "tiny", batch_size=8)[0]

    data = builtin("mlp", "tiny", batch_size=8)[1]
    return compare(
        factory,
        data,
        ["fp32", *RUNGS],
        steps=4,
        warmup=1,
        repeats=2,
        device="cpu",
        model_name="mlp/tiny",
    )


def test_each_rung_is_measured_with_its_bytes_per_param(report):
    assert [r.precision for r in report.results] == ["fp32", *RUNGS]
    for r in report.results:
        assert r.status == "ok", r.reason
        # The built-in tiny MLP keeps no norm in fp32 and has no buffers: the ladder's bytes exactly.
        assert r.bytes_per_param == pytest.approx(EXPECTED_BYTES[r.precision], abs=0.05), (
            r.precision
        )
        assert r.step_ms > 0 and math.isfinite(r.loss_gap)
    # Different rungs train differently (stochastic rounding vs exact masters) from the same start.
    assert report.result("bf16-pure:stochastic").losses != report.result("bf16-pure:split").losses


def test_tune_picks_the_fewest_bytes_within_the_tolerance(report):
    rec = tune(report, tolerance=1.0)  # everything qualifies: the 6-byte rung wins
    assert rec.prefer == "memory" and rec.precision == "bf16-pure:stochastic+bf16"
    assert rec.bytes_per_param == pytest.approx(6, abs=0.05)
    assert "more memory: 10.00 B/param vs 6.00" in rec.why_not["bf16-pure:stochastic"]
    assert rec.config == {
        "precision": "bf16-pure",
        "masters": "stochastic",
        "state_dtype": "bf16",
        "accumulation_steps": 1,
    }


def test_tune_drops_rungs_outside_the_tolerance(report):
    gaps = {r.precision: abs(r.loss_gap) for r in report.results}
    tol = (
        sorted(set(gaps.values()))[1] + sorted(set(gaps.values()))[0]
    ) / 2  # only the closest qualify
    rec = tune(report, tolerance=tol)
    assert gaps[rec.precision] <= tol
    for name, gap in gaps.items():
        if gap > tol:
            assert "exceeds the tolerance" in rec.why_not[name]
    fewest = min(EXPECTED_BYTES[n] for n, g in gaps.items() if g <= tol)
    assert EXPECTED_BYTES[rec.precision] == fewest


def test_speed_is_still_there_on_request(report):
    """prefer="speed": the fastest of the candidates clearly faster than fp32 (outside their measured
    spread), fp32 when none is -- which one depends on this machine's timings, the rule does not."""
    rec = tune(report, tolerance=1.0, prefer="speed")
    fp32 = next(r for r in report.results if r.precision == "fp32")
    clear = [
        r
        for r in report.results
        if r.precision == "fp32"
        or not (r.speedup_spread is not None and within_noise(r.speedup_vs_fp32, r.speedup_spread))
    ]
    assert rec.prefer == "speed" and rec.step_ms == min(r.step_ms for r in clear)
    if min(report.results, key=lambda r: r.step_ms) not in clear:  # the fastest was within noise
        assert "cannot tell it from fp32" in rec.note
    assert rec.step_ms <= fp32.step_ms
    with pytest.raises(
        ValueError, match="prefer='size' is not a tune objective; choose one of: speed, memory"
    ):
        tune(report, prefer="size")


def test_the_written_config_carries_the_rung(tmp_path, report):
    path = tmp_path / "t.toml"
    path.write_text(tune(report, tolerance=1.0).to_toml())
    cfg = MixedPrecisionConfig.from_toml(str(path))
    assert (cfg.precision, cfg.masters, cfg.state_dtype) == ("bf16-pure", "stochastic", "bf16")


def test_with_rungs_and_bad_rungs():
    assert with_rungs(["fp32", "bf16-pure", "bf16"]) == ["fp32", *RUNGS, "bf16"]
    assert with_rungs(None)[-len(RUNGS) :] == list(RUNGS)

    def factory():
        return builtin("mlp", "tiny", batch_size=4)[0]

    rep = compare(
        factory,
        builtin("mlp", "tiny", batch_size=4)[1],
        ["bf16-pure:half", "fp16-pure:split"],
        steps=1,
        warmup=0,
        repeats=1,
        device="cpu",
    )
    bad = {r.precision: r.reason for r in rep.results if r.status == "skipped"}
    assert "masters one of fp32, split, kahan, stochastic, none" in bad["bf16-pure:half"]
    assert "only bf16-pure has a memory ladder" in bad["fp16-pure:split"]


@pytest.mark.slow
def test_tune_rungs_cli_then_train_reproduces_the_rung(tmp_path, capsys):
    cfg = tmp_path / "tune.toml"
    assert (
        main(
            [
                "tune",
                "--model",
                "mlp",
                "--precisions",
                "fp32",
                "--rungs",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--repeats",
                "1",
                "--device",
                "cpu",
                "--tolerance",
                "1",
                "--out",
                str(cfg),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "recommended: bf16-pure:stochastic+bf16" in out and "fewest bytes per parameter" in out
    assert 'masters = "stochastic"' in cfg.read_text()
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
                "2",
                "--json",
                "--device",
                "cpu",
                "--log_dir",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16-pure"
    assert (
        main(["train", "--config", str(cfg), "--model", "mlp", "--size", "tiny", "--print_config"])
        == 0
    )
    printed = capsys.readouterr().out  # the settings train resolved from the file: the rung
    assert 'masters = "stochastic"' in printed and 'state_dtype = "bf16"' in printed
