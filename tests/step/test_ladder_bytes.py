"""The rungs keep their bytes on any model (issue 36 item 1): persistent memory within the rung's
bytes per parameter plus the bounded scratch whatever the largest tensor, and the pieces a large
weight is stepped in give bitwise what one whole-tensor step gives."""

from __future__ import annotations

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.observe.memory import breakdown
from ampkit.step.policies.pure import eager
from ampkit.step.policies.pure.ladder import SCRATCH_BYTES, LadderWeights
from ampkit.step.policies.pure.pieces import plan
from ampkit.step.policies.pure.rounding import stochastic_many, stochastic_round
from ampkit.step.rung import LADDER, Rung, join_spec


def persistent_bytes(*roots: object) -> int:
    """Bytes of every tensor storage reachable from ``roots`` (containers and ampkit/torch objects'
    attributes), gradients excluded, each storage once."""
    seen, storages, todo = set(), {}, list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif isinstance(obj, dict):
            todo += [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("ampkit", "torch"):
            todo += [v for k, v in vars(obj).items() if k != "grad"]
    return sum(storages.values())


class EmbeddingHeavy(torch.nn.Module):  # the largest tensor (8.4M elements) far over the scratch
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16384, 512)
        self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(self.emb(x)))).float().pow(2).mean()


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.float()).float().pow(2).mean()


@pytest.mark.parametrize("model_cls", [EmbeddingHeavy, Mlp])
@pytest.mark.parametrize("rung", LADDER, ids=str)
def test_persistent_bytes_stay_within_the_rung_and_the_scratch(model_cls, rung):
    torch.manual_seed(0)
    model = model_cls()
    amp = MixedPrecision(join_spec("bf16-pure", rung), device="cpu")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    x = torch.randint(0, 16384, (4, 16)) if model_cls is EmbeddingHeavy else torch.randn(8, 1024)
    for _ in range(2):
        with amp.autocast():
            loss = model(x)
        amp.backward(loss)
        amp.step(opt)
        opt.zero_grad(set_to_none=True)
    n = sum(p.numel() for p in model.parameters())
    used = persistent_bytes(model, opt, amp)
    assert used <= rung.bytes_per_param() * n + SCRATCH_BYTES, (used / n, rung.bytes_per_param())
    assert used >= rung.bytes_per_param() * n  # (the count sees the rung's tensors)
    # breakdown() gives every kept byte a category, the scratch its own
    cats = breakdown(model, opt, amp).by_category
    assert abs(sum(cats.values()) - used) <= 1024, (cats, used)
    assert 0 < cats["scratch"] <= SCRATCH_BYTES or rung == Rung("fp32")


def _grad(w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """A bf16 gradient of ``sum(sin(w * c))`` at bf16 ``w``: the same input gives the same bits."""
    return (torch.cos(w.float() * c) * c).to(torch.bfloat16)


@pytest.mark.parametrize(
    "rung",
    [
        Rung("split"),
        Rung("kahan"),
        Rung("stochastic"),
        Rung("stochastic", "bf16"),
        Rung("fp32", "bf16"),
    ],
    ids=str,
)
def test_the_pieces_step_bitwise_as_one_whole_tensor_step(rung):
    """A weight of 300 x 517 elements through a 64 KiB scratch (several pieces, a ragged last one)
    against a reference computed here: fused AdamW on the whole fp32 tensor, then the rung's
    compaction (and bf16 states' stochastic rounding) piece by piece in the same draw order."""
    torch.manual_seed(1)
    w0 = torch.randn(300, 517)
    c = torch.rand(300, 517) * 3
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    lw = LadderWeights(
        model, [opt], torch.bfloat16, (), rung.masters, rung.state_dtype, scratch_bytes=64 << 10
    )
    segs = [s for call in plan([w0.numel()], [0], lw.budget, cut=True) for s in call]
    assert len(segs) > 3 and lw._buf.numel() + lw._tmp.numel() <= (64 << 10) // 4
    gen = torch.Generator()
    if lw.gen is not None:
        gen.set_state(lw.gen.get_state())
    ref = torch.nn.Parameter(lw.fp32_value(0).clone())  # the value the rung holds after its set-up
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, fused=True)
    hi = model.w.detach().clone()
    extra = None if lw.extra[0] is None else lw.extra[0].clone()
    for _ in range(3):
        g = _grad(hi, c)
        opt.zero_grad(set_to_none=True)  # (the masters' fp32 gradients)
        model.w.grad = g.clone()
        lw.absorb_grads()
        opt.step()
        ref.grad = g.float()
        ref_opt.step()
        x = ref.detach().view(-1)
        for seg in segs:  # the ladder's order: the piece's weights, then its states
            piece = slice(seg.start, seg.stop)
            xs, hs = x[piece].clone(), hi.view(-1)[piece]
            if rung.masters == "split":
                eager.split_fp32(xs, hs, extra.view(-1)[piece])
            elif rung.masters == "kahan":
                eager.kahan_split(xs, hs, extra.view(-1)[piece], torch.empty_like(xs))
            elif rung.masters == "stochastic":
                stochastic_round(xs, hs, gen)
            else:
                hs.copy_(xs)
            if rung.state_dtype == "bf16":  # both states in one call (one key)
                states = [ref_opt.state[ref][k].view(-1)[piece] for k in ("exp_avg", "exp_avg_sq")]
                outs = [torch.empty(s.shape, dtype=torch.bfloat16) for s in states]
                stochastic_many([s.clone() for s in states], outs, gen)
                for s, out in zip(states, outs):
                    s.copy_(out.float())
        with torch.no_grad():  # what the rung keeps is where the next step starts
            if rung.masters == "kahan":
                ref.copy_(
                    eager.kahan_join(
                        hi, extra, torch.empty(hi.numel()), torch.empty(hi.numel())
                    ).view(hi.shape)
                )
            elif rung.masters == "stochastic":
                ref.copy_(hi.float())
        assert torch.equal(model.w.detach().view(torch.int16), hi.view(torch.int16))
        if extra is not None:
            assert torch.equal(lw.extra[0].view(torch.int16), extra.view(torch.int16))
        assert torch.equal(lw.fp32_value(0), ref.detach())
        state = opt.state[lw.masters[0]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == hi.shape
            assert torch.equal(state[key].float(), ref_opt.state[ref][key])
        assert int(state["step"]) == int(ref_opt.state[ref]["step"])


def test_an_optimizer_that_is_not_element_wise_sees_whole_weights():
    """A subclass of AdamW may not be element-wise (a per-tensor norm): its weights go whole through
    a buffer that lives only inside the step, and nothing larger than the scratch is kept."""

    class NormedAdamW(torch.optim.AdamW):
        seen: list = []

        def step(self, closure=None):  # noqa: ANN001,ANN201
            self.seen += [
                tuple(p.shape) for g in self.param_groups for p in g["params"] if p.grad is not None
            ]
            return super().step(closure)

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(300, 517))
    opt = NormedAdamW(model.parameters(), lr=1e-2)
    lw = LadderWeights(model, [opt], torch.bfloat16, (), "split", "fp32", scratch_bytes=64 << 10)
    model.w.grad = torch.ones(300, 517, dtype=torch.bfloat16)
    lw.absorb_grads()
    opt.step()
    assert NormedAdamW.seen == [(300, 517)]
    assert lw._buf.numel() * 4 + lw._tmp.numel() * 4 <= 64 << 10


def test_the_step_peak_falls_by_the_rungs_savings():
    """The peak of a whole training step (``estimate``: fake tensors, activations included) with a
    rung is below the fp32-masters peak by at least the bytes the rung saves between steps, up to
    the fixed scratch; the old chunk buffers, sized by the embedding, put every rung above it."""
    import warnings

    from ampkit.plan.estimate import estimate

    x = (torch.randint(0, 16384, (4, 64)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peaks = {
            r: estimate(EmbeddingHeavy, x, precision=join_spec("bf16-pure", r)).peak_bytes
            for r in LADDER
        }
    n = sum(p.numel() for p in EmbeddingHeavy().parameters())
    for rung in LADDER[1:]:
        saved = (LADDER[0].bytes_per_param() - rung.bytes_per_param()) * n
        # (+ the bounded scratch: one piece's fp32 values and states, fixed whatever the model)
        assert peaks[rung] <= peaks[LADDER[0]] - saved + SCRATCH_BYTES, (
            str(rung),
            peaks[rung],
            peaks[LADDER[0]],
        )


def test_fake_tensors_step_only_the_ends_of_a_cut_weight_and_measure_the_same_peak(monkeypatch):
    """On fake tensors (an estimate, a plan) a weight over the scratch is stepped as its first and
    last pieces only: the values are not computed and every piece holds the same scratch, so the
    step's memory is unchanged -- checked against stepping every piece -- and a 128k-vocabulary
    embedding costs 2 optimizer calls instead of ~500 (the 8B plan: 74 s -> 12 s)."""
    import warnings

    from ampkit.plan.estimate import estimate
    from ampkit.step.policies.pure import ladder

    n = 3 * 4096 + 17
    assert [(s.start, s.stop) for [s] in plan([n], [0], 4096, cut=True, ends_only=True)] == [
        (0, 4096),
        (12288, n),
    ]
    assert len(plan([n], [0], 4096, cut=True)) == 4
    assert plan([n], [0], 4096, cut=True, ends_only=True)[0] == plan([n], [0], 4096, cut=True)[0]

    x = (torch.randint(0, 16384, (4, 64)),)
    calls = []
    real_plan = ladder.plan

    def every_piece(*args, ends_only=False, **kwargs):
        calls.append(ends_only)
        return real_plan(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rung in LADDER[1:]:
            spec = join_spec("bf16-pure", rung)
            fast = estimate(EmbeddingHeavy, x, precision=spec)
            monkeypatch.setattr(ladder, "plan", every_piece)
            full = estimate(EmbeddingHeavy, x, precision=spec)
            monkeypatch.setattr(ladder, "plan", real_plan)
            assert fast.peak_bytes == full.peak_bytes, str(rung)
    assert calls and all(calls)  # the estimate did ask for the ends only


@pytest.mark.parametrize("rung", [r for r in LADDER if r != Rung("fp32")], ids=str)
def test_a_small_model_keeps_a_small_scratch(rung):
    """The scratch is bounded by what the weights need too, not only by ``ladder_scratch_mib``: a
    4k-parameter model keeps at most 16 bytes (the fp32 values, the bit passes' second buffer, two
    widened states) per element of its weights rounded up to whole pieces -- not 16 MiB."""
    from ampkit.step.policies.pure.pieces import ALIGN

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
    amp = MixedPrecision(join_spec("bf16-pure", rung), device="cpu")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with amp.autocast():
        loss = model(torch.randn(4, 64)).float().pow(2).mean()
    amp.backward(loss)
    amp.step(opt)
    n = sum(p.numel() for p in model.parameters())
    scratch = breakdown(model, opt, amp).by_category["scratch"]
    assert 0 < scratch <= 16 * (-(-n // ALIGN) * ALIGN), (scratch, n)


@pytest.mark.parametrize("masters", ["split", "stochastic"])
def test_a_weight_of_no_elements_first_steps(masters):
    """A zero-size weight first in the optimizer (an empty embedding, a pruned layer) was an
    IndexError in the step's plan (no call opened yet for it to join)."""
    assert plan([0, 5], [0, 1], 1024, cut=True) == [[(0, 0, 0, True), (1, 0, 5, True)]]
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.z = torch.nn.Parameter(torch.randn(0, 5))
    model.w = torch.nn.Parameter(torch.randn(40))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    lw = LadderWeights(model, [opt], torch.bfloat16, (), masters, "bf16")
    before = model.w.detach().clone()
    for _ in range(2):
        for m in lw.masters:
            m.grad = torch.ones(m.shape)
        opt.step()
    assert model.z.shape == (0, 5)
    assert (model.w <= before).all() and (model.w < before).any()  # (against the gradient)


@pytest.mark.parametrize("masters", ["split", "kahan", "stochastic", "fp32"])
def test_the_ladder_steps_under_a_float64_default_dtype(masters):
    """``torch.set_default_dtype(torch.float64)``: the ladder's fp32 buffers (the chunk, its
    scratch, the arena, ``fp32_value``) were made in the default dtype, and the first step failed
    ('The size of tensor a (4096) must match the size of tensor b (2048)'). Now bitwise the same
    steps as under fp32."""

    def run(default: torch.dtype) -> list[torch.Tensor]:
        before = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            torch.manual_seed(0)
            model = torch.nn.Linear(64, 32, dtype=torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            lw = LadderWeights(model, [opt], torch.bfloat16, (), masters, "bf16")
            gen = torch.Generator().manual_seed(1)
            for _ in range(3):
                for m in lw.masters:
                    m.grad = torch.randn(m.shape, generator=gen, dtype=torch.float32)
                opt.step()
            out = [lw.fp32_value(i) for i in range(len(lw.masters))]
            return out + [h.detach().clone() for h in lw.halves]
        finally:
            torch.set_default_dtype(before)

    want, got = run(torch.float32), run(torch.float64)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert all(
        torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        for a, b in zip(want, got)
    )


@pytest.mark.parametrize("masters", ["kahan", "split"])
def test_step_hooks_run_once_around_a_step_of_several_pieces(masters):
    """The generic ladder step calls the optimizer once per piece: its step hooks ran once per piece
    (a warmup pre-hook would warm up several times, an EMA post-hook average several times), and
    the post-hooks ran before the piece's weights were written back (they read the old weights).
    Now: the pre-hooks once before the first piece (an lr they set is stepped with by every piece),
    the post-hooks once after the last, reading the stepped weights."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(300, 517))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=True)
    lw = LadderWeights(model, [opt], torch.bfloat16, (), masters, "fp32", scratch_bytes=64 << 10)
    assert len(plan([model.w.numel()], [0], lw.budget, cut=True)) > 3  # several pieces
    pre, post = [], []

    def warmup(o, args, kwargs):
        pre.append(1)
        o.param_groups[0]["lr"] = 0.01  # every piece must step with this lr

    def ema(o, args, kwargs):
        post.append(model.w.detach().clone())

    opt.register_step_pre_hook(warmup)
    opt.register_step_post_hook(ema)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    global_pre = register_optimizer_step_pre_hook(lambda o, a, k: pre.append(2))
    try:
        before = lw.fp32_value(0)
        g = torch.randn(300, 517)
        model.w.grad = g.to(torch.bfloat16)
        lw.absorb_grads()
        opt.step()
    finally:
        global_pre.remove()
    assert sorted(pre) == [1, 2] and len(post) == 1
    assert torch.equal(post[0], model.w.detach())  # the stepped weights, written back
    # every piece stepped with the pre-hook's lr: SGD's first momentum step is w - lr * g
    want = before - 0.01 * g.to(torch.bfloat16).float()
    # (lr 0.5 would be ~0.5 away; kahan's value is bf16 + a bf16 compensation: ~2**-16 relative)
    assert torch.allclose(lw.fp32_value(0), want, rtol=2**-14, atol=1e-6)
    assert len(opt._optimizer_step_pre_hooks) == 1 == len(opt._optimizer_step_post_hooks)
