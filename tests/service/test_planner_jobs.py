"""The planner's costly work off the request threads: the worker process and its answer cache
(service.jobs), the per-owner limits (service.limits), and the planner route on a real uvicorn
server answering within seconds (or 202 and a job), a repeat from the cache, while another
client's requests stay fast."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

HTTPException = pytest.importorskip("fastapi").HTTPException  # the serve extra (as service.limits)

from ampkit.service.jobs import Jobs  # noqa: E402
from ampkit.service.limits import Limits, limits_of  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_rate_limit_is_per_owner_and_kind_with_retry_after():
    clock = Clock()
    lim = Limits(per_minute=6, burst=2, clock=clock)  # one request per 10 s after a burst of 2
    lim.take("alice", "planner")
    lim.take("alice", "planner")
    with pytest.raises(HTTPException) as e:
        lim.take("alice", "planner")
    assert e.value.status_code == 429 and e.value.headers["Retry-After"] == "10"
    lim.take("bob", "planner")  # another owner: its own bucket
    lim.take("alice", "recommend")  # another kind: its own bucket
    clock.t += 9.0
    with pytest.raises(HTTPException) as e:
        lim.take("alice", "planner")
    assert e.value.headers["Retry-After"] == "1"
    clock.t += 1.0
    lim.take("alice", "planner")  # refilled
    with pytest.raises(HTTPException) as e:
        lim.check_in_flight("alice", 2)
    assert e.value.status_code == 429 and "Retry-After" in e.value.headers
    lim.check_in_flight("alice", 1)
    with pytest.raises(ValueError, match="per_minute"):
        Limits(per_minute=0)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace()))
    assert limits_of(request) is limits_of(request)  # one per app


@pytest.fixture
def jobs():
    j = Jobs(timeout_s=60)
    yield j
    j.close()


@pytest.mark.slow
def test_jobs_run_in_a_worker_process_and_identical_requests_hit_the_cache(jobs):
    job = jobs.wait(jobs.submit("alice", ("pid",), "os:getpid", ()), 120)
    assert job["status"] == "succeeded"
    import os

    assert job["result"] != os.getpid()  # not this process: the server's threads are never busy
    again = jobs.submit("alice", ("pid",), "os:getpid", ())
    assert jobs.cached(("pid",)) == ("succeeded", job["result"])
    assert jobs.wait(again, 30)["result"] == job["result"]
    bad = jobs.wait(jobs.submit("alice", ("neg",), "math:factorial", (-1,)), 60)
    assert (
        bad["status"] == "invalid" and "negative" in bad["error"]
    )  # a ValueError: the client's error (422)
    assert jobs.get(bad["id"], "bob") is None and jobs.get(bad["id"], "alice") is bad


@pytest.mark.slow
def test_a_job_past_the_time_limit_is_stopped_and_the_next_one_runs(jobs):
    jobs.timeout_s = 3
    first = jobs.wait(jobs.submit("alice", ("ping",), "os:getpid", ()), 120)
    slow = jobs.submit("alice", ("slow",), "time:sleep", (60,))
    assert jobs.pending("alice", ("slow",)) and jobs.in_flight("alice") == 1
    slow = jobs.wait(slow, 60)  # the 60 s sleep is stopped at the 3 s limit, long before
    assert slow["status"] == "failed" and "limit of 3 s" in slow["error"]
    nxt = jobs.wait(jobs.submit("alice", ("ping2",), "os:getpid", ()), 120)
    assert nxt["status"] == "succeeded" and nxt["result"] != first["result"]  # a new worker


# a byte-level GPT-2 small enough that the whole plan is a few dozen fake-tensor steps
SMALL = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 2,
    "n_positions": 64,
    "vocab_size": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.mark.slow
def test_planner_route_answers_or_queues_repeats_from_cache_and_others_are_served(tmp_path):
    from ampkit.service.jobs import jobs as server_jobs

    from .test_service import ALICE, BOB, Server

    httpx = pytest.importorskip("httpx")
    s = Server(str(tmp_path / "svc"))

    other = httpx.Client(base_url=s.client.base_url, timeout=30)
    lat: list[float] = []
    codes: list[object] = []  # the other client's answers (an exception: no answer)
    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            t = time.monotonic()
            try:
                codes.append(other.get("/v1/runs", headers=BOB).status_code)
            except Exception as e:  # a timeout (30 s): the server stopped answering
                codes.append(e)
            lat.append(time.monotonic() - t)
            time.sleep(0.02)

    th = threading.Thread(target=hammer, daemon=True)
    try:
        # a server's first Hugging Face request imports transformers and its GPT-2 (~10 s here, once):
        # this one does, and is refused before any plan (a 175B config over the parameter cap)
        huge = {
            "model_name": "gpt2",
            "gpu_memory_gb": 8,
            "model_overrides": {"n_layer": 96, "n_embd": 12288, "n_head": 96},
        }
        r = s.client.post(
            "/finetuning/optimize-mixed-precision", json=huge, headers=ALICE, timeout=120
        )
        assert r.status_code == 422 and "over this server's limit" in r.text, r.text
        th.start()
        body = {
            "model_name": "gpt2",
            "model_overrides": SMALL,
            "gpu_memory_gb": 0.02,
            "batch_size": 4,
            "max_length": 64,
        }
        t = time.monotonic()
        r = s.client.post("/finetuning/optimize-mixed-precision", json=body, headers=ALICE)
        first_s = time.monotonic() - t
        assert r.status_code in (200, 202), r.text  # 202: a plan longer than the route waits
        if r.status_code == 202:
            poll = r.json()["poll"]
            assert r.headers["Location"] == poll and int(r.headers["Retry-After"]) > 0
            assert s.client.get(poll, headers=BOB).status_code == 404  # another owner's job
            deadline = time.monotonic() + 900
            while r.status_code == 202:
                assert time.monotonic() < deadline, r.text
                time.sleep(1)
                r = s.client.get(poll, headers=ALICE)
        assert r.status_code == 200, r.text
        answer = r.json()
        rows = {row["precision"]: row for row in answer["recommendations"]}
        assert set(rows) >= {"fp32", "bf16", "fp16"} and all(
            row["max_batch_size"] >= 1 for row in rows.values()
        )
        t = time.monotonic()
        again = s.client.post("/finetuning/optimize-mixed-precision", json=body, headers=BOB)
        repeat_s = time.monotonic() - t
        assert again.status_code == 200, again.text
        print(
            f"planner route: first answer in {first_s:.2f} s, "
            f"repeat 200 (cached) in {repeat_s:.3f} s"
        )
        assert (
            again.json()["cached"] is True
            and again.json()["recommendations"] == answer["recommendations"]
        )
        # heavy work never in a request thread: the full 124M GPT-2 at 1024 tokens is a 202 at once
        # (after the route's short wait), two in flight per owner, the third a 429
        big = {"model_name": "gpt2", "gpu_memory_gb": 8, "max_length": 1024}
        # the worker held busy first (another owner's job), so alice's plans are still in flight when
        # the third comes, however fast this machine plans (a fast one had finished two in 6 s)
        server_jobs().submit("(blocker)", ("sleep", 120), "time:sleep", (120,))
        for i, code in enumerate((202, 202, 429)):
            t = time.monotonic()
            r = s.client.post(
                "/finetuning/optimize-mixed-precision",
                json={**big, "batch_size": 8 + i},
                headers=ALICE,
            )
            assert r.status_code == code, r.text
            print(f"GPT-2 124M plan request {i}: {r.status_code} in {time.monotonic() - t:.2f} s")
        assert "Retry-After" in r.headers
    finally:
        stop.set()
        th.join(10)
        server_jobs().close()  # ends the worker process and the queued 124M plans
        other.close()
        s.stop()
    lat.sort()
    p99 = lat[int(0.99 * (len(lat) - 1))]
    print(
        f"other client: {len(lat)} requests, p50 {lat[len(lat) // 2] * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms"
    )
    assert codes and all(code == 200 for code in codes), codes  # answered all along (latency: docs)
