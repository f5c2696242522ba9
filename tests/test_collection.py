"""The suite collects without any optional extra installed (a GPU box without the `serve` extra
runs `pytest -m cuda`): every test module importorskip-s the extras it needs, none imports one at
its top."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The extras of pyproject.toml (and the dev-only packages tests use), by import name.
EXTRAS = (
    "fastapi",
    "uvicorn",
    "starlette",
    "httpx",
    "transformers",
    "accelerate",
    "torchao",
    "lightning",
    "pytorch_lightning",
    "mlflow",
    "wandb",
    "matplotlib",
    "tensorboard",
    "pandas",
    "numpy",
    "hypothesis",
)

# pytest, run as if the extras were not installed: the path finder finds none of them (so both
# `import fastapi` and importlib.util.find_spec("fastapi") answer as without it).
WITHOUT_EXTRAS = """
import importlib.machinery
import sys

EXTRAS = set(sys.argv[1].split(","))
find = importlib.machinery.PathFinder.find_spec


def find_spec(cls, name, path=None, target=None):
    return None if name.partition(".")[0] in EXTRAS else find(name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
import pytest

sys.exit(pytest.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_the_suite_collects_without_the_optional_extras():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the extras' plugins (hypothesis') are gone too
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_EXTRAS,
            ",".join(EXTRAS),
            "--collect-only",
            "-q",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            "tests",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "ERROR" not in out, out[-4000:]  # "ERROR collecting <module>"
    assert "could not import 'fastapi'" in out, out[-2000:]  # the blocker took effect
