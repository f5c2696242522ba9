"""``ampkit report`` where matplotlib is not installed (a fresh ``pip install -e .``): the summary
and ``report.md`` need no plotting library; ``ampkit train`` ends with "plots: ampkit report RUN",
and that command refused the whole report."""

from __future__ import annotations

import torch

from ampkit import MixedPrecision
from ampkit.observe import report as report_mod
from ampkit.observe.monitor import JSONLSink, Monitor


def _run(path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    mon = Monitor(amp, [JSONLSink(str(path / "log.jsonl"))], log_every=1, samples_per_step=4)
    for _ in range(3):
        with amp.autocast():
            loss = model(torch.randn(4, 8)).pow(2).mean()
        amp.backward(loss)
        amp.step(opt)
    mon.close()
    return path


def test_report_without_matplotlib_writes_the_summary_and_says_how_to_get_plots(
    tmp_path, monkeypatch, capsys
):
    from ampkit.cli import main

    def no_matplotlib():
        raise ImportError('plots need matplotlib: pip install "ampkit[plot]"')

    monkeypatch.setattr(report_mod, "pyplot", no_matplotlib)
    run = _run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert 'pip install "ampkit[plot]"' in out and "final loss" in out, out
    md = (run / "report" / "report.md").read_text()
    assert "| run |" in md and 'pip install "ampkit[plot]"' in md
    assert not list((run / "report").glob("*.png"))
    assert [p.name for p in (run / "report").iterdir()] == ["report.md"]  # no temporary left
