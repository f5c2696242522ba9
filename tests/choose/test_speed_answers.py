"""Speed answers say what they timed and call a ratio inside its own spread "within noise":
auto's check, ``ampkit info``, ``ampkit bench`` and ``ampkit tune`` (issue 34 §5). Synthetic
timings only: no assertion here depends on how fast this machine is."""

import json
import math

import pytest
import torch

from ampkit.choose import autoselect
from ampkit.choose.bench import BenchReport, BenchResult
from ampkit.choose.recommend import tune
from ampkit.choose.speed import Timing, paired_ratio, speed_words, within_noise
from ampkit.cli import main
from ampkit.models.builtin import builtin


# ---------------------------------------------------------------------------- the verdict
def test_paired_ratio_and_spread_from_synthetic_times():
    ratio, spread = paired_ratio([10.0, 10.0, 10.0], [5.0, 5.0, 5.0])
    assert ratio == 2.0 and spread == 0.0
    ratio, spread = paired_ratio([10.0, 11.0, 9.0, 10.0], [10.0, 10.0, 10.0, 10.0])
    # the ratio's distance to the worst pair (1.0 - 0.9) plus half the pairs' range (1.1 - 0.9) / 2
    assert ratio == pytest.approx(1.0) and spread == pytest.approx(0.2)
    assert paired_ratio([3.0], [2.0]) == (1.5, math.inf)  # one repeat: no spread to speak of
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio([1.0, 2.0], [1.0])


@pytest.mark.parametrize(
    "ratio,spread,noise",
    [
        (1.02, 0.04, True),
        (0.97, 0.04, True),
        (1.15, 0.04, False),
        (0.90, 0.04, False),
        (1.5, math.inf, True),
    ],
)
def test_a_ratio_inside_its_spread_is_within_noise(ratio, spread, noise):
    assert within_noise(ratio, spread) is noise
    words = speed_words(ratio, spread)
    assert words.startswith(f"{ratio:.2f}x fp32's speed")
    assert ("within noise" in words) is noise


def test_timing_says_what_threads_repeats_and_spread():
    text = Timing("whole training step", 1, 5, 0.04).describe()
    assert text == "whole training step, 1 thread, 5 repeats, ±4%"
    assert "2 threads, 3 repeats of 2 steps" in Timing("x", 2, 3, 0.1, "2 steps").describe()
    assert "no spread" in Timing("x", 1, 1, math.inf).describe()


# ---------------------------------------------------------------------------- auto's check
@pytest.mark.parametrize(
    "speedup,spread,expected", [(1.03, 0.05, "fp32"), (1.5, 0.05, "bf16"), (0.8, 0.05, "fp32")]
)
def test_auto_keeps_its_pick_only_when_clearly_faster(
    monkeypatch, tmp_path, speedup, spread, expected
):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autoselect, "_measure", lambda *a, **k: (speedup, spread))
    model, batches = builtin("mlp", "tiny", batch_size=8)
    choice = autoselect.measured_choice(
        model, batches, "bf16", torch.device("cpu"), label="mlp/tiny"
    )
    assert choice.precision == expected
    assert f"whole training step, {torch.get_num_threads()} thread" in choice.reason
    assert "3 repeats of 2 steps" in choice.timed and f"±{100 * spread:.0f}%" in choice.timed
    assert ("within noise" in choice.reason) == (abs(speedup - 1) <= spread)
    again = autoselect.measured_choice(
        model, batches, "bf16", torch.device("cpu"), label="mlp/tiny"
    )
    assert (
        again.cached and again.precision == expected and again.timed == choice.timed
    )  # the cache keeps it


def test_a_changed_byte_in_autos_cache_is_never_read(monkeypatch, tmp_path, caplog):
    """One byte of ``auto-precision.json`` changed inside a cached speed-up (0.75 read as 1.75)
    still parsed, and ``auto`` then trained in bf16 "by cached measurement" where it had measured
    bf16 slower. Each verdict carries its digest; one that does not match is measured again."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    calls = []

    def measure(*a, **k):
        calls.append(1)
        return 0.75, 0.01

    monkeypatch.setattr(autoselect, "_measure", measure)
    model, batches = builtin("mlp", "tiny", batch_size=8)

    def choose():
        return autoselect.measured_choice(model, batches, "bf16", torch.device("cpu"))

    assert choose().precision == "fp32" and len(calls) == 1
    assert choose().cached and len(calls) == 1
    path = tmp_path / "auto-precision.json"
    text = path.read_text()
    assert text.count('"speedup": 0.75') == 1
    path.write_text(text.replace('"speedup": 0.75', '"speedup": 1.75'))
    with caplog.at_level("WARNING", logger="ampkit"):
        again = choose()
    assert f"{path} holds 1 verdict(s) that do not match their digest" in caplog.text
    assert "measured again" in caplog.text
    assert again.precision == "fp32" and not again.cached and len(calls) == 2
    assert choose().cached and len(calls) == 2  # the verdict measured again is kept, whole
    path.write_text(text[: len(text) // 2])  # cut short: not JSON at all
    caplog.clear()
    with caplog.at_level("WARNING", logger="ampkit"):
        assert not choose().cached and len(calls) == 3
    assert f"{path} is damaged (not JSON" in caplog.text


# ---------------------------------------------------------------------------- bench and tune
def fake_report(bf16_ms, spread, gap=0.001):
    rows = [
        BenchResult(
            "fp32",
            step_ms=10.0,
            speedup_vs_fp32=1.0,
            speedup_spread=0.0,
            final_loss=2.0,
            loss_gap=0.0,
        ),
        BenchResult(
            "bf16",
            step_ms=bf16_ms,
            speedup_vs_fp32=10.0 / bf16_ms,
            speedup_spread=spread,
            final_loss=2.0 * (1 + gap),
            loss_gap=gap,
        ),
    ]
    return BenchReport(
        results=rows,
        device="cpu",
        device_name="a CPU",
        model="mlp/tiny",
        steps=10,
        batch_size=8,
        accumulation_steps=1,
        threads=2,
        repeats=5,
    )


def test_tune_does_not_pick_what_it_cannot_tell_from_fp32():
    rec = tune(fake_report(9.8, 0.05))  # 1.02x, spread ±5%
    assert rec.precision == "fp32"
    assert (
        "not clearly faster than fp32" in rec.why_not["bf16"]
        and "within noise (±5%)" in rec.why_not["bf16"]
    )
    assert "bf16 timed fastest" in rec.note and "cannot tell it from fp32" in rec.note
    toml = rec.to_toml()
    assert 'precision = "fp32"' in toml and "within noise" in toml
    assert "# timed: whole training step, 2 threads, 5 repeats" in toml
    clear = tune(fake_report(5.0, 0.05))  # 2x, spread ±5%
    assert clear.precision == "bf16" and clear.note == ""
    assert "slower" in clear.why_not["fp32"]
    legacy = fake_report(9.8, 0.05)
    legacy.results[1].speedup_spread = None  # a report made without spreads: taken as exact
    assert tune(legacy).precision == "bf16"


def test_bench_table_says_what_it_timed_and_which_speed_up_is_noise():
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(fake_report(9.8, 0.05).table())
    text = console.export_text()
    assert "timed: whole training step, 2 threads, 5 repeats" in text
    assert "1.02x within noise (±5%)" in text
    console = Console(width=300, record=True)
    console.print(fake_report(5.0, 0.05).table())
    assert "2.00x" in console.export_text() and "within noise (" not in console.export_text()


def test_tune_cli_writes_fp32_and_says_why_when_the_pick_is_noise(monkeypatch, tmp_path, capsys):
    from ampkit.cli import bench as cli_bench

    monkeypatch.setattr(cli_bench, "_bench_report", lambda args: fake_report(9.8, 0.05))
    out = tmp_path / "t.toml"
    assert main(["tune", "--model", "mlp", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended: fp32" in text and "cannot tell it from fp32" in text
    assert "timed: whole training step, 2 threads, 5 repeats" in text
    assert 'precision = "fp32"' in out.read_text()
    assert main(["tune", "--model", "mlp", "--out", str(out), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["precision"] == "fp32" and "within noise" in rec["why_not"]["bf16"] and rec["timed"]


# ---------------------------------------------------------------------------- info
def test_info_says_it_timed_one_matmul_with_threads_repeats_and_spread(capsys):
    assert main(["info", "--json", "--device", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    timed = report["matmul_timed"]
    assert "512x512 matmul (not a training step)" in timed
    assert f"{torch.get_num_threads()} thread" in timed and "5 repeats" in timed and "±" in timed
    rows = [r for r in report["precisions"] if "matmul_speedup_vs_fp32" in r]
    assert rows and all("fp32's speed" in r["matmul_speedup_words"] for r in rows)
    assert main(["info", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps long lines)
    assert "timed: one 512x512 matmul" in out


# ------------------------------------------------- tune on a loaded machine (injected timings)
FP32_LOADED = [140.0, 140.0, 140.0, 12.5, 12.4]  # three of fp32's five blocks hit by a neighbour
SAME = [12.3, 12.4, 12.2, 12.3, 12.4]  # a candidate no faster than fp32 really is


def test_a_ratio_made_by_outliers_is_within_noise():
    ratio, spread = paired_ratio(FP32_LOADED, SAME)
    assert ratio > 10  # the medians alone say 11x: the noise, not the precision
    assert within_noise(ratio, spread)
    assert "within noise" in speed_words(ratio, spread)
    ratio, spread = paired_ratio([13.0, 13.1, 12.9, 13.2, 13.0], [10.0, 10.1, 9.9, 10.0, 10.2])
    assert ratio == pytest.approx(1.3, abs=0.01) and not within_noise(ratio, spread)


def test_a_spread_over_100_percent_is_said_in_words_not_as_a_figure():
    """On a loaded machine the spread can be ±1559%: a figure that says nothing. Above ±100% every
    answer says in words that the repeats disagree and gives no speed verdict."""
    import re

    from rich.console import Console

    ratio, spread = paired_ratio(FP32_LOADED, SAME)
    assert spread > 10 and within_noise(ratio, spread)  # ±1559%: no verdict, as before

    def huge(text: str) -> bool:  # a figure over ±100% anywhere in the text
        return any(int(n) > 100 for n in re.findall(r"±([0-9]+)%", text))

    words = speed_words(ratio, spread)
    assert "within noise" in words and "no speed verdict" in words and not huge(words)
    assert "disagree by more than ±100%" in words
    timed = Timing("whole training step", 2, 5, spread).describe()
    assert "disagree by more than ±100%" in timed and not huge(timed)
    console = Console(width=300, record=True)
    console.print(fake_report(9.8, spread).table())
    table = console.export_text()
    assert "no speed verdict" in table and not huge(table)
    assert not huge(tune(fake_report(9.8, spread)).why_not["bf16"])
    assert speed_words(1.02, 1.0).endswith("within noise (±100%)")  # the rule's edge: a figure


def test_a_consistent_speed_up_keeps_its_verdict_whatever_its_spread():
    """Pairs from 5x to 7x: a spread of 2 (±200%), yet even the worst pair is 5x fp32's speed, so
    the ratio is outside its spread and says so (the verdict rule is not the figure's)."""
    ratio, spread = paired_ratio([50.0, 60.0, 70.0, 60.0, 60.0], [10.0] * 5)
    assert ratio == pytest.approx(6.0) and spread == pytest.approx(2.0)
    assert not within_noise(ratio, spread) and speed_words(ratio, spread) == "6.00x fp32's speed"


@pytest.fixture(scope="module")
def injected(request):
    """``compare`` on a tiny MLP whose timed blocks report the given times instead of measuring."""
    from ampkit.choose import bench

    def run(times):
        real = bench._timed_blocks

        def fake(runs, *a, **k):
            for name, r in runs.items():
                r.times[:] = times[name]

        bench._timed_blocks = fake
        try:
            factory = lambda: builtin("mlp", "tiny", batch_size=8)[0]  # noqa: E731
            data = builtin("mlp", "tiny", batch_size=8)[1]
            return bench.compare(
                factory, data, ["fp32", "bf16"], steps=5, warmup=2, repeats=5, device="cpu"
            )
        finally:
            bench._timed_blocks = real

    return run


def test_tune_writes_no_pick_from_an_outlier_in_fp32s_times(injected, tmp_path):
    report = injected({"fp32": FP32_LOADED, "bf16": SAME})
    bf16 = report.result("bf16")
    assert bf16.speedup_vs_fp32 > 10  # what was picked before: "11.35x fp32"
    rec = tune(report, tolerance=1.0)  # the loss gap is not what this is about
    assert rec.precision == "fp32" and "within noise" in rec.why_not["bf16"]
    assert "cannot tell it from fp32" in rec.note


def test_tune_picks_a_consistent_speedup(injected):
    fp32 = [13.0, 13.1, 12.9, 13.2, 13.0]
    report = injected({"fp32": fp32, "bf16": [t / 1.3 for t in fp32]})
    rec = tune(report, tolerance=1.0)
    assert rec.precision == "bf16" and rec.note == ""
    assert rec.speedup_vs_fp32 == pytest.approx(1.3)
