"""``ampkit train --nproc_per_node 2`` several times in a row: every launch exits 0 with no crash
output (a rare shutdown race once printed one). Every other clean two-process launch of the suite
makes the same check (:func:`tests.helpers.assert_exits_cleanly`: test_launch.py, test_stop.py,
test_slurm.py -- eight more), so a run of the suite checks ten launches; this module adds two
back to back (four before 2026-11-26: two launches cost 44 s of the CI's 15 minutes). In its own module so that the test runner can put it beside the rest of
``test_launch.py`` on another worker (``--dist loadfile``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..helpers import assert_exits_cleanly

pytestmark = pytest.mark.distributed

TINY = ["--model", "mlp", "--size", "tiny", "--device", "cpu", "--no_progress"]


def ampkit(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampkit", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


@pytest.mark.slow
def test_two_processes_exit_cleanly_every_time(tmp_path):
    for i in range(2):
        r = ampkit("train", "--nproc_per_node", "2", *TINY, "--steps", "1", "--log_dir", str(tmp_path / f"r{i}"))
        assert_exits_cleanly(r, f"launch {i}")
