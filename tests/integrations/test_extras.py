"""Each integration without its package: an ImportError that names the extra to install."""

import importlib
import sys

import pytest


@pytest.mark.parametrize(
    "module,blocked,extra",
    [
        ("ampkit.integrations.lightning", "lightning.pytorch", "lightning"),
        ("ampkit.integrations.hf", "transformers", "hf"),
    ],
)
def test_integration_without_its_package_names_the_extra(monkeypatch, module, blocked, extra):
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, blocked, None)  # import fails, as when not installed
    with pytest.raises(ImportError, match=rf'pip install "ampkit\[{extra}\]"'):
        importlib.import_module(module)


@pytest.mark.parametrize(
    "sink,blocked,args",
    [
        ("MLflowSink", "mlflow", ("file:///tmp/nowhere",)),
        ("WandbSink", "wandb", ("project",)),
    ],
)
def test_tracker_without_its_package_names_the_extra(monkeypatch, sink, blocked, args):
    from ampkit.observe.monitor import trackers

    monkeypatch.setenv(
        "MLFLOW_ALLOW_FILE_STORE", "true"
    )  # (the sink sets it for a file URI: keep it scoped)
    monkeypatch.setitem(sys.modules, blocked, None)
    with pytest.raises(ImportError, match=rf'pip install "ampkit\[{blocked}\]"'):
        getattr(trackers, sink)(*args)
