import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision
from ampkit.observe.monitor import JSONLSink, Monitor
from ampkit.observe.report import METRICS, load_run, make_report

from ..support.helpers import savefig_dies_halfway

pytest.importorskip("matplotlib")


def write_run(path, precision, steps=30, bad=(7, 15), init_scale=2.0**10):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = MixedPrecision(precision, device="cpu", init_scale=init_scale, growth_interval=5)
    model, opt = amp.setup(model, opt)
    mon = Monitor(amp, [JSONLSink(str(path / "log.jsonl"))], log_every=5, samples_per_step=8)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with amp.autocast():
            loss = F.cross_entropy(model(x), y) * (float("inf") if i in bad else 1.0)
        amp.backward(loss)
        amp.step(opt)
    mon.close()
    return path


def png_stats(path):
    from matplotlib import image

    img = image.imread(str(path))
    return img.shape, float(img[..., :3].std())


@pytest.mark.slow
def test_report_writes_nonblank_pngs_and_markdown(tmp_path):
    run = write_run(tmp_path / "a", "fp16")
    out = make_report(str(run))
    assert [p.rsplit("/", 1)[-1] for p in out["pngs"]] == [f"{m}.png" for m in METRICS]
    for p in out["pngs"]:
        shape, std = png_stats(p)
        assert shape[:2] == (450, 800)
        assert std > 0.02  # not a blank canvas
    md = Path(out["markdown"]).read_text()
    assert "| run |" in md and "fp16" in md and "loss.png" in md
    s = out["summaries"][next(iter(out["summaries"]))]
    assert s["skipped_steps"] == 2 and s["steps"] == 30


@pytest.mark.slow
def test_compare_overlays_runs(tmp_path):
    a = write_run(tmp_path / "fp32", "fp32", bad=())
    b = write_run(tmp_path / "fp16", "fp16", bad=())
    out = make_report(str(a), compare=[str(b)], out_dir=str(tmp_path / "cmp"))
    assert len(out["summaries"]) == 2
    md = Path(out["markdown"]).read_text()
    assert "fp32" in md and "fp16" in md
    # overlay of two runs differs from the single-run plot
    single = make_report(str(a), out_dir=str(tmp_path / "single"), metrics=["loss"])
    h = [hashlib.md5(Path(p).read_bytes()).hexdigest() for p in (single["pngs"][0], out["pngs"][0])]
    assert h[0] != h[1]


def test_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no log.jsonl"):
        load_run(str(tmp_path / "empty"))
    run = write_run(tmp_path / "r", "fp32", steps=5, bad=())
    with pytest.raises(ValueError, match="known metrics: loss, scale, speed, memory"):
        make_report(str(run), metrics=["loss", "throughputz"])


def test_truncated_log_still_reports(tmp_path):
    run = write_run(tmp_path / "r", "fp16", steps=10, bad=())
    with open(run / "log.jsonl", "a") as f:
        f.write(json.dumps({"type": "step", "step": 11})[:15])
    with pytest.warns(UserWarning, match="truncated"):
        out = make_report(str(run), metrics=["loss"])
    assert out["summaries"][next(iter(out["summaries"]))]["steps"] == 10


def test_a_plot_is_written_atomically(tmp_path, monkeypatch):
    """A report stopped while saving an image leaves the previous image whole (and no temporary
    file), never a cut one."""
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "a", "fp16")
    out = make_report(str(run))
    before = {p: Path(p).read_bytes() for p in out["pngs"]}
    savefig_dies_halfway(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        make_report(str(run))
    assert {p: Path(p).read_bytes() for p in out["pngs"]} == before
    assert not [p for p in Path(out["pngs"][0]).parent.iterdir() if ".tmp" in p.name]
