import os

import pytest
import torch

# Plain `pytest` (no test paths, no -n) runs on 2 pytest-xdist workers when pytest-xdist is installed
# (the dev extra has it): most slow tests wait on subprocesses, servers and signals, so two workers
# share 2 cores well. AMPKIT_TEST_WORKERS=N picks another count (0 or 1: serial); -n N, -p no:xdist,
# --collect-only, --pdb or naming test paths keep pytest's own behaviour (serial unless -n is given).
# --dist loadfile: a module's tests share one worker, so a module fixture (a trained run, a server, the
# distributed spawn) is built once (loadgroup's xdist_group marks were ignored under pytest 9.2 + xdist 3.8).
WORKERS_ENV = "AMPKIT_TEST_WORKERS"
DEFAULT_WORKERS = 2
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... inside an xdist worker
N_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)

# Keep CPU tests deterministic and light on a 2-core CI machine: with several workers, each gets its
# share of the cores (and so do the processes its tests start), so workers do not oversubscribe them.
THREADS = max(1, min(2, (os.cpu_count() or 1) // max(1, N_WORKERS)))
torch.set_num_threads(THREADS)
if WORKER and N_WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

HAS_CUDA = torch.cuda.is_available()

# `ampkit plan` keeps measured steps in a cache (loop/plan_cache.py): off for the suite (each test
# measures what it checks); tests/plan/test_plan_cache.py turns it on itself.
os.environ["AMPKIT_PLAN_CACHE"] = "off"

# The modules that take longest (seconds of test time on the 2-core CI machine, docs/benchmarks.md
# "Test suite time"), longest first. Under the automatic workers they are handed out first
# (--dist loadfile gives whole modules; xdist's own order -- most tests first -- started the
# one-test, 10-launch module last and left one core idle for its ~3 minutes).
LONGEST_FIRST = [
    "e2e/test_capped_fit.py",  # three processes of 300 steps: started first, it overlaps the rest
    "e2e/test_stop.py",
    "plan/test_depth.py",
    "loop/test_checkpoint.py",
    "plan/test_estimate_session.py",
    "service/test_service_ops.py",
    "plan/test_estimate.py",
    "distributed/test_launch.py",
    "service/test_service_compat.py",
    "service/test_service.py",
    "service/test_planner_jobs.py",
    "e2e/test_newcomer.py",
    "distributed/test_slurm.py",
    "cli/test_plan.py",
    "service/test_service_supervisor.py",
    "step/test_master.py",
    "models/test_hf_models.py",
    "service/test_webui.py",
]


def _named_paths(config) -> bool:
    """Whether the command line names test paths narrower than the whole suite (``pytest tests/step``)."""
    whole = {os.path.realpath(config.rootpath / p) for p in [".", *config.getini("testpaths")]}
    args = [a.split("::")[0] for a in config.invocation_params.args if not a.startswith("-")]
    return any(os.path.exists(a) and os.path.realpath(a) not in whole for a in args)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Turn plain `pytest` into `pytest -n 2 --dist loadfile` when pytest-xdist is there (see the top)."""
    if WORKER or not config.pluginmanager.hasplugin("xdist"):
        return
    opt = config.option
    if opt.numprocesses is not None or getattr(opt, "tx", None) or opt.collectonly or opt.usepdb:
        return
    if _named_paths(config):
        return
    raw = os.environ.get(WORKERS_ENV, str(DEFAULT_WORKERS))
    try:
        n = int(raw)
    except ValueError:
        raise pytest.UsageError(
            f"{WORKERS_ENV}={raw!r} is not a number of workers (0 or 1: serial, N: N workers)"
        ) from None
    if n > 1:
        opt.numprocesses = n
        if opt.dist == "no":
            opt.dist = "loadfile"
            opt.loadscopereorder = (
                False  # keep the collection order: LONGEST_FIRST (pytest_collection_modifyitems)
            )


def _rank(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    if N_WORKERS > 1:  # an xdist worker: every worker sorts alike (the same collection is required)
        items.sort(key=_rank)  # stable: the rest keep their order
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)


@pytest.fixture
def seed():
    torch.manual_seed(1234)
    return 1234
