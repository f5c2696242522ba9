"""plan_cache: a repeat `ampkit plan` reads the steps measured before instead of measuring again."""

import argparse
import json

import pytest
import torch

from ampkit.cli import plan as plan_cli
from ampkit.plan import cache as plan_cache
from ampkit.plan import session as estimate_session


def _args(**kw):
    base = dict(
        model="gpt",
        size="tiny",
        memory="24MiB",
        precisions="bf16,fp16",
        batch_size=4,
        json=True,
        workers=1,
        seed=0,
        data=None,
        block_size=None,
        model_config=None,
        verify=False,
        no_cache=False,
    )
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def counted(monkeypatch, tmp_path):
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AMPKIT_PLAN_CACHE")
    counts = {"sessions": 0}
    enter = estimate_session.Session.__enter__

    def counting(self):
        counts["sessions"] += 1
        return enter(self)

    monkeypatch.setattr(estimate_session.Session, "__enter__", counting)
    return counts, tmp_path / "plan"


@pytest.mark.slow
def test_a_repeat_plan_measures_nothing_and_answers_the_same(counted):
    counts, where = counted
    first = plan_cli.plan_rows(_args())
    assert counts["sessions"] == 2 + 1  # bf16 at depths 1 and 2; fp16 as bf16's twin
    files = sorted(where.glob("*.json"))
    assert len(files) == 2
    again = plan_cli.plan_rows(
        _args(memory="32MiB", batch_size=6)
    )  # another budget and batch: the same steps
    assert counts["sessions"] == 3
    fresh = plan_cli.plan_rows(_args(memory="32MiB", batch_size=6, no_cache=True))
    assert counts["sessions"] == 6 and again == fresh
    assert [r["largest_batch"] for r in again] != [
        r["largest_batch"] for r in first
    ]  # the budget did change them
    # a file that does not parse (or lost its entries) is measured again and replaced
    files[0].write_text("{not json")
    files[1].write_text(json.dumps({"measures": {}}))
    assert plan_cli.plan_rows(_args(memory="32MiB", batch_size=6)) == fresh
    assert counts["sessions"] > 6
    for f in files:
        assert json.loads(f.read_text())["measures"]


def test_the_name_changes_with_what_the_measures_depend_on(monkeypatch, tmp_path):
    batch = (torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long))
    with plan_cache.use(tmp_path):
        k = plan_cache.key("gpt", "bf16", "adamw", batch, depths=(1, 2))
        assert k == plan_cache.key("gpt", "bf16", "AdamW", batch, depths=(1, 2))
        others = {
            plan_cache.key("gpt", "fp16", "adamw", batch, depths=(1, 2)),
            plan_cache.key("gpt2", "bf16", "adamw", batch, depths=(1, 2)),
            plan_cache.key("gpt", "bf16", "sgd", batch, depths=(1, 2)),
            plan_cache.key("gpt", "bf16", "adamw", (batch[0][:, :8], batch[1]), depths=(1, 2)),
            plan_cache.key("gpt", "bf16", "adamw", batch, depths=(1, 3)),
        }
        assert k not in others and len(others) == 5
        assert (
            plan_cache.key("gpt", "bf16", lambda p: torch.optim.SGD(p, lr=0.1), batch) is None
        )  # a callable
        assert plan_cache.key("", "bf16", "adamw", batch) is None  # a model with no spec: not kept
    assert plan_cache.key("gpt", "bf16", "adamw", batch) is None  # outside use(): no cache
    monkeypatch.setenv("AMPKIT_PLAN_CACHE", "off")
    assert plan_cache.cache_dir() is None
    monkeypatch.delenv("AMPKIT_PLAN_CACHE")
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    assert (
        plan_cache.cache_dir() == tmp_path / "plan"
    )  # beside the measured auto choices and the native kernels
    monkeypatch.delenv("AMPKIT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert plan_cache.cache_dir() == tmp_path / "home" / ".cache" / "ampkit" / "plan"


def test_a_changed_byte_in_a_kept_measure_is_never_read(tmp_path, caplog):
    """A byte of a kept file changed inside a number (a peak of 1,234,567 read as 1,934,567) still
    parsed, and the next plan answered from it without a word. The file carries its digest; one
    that does not match is not read (measured again and replaced, as a file that does not parse)."""
    m = estimate_session.Measure(
        "bf16", 1234567, {"parameters": 1000}, {"float32": 1000}, (5, 1234567), (1,), (0, 7), 7
    )
    with plan_cache.use(tmp_path):
        plan_cache.save("k", {"bf16": m})
        assert plan_cache.load("k") == {"bf16": m}
        path = tmp_path / "k.json"
        text = path.read_text()
        assert text.count("1234567") == 2
        path.write_text(text.replace("1234567", "1934567", 1))
        with caplog.at_level("WARNING", logger="ampkit"):
            assert plan_cache.load("k") is None
        assert f"plan cache file {path} does not match its digest" in caplog.text  # said, named
        assert "measured again" in caplog.text
        path.write_text(text[:40])  # cut short
        caplog.clear()
        with caplog.at_level("WARNING", logger="ampkit"):
            assert plan_cache.load("k") is None
        assert f"plan cache file {path} is damaged" in caplog.text
        body = json.loads(text)
        del body["sha256"]  # a file without its digest (written before digests) is not read either
        path.write_text(json.dumps(body))
        assert plan_cache.load("k") is None
