"""A worker that has left its process group ends through ``exit_worker``: the atexit callbacks
run, what it printed is flushed, the status is the one asked for -- and the interpreter's teardown,
where a late gloo thread could abort the process (SIGABRT after a successful run), is skipped."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest


def test_exit_worker_runs_atexit_flushes_and_returns_the_code(tmp_path):
    code = random.randint(0, 7)
    marker = tmp_path / "atexit.txt"
    script = textwrap.dedent(f"""
        import atexit, sys
        from ampkit.distributed.env import exit_worker

        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        sys.stdout.write("unflushed line")  # no newline, no flush: exit_worker must flush it
        exit_worker({code})
        print("not reached")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == code, r.stderr
    assert r.stdout == "unflushed line"
    assert marker.read_text() == "ran"


def test_a_launched_worker_leaves_through_exit_worker(monkeypatch):
    """``ampkit.cli.main`` in a launched worker does not return into the interpreter's teardown."""
    import ampkit.cli as cli

    seen = {}
    monkeypatch.setattr(cli, "launched", lambda: True)
    monkeypatch.setattr(
        cli, "leave", lambda code, together: seen.setdefault("leave", (code, together))
    )

    class Exited(Exception):
        pass

    def fake_exit(code):
        seen["exit"] = code
        raise Exited

    monkeypatch.setattr(cli, "exit_worker", fake_exit)
    with pytest.raises(Exited):
        cli.main(["info", "--json"])
    assert seen == {"leave": (0, True), "exit": 0}
