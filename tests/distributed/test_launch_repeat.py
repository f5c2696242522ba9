"""``ampkit train --nproc_per_node 2`` ten times in a row: every launch exits 0 with no crash output
(a rare shutdown race). In its own module so that the test runner can put it beside the rest of
``test_launch.py`` on another worker (``--dist loadfile``): it is the suite's most expensive item."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.distributed

TINY = ["--model", "mlp", "--size", "tiny", "--device", "cpu", "--no_progress"]


def ampkit(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampkit", *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ))


@pytest.mark.slow
def test_two_processes_exit_cleanly_every_time(tmp_path):
    for i in range(10):
        r = ampkit("train", "--nproc_per_node", "2", *TINY, "--steps", "1", "--log_dir", str(tmp_path / f"r{i}"))
        assert r.returncode == 0, (i, r.stderr[-3000:])
        for bad in ("terminate called", "Aborted", "Traceback", "SIGABRT", "core dumped", "destroy_process_group"):
            assert bad not in r.stderr, (i, bad, r.stderr[-3000:])
