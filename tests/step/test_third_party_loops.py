"""Real-world training loops, written the way their projects write them, ported to ampkit: bitwise.

Each raw loop follows its original's structure (read from the project's source, not copied):

1. nanoGPT ``train.py``: a cosine LR with warmup written into ``param_groups`` every iteration,
   ``gradient_accumulation_steps`` with the loss divided, ``scaler.unscale_`` then
   ``clip_grad_norm_(model.parameters(), 1.0)``, ``scaler.step``/``update``,
   ``zero_grad(set_to_none=True)``.
2. timm ``train_one_epoch``: a ``NativeScaler``-like ``loss_scaler(loss, optimizer, clip_grad=...,
   parameters=model.parameters(), need_update=...)``, ``step_update`` of the LR per update, a
   ``ModelEmaV2``-style EMA updated after each update.
3. Hugging Face ``Trainer``/Accelerate: weight-decay groups (no decay on biases and LayerNorm),
   autocast, ``clip_grad_norm_`` at ``max_grad_norm``, a ``get_linear_schedule_with_warmup``
   ``LambdaLR`` stepped only when the optimizer step was not skipped.
4. A GAN (PyTorch's DCGAN example with one ``GradScaler``): ``scaler.step(optD)``, then G's
   forward through the updated D, ``scaler.step(optG)``, one ``scaler.update()``.
5. torchvision's ``references/classification`` ``train_one_epoch``: ``zero_grad`` before backward,
   optional clipping, an ``AveragedModel`` EMA every ``model_ema_steps`` iterations, an epoch LR
   scheduler.

Every loop sees an injected inf gradient (a tensor hook) on one iteration. In fp16 the raw loop's
``GradScaler`` skips that step; ampkit skips it in every precision (docs/guides/porting-a-loop.md,
"Non-finite steps are skipped in every precision"), so for bf16/fp32 the reference is the raw
loop with that one guard added (``guard=True``), and ``skip_nonfinite=False`` is checked to give
the unguarded raw loop bit for bit. Parameters, optimizer states, EMA weights, the learning rate
and the loss scale (and its growth tracker) are compared bit for bit after the run.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision

from ..support.reference_loop import DTYPES

PRECISIONS = ["fp32", "bf16", "fp16"]
SCALER = {"init_scale": 2.0**12, "growth_interval": 3}  # growth and backoff both happen


def torch_autocast(precision):
    dtype = DTYPES[precision]
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


# ---------------------------------------------------------------------------- comparison helpers


def bits(t):
    return t.detach().reshape(-1).contiguous().view(torch.uint8)  # NaN payloads compare too


def assert_same_tensors(ref, got, what):
    assert len(ref) == len(got), what
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
        assert torch.equal(bits(a), bits(b)), (
            f"{what}[{i}] differs by up to {(a.double() - b.double()).abs().max().item():.3g}"
        )


def optimizer_tensors(opt):
    return [v for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)]


def lrs(opt):
    return [g["lr"] for g in opt.param_groups]


def assert_same_run(ref_model, ref_opts, got_model, got_opts, ref_scaler=None, amp=None):
    assert_same_tensors(list(ref_model.parameters()), list(got_model.parameters()), "parameter")
    assert_same_tensors(list(ref_model.buffers()), list(got_model.buffers()), "buffer")
    for k, (a, b) in enumerate(zip(ref_opts, got_opts)):
        assert_same_tensors(optimizer_tensors(a), optimizer_tensors(b), f"optimizer {k} state")
        assert lrs(a) == lrs(b)
    if ref_scaler is not None and ref_scaler.is_enabled():
        ours = amp.scaler.state_dict()
        theirs = ref_scaler.state_dict()
        assert (ours["scale"], ours["_growth_tracker"]) == (
            theirs["scale"],
            theirs["_growth_tracker"],
        )


class InfGrad:
    """A gradient hook on one parameter that puts an inf into its gradient while ``armed``."""

    def __init__(self, param):
        self.armed = False
        param.register_hook(self)

    def __call__(self, grad):
        if not self.armed:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad


def guarded_step(scaler, optimizer, precision, guard, params):
    """``scaler.step(optimizer)``; with ``guard`` also skip a bf16/fp32 step with a non-finite
    gradient -- the one thing ampkit adds to these loops. Returns True when it stepped."""
    finite = all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)
    if precision != "fp16" and guard and not finite:
        return False
    before = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    if before is None:
        return True
    return not optimizer_skipped(scaler, optimizer)


def optimizer_skipped(scaler, optimizer):
    state = scaler._per_optimizer_states[id(optimizer)]  # reading GradScaler's own bookkeeping
    return sum(v.item() for v in state["found_inf_per_device"].values()) > 0


# ---------------------------------------------------------------------------- 1. nanoGPT


class TinyGPT(torch.nn.Module):
    """nanoGPT's shape in miniature: embeddings, a LayerNorm'd MLP block, a tied head, and
    ``model(X, Y) -> (logits, loss)``."""

    def __init__(self, vocab=32, block=8, width=16):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(block, width)
        self.ln = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.proj = torch.nn.Linear(4 * width, width)
        self.ln_f = torch.nn.LayerNorm(width)
        self.lm_head = torch.nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        x = x + self.proj(F.gelu(self.fc(self.ln(x))))
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


NANO = {"iters": 6, "accum": 3, "warmup_iters": 2, "lr_decay_iters": 5, "poison": (3, 1)}


def nano_setup(seed=0, fused=False):
    torch.manual_seed(seed)
    model = TinyGPT()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=6e-3, betas=(0.9, 0.95), fused=fused)
    g = torch.Generator().manual_seed(seed + 1)
    n = NANO["iters"] * NANO["accum"] + 1
    data = [torch.randint(0, 32, (4, 9), generator=g) for _ in range(n)]
    return (
        model,
        optimizer,
        [(d[:, :-1], d[:, 1:].contiguous()) for d in data],
        InfGrad(model.fc.weight),
    )


def get_lr(it, learning_rate=6e-3, min_lr=6e-4):
    """nanoGPT's get_lr: linear warmup, then cosine decay to min_lr."""
    if it < NANO["warmup_iters"]:
        return learning_rate * (it + 1) / (NANO["warmup_iters"] + 1)
    if it > NANO["lr_decay_iters"]:
        return min_lr
    decay_ratio = (it - NANO["warmup_iters"]) / (NANO["lr_decay_iters"] - NANO["warmup_iters"])
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def nanogpt_raw(precision, guard=True, fused=False, grad_clip=1.0):
    model, optimizer, data, inf = nano_setup(fused=fused)
    accum = NANO["accum"]
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **SCALER)
    ctx = torch_autocast(precision)
    X, Y = data[0]
    for iter_num in range(NANO["iters"]):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(accum):
            inf.armed = (iter_num, micro_step) == NANO["poison"]
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / accum
            X, Y = data[iter_num * accum + micro_step + 1]
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        guarded_step(scaler, optimizer, precision, guard, model.parameters())
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scaler


def nanogpt_ampkit(precision, fused=False, grad_clip=1.0, step_each=False, **kw):
    model, optimizer, data, inf = nano_setup(fused=fused)
    accum = NANO["accum"]
    amp = MixedPrecision(
        precision,
        device="cpu",
        accumulation_steps=accum,
        clip_grad_norm=grad_clip or None,  # nanoGPT's grad_clip=0.0: no clipping
        **SCALER,
        **kw,
    )
    model, optimizer = amp.setup(model, optimizer)
    X, Y = data[0]
    for iter_num in range(NANO["iters"]):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        for micro_step in range(accum):
            inf.armed = (iter_num, micro_step) == NANO["poison"]
            with amp.autocast():
                logits, loss = model(X, Y)
            X, Y = data[iter_num * accum + micro_step + 1]
            amp.backward(loss)
            if step_each:
                amp.step(optimizer)  # returns at once off the boundary
        if not step_each:
            amp.step(optimizer)
    assert amp.stats()["skipped_steps"] == 1
    return model, optimizer, amp


@pytest.mark.parametrize("grad_clip", [1.0, 0.0], ids=["clip", "noclip"])
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_nanogpt_train_py_bitwise(precision, fused, grad_clip):
    ref, ref_opt, scaler = nanogpt_raw(precision, fused=fused, grad_clip=grad_clip)
    got, got_opt, amp = nanogpt_ampkit(precision, fused=fused, grad_clip=grad_clip)
    assert_same_run(ref, [ref_opt], got, [got_opt], scaler, amp)
    assert all(torch.isfinite(p).all() for p in got.parameters())


@pytest.mark.parametrize("precision", PRECISIONS)
def test_nanogpt_step_after_every_backward_is_the_same(precision):
    ref, ref_opt, scaler = nanogpt_raw(precision)
    got, got_opt, amp = nanogpt_ampkit(precision, step_each=True)
    assert_same_run(ref, [ref_opt], got, [got_opt], scaler, amp)


def test_nanogpt_skip_nonfinite_off_is_the_plain_bf16_loop():
    """``skip_nonfinite=False``: the unguarded raw bf16 loop, NaN weights included, bit for bit."""
    ref, ref_opt, _ = nanogpt_raw("bf16", guard=False)
    model, optimizer, data, inf = nano_setup()
    amp = MixedPrecision(
        "bf16", device="cpu", accumulation_steps=3, clip_grad_norm=1.0, skip_nonfinite=False
    )
    model, optimizer = amp.setup(model, optimizer)
    X, Y = data[0]
    for iter_num in range(NANO["iters"]):
        for param_group in optimizer.param_groups:
            param_group["lr"] = get_lr(iter_num)
        for micro_step in range(3):
            inf.armed = (iter_num, micro_step) == NANO["poison"]
            with amp.autocast():
                _, loss = model(X, Y)
            X, Y = data[iter_num * 3 + micro_step + 1]
            amp.backward(loss)
        amp.step(optimizer)
    assert not all(torch.isfinite(p).all() for p in ref.parameters())  # the raw loop's NaN
    assert_same_run(ref, [ref_opt], model, [optimizer])


# ---------------------------------------------------------------------------- 2. timm


def conv_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    )


def image_batches(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
        for _ in range(n)
    ]


class NativeScalerLike:
    """timm's ``NativeScaler``: backward through the scaler; on ``need_update`` unscale, clip
    ``parameters``, step and update."""

    def __init__(self, precision, guard):
        self._scaler = torch.amp.GradScaler("cpu", **SCALER)
        self.precision, self.guard = precision, guard

    def __call__(self, loss, optimizer, clip_grad=None, parameters=None, need_update=True):
        self._scaler.scale(loss).backward()
        if need_update:
            if clip_grad is not None:
                assert parameters is not None
                self._scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()


class ModelEmaV2Like:
    """timm's ``ModelEmaV2``: a deep copy; ``update`` blends every state_dict entry."""

    def __init__(self, model, decay=0.9):
        self.module = copy.deepcopy(model).eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(self.decay * ema_v + (1.0 - self.decay) * model_v)


class StepUpdateCosine:
    """timm's ``Scheduler.step_update`` with a warmup + cosine rule (``t_in_epochs=False``): the
    LR of each group is written from the number of updates."""

    def __init__(self, optimizer, t_initial=6, warmup_t=2, warmup_lr_init=1e-3, lr_min=1e-3):
        self.optimizer = optimizer
        self.base = [g["lr"] for g in optimizer.param_groups]
        self.t_initial, self.warmup_t = t_initial, warmup_t
        self.warmup_lr_init, self.lr_min = warmup_lr_init, lr_min
        self.step_update(0)

    def step_update(self, num_updates):
        for group, base in zip(self.optimizer.param_groups, self.base):
            t = num_updates
            if t < self.warmup_t:
                lr = self.warmup_lr_init + t * (base - self.warmup_lr_init) / self.warmup_t
            else:
                t -= self.warmup_t
                cos = 1 + math.cos(math.pi * t / self.t_initial)
                lr = self.lr_min + 0.5 * (base - self.lr_min) * cos
            group["lr"] = lr


TIMM = {"batches": 11, "accum": 2, "clip": 1.0, "poison": 5}  # a short last window of 1


def timm_setup():
    model = conv_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return model, optimizer, image_batches(TIMM["batches"]), InfGrad(model[0].weight)


def timm_raw(precision, guard=True, clip_grad=TIMM["clip"]):
    model, optimizer, loader, inf = timm_setup()
    accum_steps = TIMM["accum"]
    loss_scaler = NativeScalerLike(precision, guard) if precision == "fp16" else None
    model_ema = ModelEmaV2Like(model)
    lr_scheduler = StepUpdateCosine(optimizer)
    last_accum_steps = len(loader) % accum_steps
    last_batch_idx = len(loader) - 1
    last_batch_idx_to_accum = len(loader) - last_accum_steps
    num_updates = 0
    for batch_idx, (input, target) in enumerate(loader):
        inf.armed = batch_idx == TIMM["poison"]
        last_batch = batch_idx == last_batch_idx
        need_update = last_batch or (batch_idx + 1) % accum_steps == 0
        if batch_idx >= last_batch_idx_to_accum:
            accum_steps = last_accum_steps
        with torch_autocast(precision):
            output = model(input)
            loss = F.cross_entropy(output, target)
        if accum_steps > 1:
            loss /= accum_steps
        if loss_scaler is not None:
            loss_scaler(
                loss,
                optimizer,
                clip_grad=clip_grad,
                parameters=model.parameters(),
                need_update=need_update,
            )
        else:
            loss.backward()
            if need_update:
                if clip_grad is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
                finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
                if finite or not guard:
                    optimizer.step()
        if not need_update:
            continue
        num_updates += 1
        optimizer.zero_grad()
        model_ema.update(model)
        lr_scheduler.step_update(num_updates=num_updates)
    scaler = loss_scaler._scaler if loss_scaler is not None else None
    return model, optimizer, model_ema, scaler


def timm_ampkit(precision, clip_grad=TIMM["clip"]):
    model, optimizer, loader, inf = timm_setup()
    accum_steps = TIMM["accum"]
    amp = MixedPrecision(
        precision,
        device="cpu",
        accumulation_steps=accum_steps,
        clip_grad_norm=clip_grad,
        **SCALER,
    )
    model, optimizer = amp.setup(model, optimizer)
    model_ema = ModelEmaV2Like(model)
    lr_scheduler = StepUpdateCosine(optimizer)
    last_accum_steps = len(loader) % accum_steps
    num_updates = 0
    for batch_idx, (input, target) in enumerate(loader):
        inf.armed = batch_idx == TIMM["poison"]
        if last_accum_steps and batch_idx == len(loader) - last_accum_steps:
            amp.set_window(last_accum_steps)  # timm's last_accum_steps
        with amp.autocast():
            output = model(input)
            loss = F.cross_entropy(output, target)
        amp.backward(loss)  # ampkit divides by the window
        if not amp.step(optimizer).boundary:
            continue
        num_updates += 1
        model_ema.update(model)
        lr_scheduler.step_update(num_updates=num_updates)
    assert amp.stats()["skipped_steps"] == 1
    return model, optimizer, model_ema, amp


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("clip_grad", [TIMM["clip"], None], ids=["clip", "noclip"])
def test_timm_train_one_epoch_with_ema_bitwise(precision, clip_grad):
    ref, ref_opt, ref_ema, scaler = timm_raw(precision, clip_grad=clip_grad)
    got, got_opt, got_ema, amp = timm_ampkit(precision, clip_grad=clip_grad)
    assert_same_run(ref, [ref_opt], got, [got_opt], scaler, amp)
    ema = [*ref_ema.module.state_dict().values()], [*got_ema.module.state_dict().values()]
    assert_same_tensors(*ema, "EMA")
    assert not torch.equal(ema[1][0], conv_net()[0].weight)  # the EMA moved


# ---------------------------------------------------------------------------- 3. Hugging Face


class TinyEncoder(torch.nn.Module):
    def __init__(self, width=16, classes=3):
        super().__init__()
        self.embed = torch.nn.Linear(8, width)
        self.LayerNorm = torch.nn.LayerNorm(width)
        self.dense = torch.nn.Linear(width, width)
        self.classifier = torch.nn.Linear(width, classes)

    def forward(self, x, labels):
        h = self.LayerNorm(F.gelu(self.embed(x)))
        logits = self.classifier(torch.tanh(self.dense(h)))
        return F.cross_entropy(logits, labels)


HF = {"batches": 12, "accum": 2, "max_grad_norm": 1.0, "warmup": 2, "poison": 4}


def hf_setup(fused=False):
    torch.manual_seed(0)
    model = TinyEncoder()
    # Trainer.get_decay_parameter_names: everything but biases and LayerNorm weights decays
    decay = [n for n, _ in model.named_parameters() if "bias" not in n and "LayerNorm" not in n]
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=5e-3, betas=(0.9, 0.999), eps=1e-8, fused=fused)
    total = HF["batches"] // HF["accum"]

    def lr_lambda(current_step):  # get_linear_schedule_with_warmup
        if current_step < HF["warmup"]:
            return float(current_step) / float(max(1, HF["warmup"]))
        return max(0.0, float(total - current_step) / float(max(1, total - HF["warmup"])))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    g = torch.Generator().manual_seed(5)
    data = [
        (torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g))
        for _ in range(HF["batches"])
    ]
    return model, optimizer, scheduler, data, InfGrad(model.dense.weight)


def hf_raw(precision, guard=True, fused=False):
    """Trainer's inner loop with Accelerate's pieces: ``training_step`` divides by the
    accumulation steps and backpropagates through the scaler; at the boundary
    ``accelerator.clip_grad_norm_`` (unscale, then clip), ``optimizer.step()`` (scaler step and
    update), the scheduler only if the step was not skipped, ``model.zero_grad()``."""
    model, optimizer, lr_scheduler, data, inf = hf_setup(fused)
    gas = HF["accum"]
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **SCALER)
    for step, (inputs, labels) in enumerate(data):
        inf.armed = step // gas == HF["poison"]
        model.train()
        with torch_autocast(precision):
            loss = model(inputs, labels)
        loss = loss / gas
        scaler.scale(loss).backward()
        if (step + 1) % gas == 0 or step + 1 == len(data):
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), HF["max_grad_norm"])
            stepped = guarded_step(scaler, optimizer, precision, guard, model.parameters())
            scaler.update()
            if stepped:  # not accelerator.optimizer_step_was_skipped
                lr_scheduler.step()
            model.zero_grad()
    return model, optimizer, lr_scheduler, scaler


def hf_ampkit(precision, fused=False):
    model, optimizer, lr_scheduler, data, inf = hf_setup(fused)
    gas = HF["accum"]
    amp = MixedPrecision(
        precision,
        device="cpu",
        gradient_accumulation_steps=gas,
        max_grad_norm=HF["max_grad_norm"],
        **SCALER,
    )
    model, optimizer = amp.setup(model, optimizer)
    for step, (inputs, labels) in enumerate(data):
        inf.armed = step // gas == HF["poison"]
        model.train()
        with amp.autocast():
            loss = model(inputs, labels)
        amp.backward(loss)
        result = amp.step(optimizer)
        if result.boundary and not result.skipped:
            lr_scheduler.step()
    assert amp.stats()["skipped_steps"] == 1
    return model, optimizer, lr_scheduler, amp


@pytest.mark.parametrize("fused", [False, True], ids=["adamw_torch", "adamw_torch_fused"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_hf_trainer_decay_groups_schedule_bitwise(precision, fused):
    ref, ref_opt, ref_sched, scaler = hf_raw(precision, fused=fused)
    got, got_opt, got_sched, amp = hf_ampkit(precision, fused)
    assert_same_run(ref, [ref_opt], got, [got_opt], scaler, amp)
    assert ref_sched.state_dict() == got_sched.state_dict()
    assert ref_sched.last_epoch == HF["batches"] // HF["accum"] - 1  # the skipped one not counted


# ---------------------------------------------------------------------------- 4. a GAN, one scaler

NZ, GAN_ITERS, GAN_POISON = 4, 7, 2


def gan_setup(fused=False):
    torch.manual_seed(0)
    netG = torch.nn.Sequential(
        torch.nn.Linear(NZ, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 8)
    )
    netD = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1)
    )
    optD = torch.optim.Adam(netD.parameters(), lr=2e-3, betas=(0.5, 0.999), fused=fused)
    optG = torch.optim.Adam(netG.parameters(), lr=2e-3, betas=(0.5, 0.999), fused=fused)
    g = torch.Generator().manual_seed(7)
    data = [
        (torch.randn(6, 8, generator=g) + 2, torch.randn(6, NZ, generator=g))
        for _ in range(GAN_ITERS)
    ]
    return netG, netD, optD, optG, data, InfGrad(netD[0].weight)


def gan_raw(precision, guard=True, fused=False):
    """PyTorch's DCGAN example with AMP: D on real and fake, ``scaler.step(optD)``; G through the
    updated D, ``scaler.step(optG)``; one ``scaler.update()`` per iteration."""
    netG, netD, optD, optG, data, inf = gan_setup(fused)
    criterion = torch.nn.BCEWithLogitsLoss()
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16", **SCALER)
    for i, (real, noise) in enumerate(data):
        inf.armed = i == GAN_POISON
        netD.zero_grad()
        with torch_autocast(precision):
            output = netD(real).view(-1)
            errD_real = criterion(output, torch.ones_like(output))
            fake = netG(noise)
            output = netD(fake.detach()).view(-1)
            errD_fake = criterion(output, torch.zeros_like(output))
            errD = errD_real + errD_fake
        scaler.scale(errD).backward()
        guarded_step(scaler, optD, precision, guard, netD.parameters())
        inf.armed = False
        netG.zero_grad()
        with torch_autocast(precision):
            output = netD(fake).view(-1)
            errG = criterion(output, torch.ones_like(output))
        scaler.scale(errG).backward()
        guarded_step(scaler, optG, precision, guard, netG.parameters())
        scaler.update()
    return torch.nn.ModuleList([netG, netD]), [optD, optG], scaler


def gan_ampkit(precision, one_update=True, fused=False, zero_d=True):
    netG, netD, optD, optG, data, inf = gan_setup(fused)
    criterion = torch.nn.BCEWithLogitsLoss()
    amp = MixedPrecision(precision, device="cpu", **SCALER)
    models, optD, optG = amp.setup(torch.nn.ModuleList([netG, netD]), optD, optG)
    for i, (real, noise) in enumerate(data):
        inf.armed = i == GAN_POISON
        if zero_d:
            netD.zero_grad()  # keep: G's backward below also leaves gradients in D
        with amp.autocast():
            output = netD(real).view(-1)
            errD_real = criterion(output, torch.ones_like(output))
            fake = netG(noise)
            output = netD(fake.detach()).view(-1)
            errD_fake = criterion(output, torch.zeros_like(output))
            errD = errD_real + errD_fake
        amp.backward(errD)
        amp.step(optD, update_scale=not one_update)  # scaler.step(optD): no update yet
        inf.armed = False
        with amp.autocast():
            output = netD(fake).view(-1)
            errG = criterion(output, torch.ones_like(output))
        amp.backward(errG)
        amp.step(optG)  # scaler.step(optG); scaler.update()
    assert amp.stats()["optimizer_steps"] == GAN_ITERS * (1 if one_update else 2)
    return models, [optD, optG], amp


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gan_two_optimizers_one_scaler_bitwise(precision, fused):
    ref, ref_opts, scaler = gan_raw(precision, fused=fused)
    got, got_opts, amp = gan_ampkit(precision, fused=fused)
    assert_same_run(ref, ref_opts, got, got_opts, scaler, amp)


def test_gan_two_updates_per_iteration_is_another_scale_sequence():
    """Without ``update_scale=False`` the scale is updated twice per iteration: the growth
    counter runs twice as fast, so the scale leaves GradScaler's sequence."""
    _, _, scaler = gan_raw("fp16")
    _, _, amp = gan_ampkit("fp16", one_update=False)
    assert amp.get_scale() != scaler.get_scale()


def test_gan_port_must_keep_the_zero_grad_of_d():
    """``amp.step(optG)`` clears optG's gradients only; G's backward also wrote into D's, which
    the raw loop clears with ``netD.zero_grad()`` -- drop that line and D's next step differs."""
    ref, _, _ = gan_raw("fp32")
    got, _, _ = gan_ampkit("fp32", zero_d=False)
    assert not all(torch.equal(a, b) for a, b in zip(ref[1].parameters(), got[1].parameters()))


def test_update_scale_false_then_the_same_optimizer_again_raises():
    netG, netD, optD, optG, data, _ = gan_setup()
    amp = MixedPrecision("fp16", device="cpu")
    _, optD, optG = amp.setup(torch.nn.ModuleList([netG, netD]), optD, optG)
    real, _ = data[0]
    amp.backward(netD(real).float().mean())
    amp.step(optD, update_scale=False)
    amp.backward(netD(real).float().mean())
    grads = [p.grad.clone() for p in netD.parameters()]
    with pytest.raises(RuntimeError, match=r"again before the loss scale was updated"):
        amp.step(optD)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, netD.parameters()))
    with pytest.raises(RuntimeError, match=r"optimizer\(s\) \[1\]"):
        amp.step(optG, optD)
    assert amp.step(optG).boundary and amp.optimizer_steps == 1  # the iteration ends


# ---------------------------------------------------------------------------- 5. torchvision

TV = {"epochs": 2, "batches": 5, "warmup_epochs": 1, "ema_steps": 2, "poison": (1, 2)}


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """torchvision's reference EMA: an ``AveragedModel`` over parameters and buffers."""

    def __init__(self, model, decay):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, "cpu", ema_avg, use_buffers=True)


def tv_setup():
    model = conv_net(1)
    norm = [
        p for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()
    ]
    other = [p for p in model.parameters() if all(p is not q for q in norm)]
    # split_normalization_params: [norm, other] with [norm_weight_decay, weight_decay]
    groups = [{"params": norm, "weight_decay": 0.0}, {"params": other, "weight_decay": 1e-4}]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=1e-4)
    main = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=TV["epochs"] - 1)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=1)
    lr_scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer, schedulers=[warmup, main], milestones=[TV["warmup_epochs"]]
    )
    adjust = TV["batches"] * TV["ema_steps"] / TV["epochs"]
    alpha = min(1.0, (1.0 - 0.99) * adjust)
    model_ema = ExponentialMovingAverage(model, decay=1.0 - alpha)
    loaders = [image_batches(TV["batches"], seed=10 + e) for e in range(TV["epochs"])]
    return model, optimizer, lr_scheduler, model_ema, loaders, InfGrad(model[5].weight)


def torchvision_raw(precision, clip_grad_norm, guard=True):
    model, optimizer, lr_scheduler, model_ema, loaders, inf = tv_setup()
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    scaler = torch.amp.GradScaler("cpu", **SCALER) if precision == "fp16" else None
    for epoch in range(TV["epochs"]):
        model.train()
        for i, (image, target) in enumerate(loaders[epoch]):
            inf.armed = (epoch, i) == TV["poison"]
            with torch_autocast(precision):
                output = model(image)
                loss = criterion(output, target)
            optimizer.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                if clip_grad_norm is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
                if not guard or all(torch.isfinite(p.grad).all() for p in model.parameters()):
                    optimizer.step()
            if i % TV["ema_steps"] == 0:
                model_ema.update_parameters(model)
                if epoch < TV["warmup_epochs"]:
                    model_ema.n_averaged.fill_(0)  # keep copying the weights during warmup
        lr_scheduler.step()
    return model, optimizer, model_ema, scaler


def torchvision_ampkit(precision, clip_grad_norm):
    model, optimizer, lr_scheduler, model_ema, loaders, inf = tv_setup()
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    amp = MixedPrecision(precision, device="cpu", clip_grad_norm=clip_grad_norm, **SCALER)
    model, optimizer = amp.setup(model, optimizer)
    for epoch in range(TV["epochs"]):
        model.train()
        for i, (image, target) in enumerate(loaders[epoch]):
            inf.armed = (epoch, i) == TV["poison"]
            with amp.autocast():
                output = model(image)
                loss = criterion(output, target)
            amp.backward(loss)
            amp.step(optimizer)
            if i % TV["ema_steps"] == 0:
                model_ema.update_parameters(model)
                if epoch < TV["warmup_epochs"]:
                    model_ema.n_averaged.fill_(0)
        lr_scheduler.step()
    assert amp.stats()["skipped_steps"] == 1
    return model, optimizer, model_ema, amp


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_torchvision_train_one_epoch_with_ema_bitwise(precision, clip):
    ref, ref_opt, ref_ema, scaler = torchvision_raw(precision, clip)
    got, got_opt, got_ema, amp = torchvision_ampkit(precision, clip)
    assert_same_run(ref, [ref_opt], got, [got_opt], scaler, amp)
    ema = [*ref_ema.module.state_dict().values()], [*got_ema.module.state_dict().values()]
    assert_same_tensors(*ema, "EMA")
    assert_same_tensors([ref_ema.n_averaged], [got_ema.n_averaged], "n_averaged")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_step_whose_update_waits_still_says_it_was_skipped(precision):
    """``amp.step(optD, update_scale=False)`` on non-finite gradients skips D's step and says so
    (``found_inf`` > 0, ``skipped``); G's updating step then reports the iteration (both
    optimizers' verdicts, as ``GradScaler.update`` folds them), and a clean D step says 0."""
    netG, netD, optD, optG, data, _ = gan_setup()
    # (a small fp16 scale: only the injected inf overflows, not this net's real gradients)
    amp = MixedPrecision(precision, device="cpu", **({"init_scale": 256.0} if precision == "fp16" else {}))
    _, optD, optG = amp.setup(torch.nn.ModuleList([netG, netD]), optD, optG)
    real, noise = data[0]
    first = next(netD.parameters())
    handle = first.register_hook(lambda g: g * float("inf"))
    before = [p.detach().clone() for p in netD.parameters()]
    with amp.autocast():
        loss = netD(real).float().mean()
    amp.backward(loss)
    handle.remove()
    d = amp.step(optD, update_scale=False)
    assert d.found_inf is not None and d.skipped
    assert all(torch.equal(a, p) for a, p in zip(before, netD.parameters()))
    with amp.autocast():
        loss = netD(netG(noise)).float().mean()
    amp.backward(loss)
    g = amp.step(optG)
    assert g.skipped  # the iteration's verdict: D's overflow counts, as in GradScaler.update
    netD.zero_grad()  # (what G's backward left in D, as the loop clears it)
    with amp.autocast():
        loss = netD(real).float().mean()
    amp.backward(loss)
    assert not amp.step(optD, update_scale=False).skipped
