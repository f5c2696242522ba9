"""DDP and FSDP2 under the engine: real torch.distributed, 2 processes, gloo on CPU.

Every scenario is checked against one process computing the same large batch (the reference),
or against the other rank (bitwise), as the issue asks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ampkit import MixedPrecision

from ..support.dist_helpers import run_ranks

pytestmark = pytest.mark.distributed

MICRO = 8  # samples per micro-batch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(16, 32), nn.GELU()),
                nn.Sequential(nn.Linear(32, 32), nn.GELU()),
            ]
        )
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return F.mse_loss(self.head(x).float(), y)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(MICRO, 16, generator=g), torch.randn(MICRO, 4, generator=g)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.is_initialized():
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        sd = model.state_dict()
    return {k: v.detach().clone() for k, v in sd.items()}


def train(
    rank: int,
    world: int,
    kind: str,
    precision: str,
    *,
    accum: int,
    steps: int = 3,
    fused: bool = True,
    inject: tuple[int, int] | None = None,
    inject_grad: tuple[int, int] | None = None,
    clip: float | None = None,
    init_scale: float = 2.0**10,
    optim: str = "adamw",
) -> dict:
    """``kind`` in none/ddp/fsdp. Rank r of ``world`` takes micro-batches ``s*accum*world + r*accum + j``,
    so one process with ``accum*world`` micro-steps sees the same large batch per step."""
    from ampkit.distributed import shard

    torch.manual_seed(0)
    model: nn.Module = Net()
    comms = {"n": 0}
    if kind == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)  # one bucket

        def counting(state, bucket):  # noqa: ANN001 -- DDP's comm-hook signature
            comms["n"] += 1
            return allreduce_hook(state, bucket)

        model.register_comm_hook(dist.group.WORLD, counting)
    elif kind == "fsdp":
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        shard(model, precision)

        class Counting(DefaultReduceScatter):
            def __call__(self, *a, **k):  # noqa: ANN002,ANN003
                comms["n"] += 1
                return super().__call__(*a, **k)

        from ampkit.distributed import fsdp_modules

        for m in fsdp_modules(model):
            m.set_custom_reduce_scatter(Counting())
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    else:
        opt = torch.optim.AdamW(
            model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True
        )
    amp = MixedPrecision(precision, device="cpu", accumulation_steps=accum, init_scale=init_scale)
    model, opt = amp.setup(model, opt)
    scales, found, norms, gmax = [], [], [], []
    for s in range(steps):
        for j in range(accum):
            x, y = batch(s * accum * world + rank * accum + j)
            with amp.autocast():
                loss = model(x, y)
            if inject is not None and s == inject[0] and rank == inject[1]:
                loss = loss * float("inf")
            amp.backward(loss)
            if inject_grad is not None and j == accum - 1 and (s, rank) == inject_grad:
                g = next(
                    iter(model.parameters())
                ).grad  # this rank's gradient only (after any reduction)
                g = g.to_local() if hasattr(g, "to_local") else g
                g.view(-1)[0] = float("inf")
            if kind == "none" and j == accum - 1:  # the step's largest gradient, for sgd_bound
                scale = amp.scaler.get_scale()
                params = [*model.parameters(), *amp.master_params()]
                grads = [p.grad for p in params if p.grad is not None]
                gmax.append(max(float(g.abs().max()) for g in grads) / scale)
            r = amp.step(opt, clip_grad_norm=clip)
        scales.append(amp.scaler.get_scale())
        found.append(float(r.found_inf) if r.found_inf is not None else 0.0)
        norms.append(float(r.grad_norm) if r.grad_norm is not None else None)
    return {
        "params": full_state(model),
        "scales": scales,
        "found": found,
        "norms": norms,
        "gmax": gmax,
        "comms": comms["n"],
        "stats": amp.stats(),
        "parallel": type(amp._parallel).__name__,
    }


def several(rank: int, world: int, runs: list[tuple[tuple, dict]]) -> list[dict]:
    """Several ``train`` runs in one set of processes (spawning costs seconds)."""
    return [train(rank, world, *a, **k) for a, k in runs]


def _fp16_inf_runs(kind: str) -> list[tuple[tuple, dict]]:
    runs = [
        ((kind, "fp16"), {"accum": 2, "steps": 4, "fused": fused, "inject": (1, 1)})
        for fused in (True, False)
    ]
    return runs + [((kind, "fp16"), {"accum": 2, "steps": 4, "fused": True, "inject_grad": (2, 0)})]


# Every distributed scenario of this module, by name: (function, args, kwargs), ``function(rank,
# world, *args, **kwargs)`` on each rank. All of them run in ONE pair of spawned processes (the
# ``_ranks`` fixture: spawning two processes that import torch costs seconds each time); each test
# asserts on its own scenario's per-rank results (a scenario that raises fails them all, naming it).
JOBS: dict[str, tuple] = {
    "ddp-fp32": (train, ("ddp", "fp32"), {"accum": 2, "optim": "sgd"}),
    "ddp-bf16": (train, ("ddp", "bf16"), {"accum": 2, "optim": "sgd"}),
    "ddp-fp32-accum4": (train, ("ddp", "fp32"), {"accum": 4, "steps": 3}),
    "fsdp-fp32-accum4": (train, ("fsdp", "fp32"), {"accum": 4, "steps": 3, "optim": "sgd"}),
    "ddp-fp16-inf": (several, (_fp16_inf_runs("ddp"),), {}),
    "fsdp-fp16-inf": (several, (_fp16_inf_runs("fsdp"),), {}),
    "fsdp-fp32-clip": (train, ("fsdp", "fp32"), {"accum": 2, "clip": 0.05, "optim": "sgd"}),
    **{
        f"fsdp-{p}-sgd": (train, ("fsdp", p), {"accum": 2, "steps": 3, "optim": "sgd"})
        for p in ("bf16", "fp16", "bf16-pure")
    },
    "ddp-pure-sgd": (
        several,
        ([(("ddp", p), {"accum": 2, "optim": "sgd"}) for p in ("bf16-pure", "fp16-pure")],),
        {},
    ),
    "ddp-flush": ("flushed", (3, 4), {}),
    "ddp-rank-seeds": ("rank_seeded", ("ddp",), {}),
    "fsdp-rank-seeds": ("rank_seeded", ("fsdp",), {}),
    "fsdp-resume": ("trainer_resume", ("fsdp",), {}),  # + a checkpoint directory of its own
    "ddp-resume": ("trainer_resume", ("ddp",), {}),
}


def all_jobs(rank: int, world: int, jobs: dict[str, tuple], ckroot: str) -> dict:
    """Run every job on this rank, in order; their results by name."""
    out = {}
    for name, (fn, args, kwargs) in jobs.items():
        if isinstance(fn, str):  # defined further down this module
            fn = globals()[fn]
        if fn.__name__ == "trainer_resume":
            args = (*args, f"{ckroot}/{name}")
        try:
            out[name] = fn(rank, world, *args, **kwargs)
        except Exception as e:
            raise RuntimeError(f"distributed job {name!r} failed on rank {rank}") from e
    return out


@pytest.fixture(scope="module")
def _ranks(tmp_path_factory):
    return run_ranks(all_jobs, JOBS, str(tmp_path_factory.mktemp("dist-ck")))


@pytest.fixture
def ranks_of(_ranks):
    """``ranks_of(name)``: the per-rank results of JOBS[name] (rank 0 first)."""
    return lambda name: [r[name] for r in _ranks]


def reference(precision: str, *, accum: int, **kw) -> dict:
    return train(0, 1, "none", precision, accum=accum, **kw)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


EPS32 = torch.finfo(torch.float32).eps
SGD_LR = 0.1  # train()'s optim="sgd"


def sgd_bound(ref: dict, n_terms: int, eps_dtype: float = 0.0) -> float:
    """How far a run of plain SGD may end from ``ref`` (one process, the same samples) when each
    gradient element sums its ``n_terms`` samples in another order (ranks' all-reduce against one
    process's accumulation): any order of an n-term fp32 sum is within (n - 1) * u * sum|terms| of
    the exact one (u = eps / 2; sum|terms| taken as the step's largest gradient, as in
    tests/train/test_oom.py), so two runs' gradients are within n * eps * max|g| and their weights
    within lr times that, summed over the steps, plus the weights' own rounding (u * |w| a step in
    each run). ``eps_dtype``: the forward's weights (a pure precision's, rounded from the masters)
    may round to neighbours in that dtype, which moves the gradients by up to eps_dtype * max|g|.
    Not AdamW: its first update lr * g / (|g| + eps) is ~lr * sign(g), so a gradient within rounding
    of 0 moves a weight by up to 2 * lr, which no dtype bounds (another CPU's kernels can do it)."""
    w = max(float(v.abs().max()) for v in ref["params"].values())
    return SGD_LR * sum(ref["gmax"]) * (n_terms * EPS32 + eps_dtype) + len(ref["gmax"]) * EPS32 * w


@pytest.mark.slow
def test_ddp_fp32_matches_one_process_and_bf16_ranks_agree_bitwise(ranks_of):
    ref = reference("fp32", accum=4, optim="sgd")
    ranks = ranks_of("ddp-fp32")
    assert ranks[0]["parallel"] == "DDPParallel"
    assert ranks[0]["stats"]["parallel"] == "ddp" and ranks[0]["stats"]["world_size"] == 2
    assert max_diff(ranks[0]["params"], ref["params"]) <= sgd_bound(ref, 4 * MICRO)
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    bf = ranks_of("ddp-bf16")
    assert max_diff(bf[0]["params"], bf[1]["params"]) == 0.0
    # bf16 is a real change of arithmetic: close to fp32 for a bf16 tolerance (every one of the n
    # terms rounded to bf16: n * eps_bf16 * max|g| a step), but not identical.
    bf16 = 4 * MICRO * torch.finfo(torch.bfloat16).eps
    assert 0.0 < max_diff(bf[0]["params"], ranks[0]["params"]) < sgd_bound(ref, 4 * MICRO, bf16)


@pytest.mark.slow
def test_ddp_communicates_once_per_optimizer_step(ranks_of):
    ranks = ranks_of("ddp-fp32-accum4")
    assert [r["comms"] for r in ranks] == [3, 3]  # not 12: no_sync on 3 of every 4 micro-steps


@pytest.mark.slow
def test_fsdp_reduces_once_per_step_per_group_and_matches_large_batch(ranks_of):
    ref = reference("fp32", accum=8, optim="sgd")
    ranks = ranks_of("fsdp-fp32-accum4")
    assert ranks[0]["parallel"] == "FSDPParallel"
    assert ranks[1]["stats"]["parallel"] == "fsdp" and ranks[1]["stats"]["world_size"] == 2
    groups = 3  # two blocks + the root (head)
    assert [r["comms"] for r in ranks] == [3 * groups, 3 * groups]
    assert max_diff(ranks[0]["params"], ref["params"]) <= sgd_bound(ref, 8 * MICRO)
    assert max_diff(ranks[1]["params"], ref["params"]) <= sgd_bound(ref, 8 * MICRO)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_fp16_inf_on_one_rank_skips_that_step_on_every_rank(kind, ranks_of):
    # Runs: inf in rank 1's loss at step 1 (fused AdamW, then foreach); only rank 0's own gradient
    # going non-finite at step 2, after the reduction: found_inf must still agree (see JOBS).
    ranks = ranks_of(f"{kind}-fp16-inf")
    for i, expect_skip in enumerate([1, 1, 2]):
        a, b = ranks[0][i], ranks[1][i]
        for r in (a, b):
            assert r["found"] == [1.0 if s == expect_skip else 0.0 for s in range(4)], (
                i,
                r["found"],
            )
            halved = [1024.0] * expect_skip + [512.0] * (4 - expect_skip)
            assert r["scales"] == halved, (i, r["scales"])
            assert r["stats"]["skipped_steps"] == 1
        assert max_diff(a["params"], b["params"]) == 0.0, i


@pytest.mark.slow
def test_fsdp_clipping_returns_the_one_process_total_norm(ranks_of):
    ref = reference("fp32", accum=4, clip=0.05, optim="sgd")
    ranks = ranks_of("fsdp-fp32-clip")
    # the norm: its gradients within n * eps relative (sgd_bound), its sum of squares over the N
    # gradient elements within N * u, the square root halves that
    n_grads = sum(v.numel() for v in ref["params"].values())
    for r in ranks:
        assert r["norms"] == pytest.approx(ref["norms"], rel=(4 * MICRO + n_grads) * EPS32, abs=0)
        assert max(r["norms"]) > 0.05  # the clip was active
        assert max_diff(r["params"], ref["params"]) <= sgd_bound(ref, 4 * MICRO)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-pure"])
def test_fsdp_half_precisions_match_one_process_in_the_same_precision(precision, ranks_of):
    # SGD: parameter differences are proportional to gradient differences (AdamW's normalised
    # update turns rounding in near-zero gradients into lr-sized steps).
    ref32 = reference("fp32", accum=4, optim="sgd")
    ref = reference(precision, accum=4, optim="sgd")
    ranks = ranks_of(f"fsdp-{precision}-sgd")
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    d, d32 = (
        max_diff(ranks[0]["params"], ref["params"]),
        max_diff(ranks[0]["params"], ref32["params"]),
    )
    # Within the one-process run in the same precision: its gradients summed in another order
    # (sgd_bound), each computed from weights and activations that may round to neighbours in the
    # half dtype (eps_dtype); the fp32 run is a real difference, within the half dtype's own error.
    # A pure precision's weights are themselves half: masters that close may round one half ulp
    # apart (eps * |w| at most).
    half = torch.bfloat16 if precision.startswith("bf16") else torch.float16
    eps = torch.finfo(half).eps
    w = max(float(v.abs().max()) for v in ref["params"].values())
    bound = sgd_bound(ref, 4 * MICRO, eps) + (eps * w if precision.endswith("-pure") else 0.0)
    assert d <= bound, (d, bound)
    assert 0.0 < d32 <= sgd_bound(ref32, 4 * MICRO, 4 * eps), d32
    # Pure precisions under FSDP2 keep no extra masters: the fp32 shards are the masters.
    assert all(v.dtype == torch.float32 for v in ranks[0]["params"].values())


@pytest.mark.slow
def test_ddp_pure_precisions_average_the_fp32_master_gradients(ranks_of):
    # The masters live outside DDP's view: the adapter averages their fp32 gradients itself.
    refs = {p: reference(p, accum=4, optim="sgd") for p in ("bf16-pure", "fp16-pure")}
    ranks = ranks_of("ddp-pure-sgd")  # bf16-pure, then fp16-pure
    for i, p in enumerate(refs):
        a, b = ranks[0][i], ranks[1][i]
        assert max_diff(a["params"], b["params"]) == 0.0, p
        eps = torch.finfo(torch.bfloat16 if p == "bf16-pure" else torch.float16).eps
        assert max_diff(a["params"], refs[p]["params"]) <= sgd_bound(refs[p], 4 * MICRO, eps), p


def flushed(rank: int, world: int, micro: int, accum: int) -> dict:
    """``micro`` micro-steps of a window of ``accum``, then ``step(flush=True)``."""
    torch.manual_seed(0)
    model: nn.Module = Net()
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu", accumulation_steps=accum)
    model, opt = amp.setup(model, opt)
    for j in range(micro):
        with amp.autocast():
            loss = model(*batch(rank * micro + j))
        amp.backward(loss)
        amp.step(opt)
    r = amp.step(opt, flush=True)
    assert r.boundary
    return {"params": full_state(model)}


@pytest.mark.slow
def test_ddp_flush_of_a_short_window_averages_the_unsynced_gradients(ranks_of):
    ref = flushed(0, 1, 6, 8)  # one process, 6 of a window of 8: the mean over 6
    ranks = ranks_of("ddp-flush")  # 2 ranks x 3 of a window of 4, all under no_sync
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert max_diff(ranks[0]["params"], ref["params"]) <= 1e-6


def trainer_resume(rank: int, world: int, kind: str, ckdir: str, precision: str = "fp32") -> dict:
    """Uninterrupted 10 steps vs 5 steps + checkpoint + resume in a fresh Trainer + 5 steps."""
    from ampkit.distributed import shard
    from ampkit.train.trainer import Trainer

    def build(checkpoint_dir: str | None) -> Trainer:
        torch.manual_seed(0)
        model: nn.Module = Net()
        model = (
            shard(model, precision)
            if kind == "fsdp"
            else nn.parallel.DistributedDataParallel(model)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        amp = MixedPrecision(precision, device="cpu", accumulation_steps=2)
        model, opt = amp.setup(model, opt)
        return Trainer(
            model,
            opt,
            amp,
            batch,
            progress=False,
            log_every=2,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=5 if checkpoint_dir else None,
        )

    t = build(None)
    t.fit(10)
    whole = full_state(t.model)
    first = build(ckdir)
    first.fit(5)
    at5 = full_state(first.model)
    second = build(ckdir)
    path = second.resume()
    resumed_steps = second.amp.optimizer_steps
    second.fit(5)
    return {
        "whole": whole,
        "at5": at5,
        "resumed": full_state(second.model),
        "path": path,
        "steps": resumed_steps,
        "world": t.world_size,
    }


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_sharded_checkpoint_round_trip_is_bitwise_and_exports_to_one_file(kind, tmp_path, ranks_of):
    from ampkit.loop.checkpoint import CheckpointMismatch, export_single_file, load_checkpoint
    from ampkit.train.trainer import Trainer

    ranks = ranks_of(f"{kind}-resume")
    for r in ranks:
        assert r["world"] == 2 and r["steps"] == 5
        assert r["path"].endswith("ckpt-00000005")
        assert max_diff(r["resumed"], r["whole"]) == 0.0  # bitwise the uninterrupted run
    assert max_diff(ranks[0]["whole"], ranks[1]["whole"]) == 0.0
    # The export loads with weights_only=True into a plain model and optimizer in one process.
    single = export_single_file(ranks[0]["path"], str(tmp_path / "single.pt"))
    state = load_checkpoint(single)
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp = MixedPrecision("fp32", device="cpu", accumulation_steps=2)
    model, opt = amp.setup(model, opt)
    trainer = Trainer(model, opt, amp, batch, progress=False)
    # Continuing the 2-process run in 1 process is another run (each rank read batches
    # i * 2 + r): refused, naming both, before anything is loaded.
    with pytest.raises(CheckpointMismatch, match="its run had 2 processes, this one has 1"):
        trainer.load_state_dict(state, source=single)
    assert amp.optimizer_steps == 0 and trainer.micro_index == 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    assert max_diff(full_state(model), ranks[0]["at5"]) == 0.0
    assert len(opt.state) == len(list(model.parameters()))  # AdamW moments came along


def rank_seeded(rank: int, world: int, kind: str) -> dict:
    """bf16-pure with stochastic rounding after each rank seeded torch itself (a seed plus the rank,
    as loops do for their data), 3 steps."""
    torch.manual_seed(0)
    model: nn.Module = Net()
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from ampkit.distributed import shard

        model = shard(model, "bf16-pure:stochastic+bf16")
    torch.manual_seed(100 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = MixedPrecision("bf16-pure:stochastic+bf16", device="cpu")
    model, opt = amp.setup(model, opt)
    generator = amp.state_dict()["masters"]["generator"].clone()
    for s in range(3):
        with amp.autocast():
            loss = model(*batch(s * world + rank))
        amp.backward(loss)
        amp.step(opt)
    return {"params": full_state(model), "generator": generator}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_stochastic_rounding_draws_rank_0s_seed_on_every_rank(ranks_of, kind):
    """DDP: replicas round alike, so they stay bitwise equal; FSDP2: the generator a checkpoint
    keeps (one copy) is every rank's."""
    a, b = ranks_of(f"{kind}-rank-seeds")
    assert torch.equal(a["generator"], b["generator"])
    if kind == "ddp":
        assert max_diff(a["params"], b["params"]) == 0.0
