"""Each run's memory cap (ampkit.service.memcap): a run that needs more memory than its share fails
with "out of memory" and the cap named, instead of waking the machine's OOM killer (a recommend
job for gpt2 asked 23.7 GB of a 23 GB machine and the kernel killed processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ampkit.service import memcap
from ampkit.service.supervise import launch_path, read_record, supervisor_command, write_private

from .server_process import end as _end
from .server_process import serve as _serve


def test_the_default_cap_shares_the_machine_between_the_concurrent_runs(monkeypatch) -> None:
    monkeypatch.setattr(memcap, "machine_bytes", lambda: 20_000_000_000)
    assert memcap.run_cap(None, 1) == 18_000_000_000
    assert memcap.run_cap(None, 3) == 6_000_000_000
    assert memcap.run_cap(2.5, 3) == 2_500_000_000  # given: as given
    assert memcap.run_cap(None, 40) == memcap.FLOOR  # many runs: not below the floor
    monkeypatch.setattr(memcap, "machine_bytes", lambda: 1_000_000_000)
    assert memcap.run_cap(None, 4) == 900_000_000  # a small machine: its share, whole
    monkeypatch.setattr(memcap, "machine_bytes", lambda: None)
    assert memcap.run_cap(None, 1) is None  # unknown machine: no cap


def test_the_cgroup_limit_counts_when_lower(monkeypatch, tmp_path) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("1073741824\n")
    monkeypatch.setattr(memcap, "_CGROUP_LIMITS", (str(limit),))
    assert memcap.machine_bytes() == 1 << 30
    limit.write_text("max\n")
    assert memcap.machine_bytes() > 1 << 30  # no limit: the machine's memory


@pytest.mark.parametrize(
    "line, root, name",
    [
        ("0::/system.slice/slurmstepd.scope/job_7", "", "memory.max"),  # cgroup v2
        ("4:memory:/slurm/uid_1/job_7\n3:cpu:/", "memory", "memory.limit_in_bytes"),  # v1
    ],
    ids=["v2", "v1"],
)
def test_the_limit_of_this_process_own_cgroup_counts(monkeypatch, tmp_path, line, root, name):
    """A cgroup that is not the mount's root (a Slurm job, a systemd slice, a container without
    its own cgroup namespace): its limit, or an ancestor's, was missed (the default cap was the
    machine's memory, over the job's limit: the OOM killer again)."""
    proc = tmp_path / "cgroup"
    proc.write_text(line + "\n")
    fs = tmp_path / "fs"
    parts = line.split(":", 2)[2].splitlines()[0].strip("/").split("/")
    (fs / root / parts[0]).mkdir(parents=True)
    (fs / root / parts[0] / name).write_text("2147483648\n")  # an ancestor's limit
    (fs / root / "/".join(parts)).mkdir(parents=True)
    (fs / root / "/".join(parts) / name).write_text(
        "max\n" if root == "" else "9223372036854771712\n"
    )
    monkeypatch.setattr(memcap, "_CGROUP_LIMITS", ())
    monkeypatch.setattr(memcap, "_PROC_CGROUP", str(proc))
    monkeypatch.setattr(memcap, "_CGROUP_ROOT", str(fs))
    assert memcap.machine_bytes() == 2 << 30  # (a machine with more memory than 2 GiB)


def test_an_allocation_error_names_the_cap() -> None:
    err = "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"
    said = memcap.explain(err, 1_500_000_000)
    assert said.startswith("out of memory") and "1.5 GB" in said and "--run_memory_gb" in said
    assert said.endswith(err)
    assert memcap.explain("exit status 3", 1_500_000_000) == "exit status 3"
    assert memcap.explain(err, None) == err


def test_the_supervisor_caps_the_runs_memory(tmp_path) -> None:
    """The run's process inherits the cap (RLIMIT_DATA): an allocation over it fails in that process,
    one under it succeeds; the record keeps the cap."""
    d, cap = str(tmp_path), 1_000_000_000
    code = "import sys; b = bytearray(int(sys.argv[1])); print(len(b))"
    for n, ok in ((200_000_000, True), (2_000_000_000, False)):
        argv = [sys.executable, "-c", code, str(n)]
        write_private(launch_path(d, 0), json.dumps({"argv": argv, "memory_bytes": cap}).encode())
        proc = subprocess.run(supervisor_command(d, 0), capture_output=True, timeout=120)
        record = read_record(d, 0)
        assert record["memory_bytes"] == cap
        assert (record["returncode"] == 0) is ok, proc.stderr.decode()[-500:]
        if not ok:
            assert b"MemoryError" in proc.stderr


@pytest.mark.slow
def test_a_run_over_the_cap_fails_with_out_of_memory_and_the_server_goes_on(tmp_path) -> None:
    pytest.importorskip("fastapi")
    data = str(tmp_path / "svc")
    proc, c = _serve(data, "--run_memory_gb", "1.5")
    try:
        assert c.get("/health").json()["run_memory_bytes"] == 1_500_000_000
        big = c.post(
            "/v1/runs", json={"model": "mlp", "size": "large", "batch_size": 4096, "steps": 1}
        ).json()["id"]
        small = c.post(
            "/v1/runs", json={"model": "mlp", "size": "tiny", "precision": "fp32", "steps": 2}
        ).json()["id"]
        deadline = time.monotonic() + 300
        while (run := c.get(f"/v1/runs/{small}").json())["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, run  # a hang guard, not a duration
            time.sleep(0.5)
        assert run["status"] == "succeeded", run  # the next run started and trained
        run = c.get(f"/v1/runs/{big}").json()
        assert run["status"] == "failed", run
        assert run["error"].startswith("out of memory") and "1.5 GB" in run["error"], run["error"]
        assert "can't allocate memory" in run["error"]
    finally:
        _end(proc)
