"""The Lightning precision plugin: equal to Lightning's own plugins where both do the same thing."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from ampkit import MixedPrecision  # noqa: E402
from ampkit.integrations.lightning import AmpkitFabricPrecision, AmpkitPrecision  # noqa: E402
from tests.support.unstable_model import Unstable, data  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.l2(F.gelu(self.l1(x))), y)


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


class Module(pl.LightningModule):
    def __init__(self, net, lr=1e-2, scheduler=False):
        super().__init__()
        self.net, self.lr, self.scheduler = net, lr, scheduler

    def training_step(self, batch, idx):
        return self.net(*batch)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(module, data, steps, **kw):
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kw,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return trainer


@pytest.mark.parametrize("accum,clip", [(1, None), (2, 0.5)])
def test_bf16_equals_lightning_bf16_mixed(accum, clip):
    torch.manual_seed(0)
    net = Net()
    data = batches(40)
    ours, theirs = Module(copy.deepcopy(net)), Module(copy.deepcopy(net))
    fit(
        ours,
        data,
        20,
        plugins=[AmpkitPrecision("bf16")],
        accumulate_grad_batches=accum,
        gradient_clip_val=clip,
    )
    fit(
        theirs,
        data,
        20,
        precision="bf16-mixed",
        accumulate_grad_batches=accum,
        gradient_clip_val=clip,
    )
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert not torch.equal(next(ours.parameters()), next(net.parameters()))  # it trained


def hand_fp16(net, data, steps, init_scale, sched=False):
    """torch's own recipe: autocast fp16 + GradScaler (what Lightning's 16-mixed plugin runs)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    lr = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if sched else None
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scales = []
    for x, y in data[:steps]:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = net(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scales.append(scaler.get_scale())
        scaler.step(opt)
        before = scaler.get_scale()
        scaler.update()
        if lr is not None and scaler.get_scale() >= before:  # stepped: the scheduler follows
            lr.step()
        opt.zero_grad(set_to_none=True)
    return scales, lr


def test_fp16_skips_and_scales_like_gradscaler():
    torch.manual_seed(0)
    net = Net()
    data = batches(20)
    init = 2.0**40  # fp16 overflows at first: the first steps are skipped and the scale backs off
    module = Module(copy.deepcopy(net), scheduler=True)
    plugin = AmpkitPrecision("fp16", init_scale=init)
    scales = []

    class Scales(pl.Callback):
        def on_before_optimizer_step(self, trainer, mod, opt):
            scales.append(plugin.amp.get_scale())

    fit(module, data, 20, plugins=[plugin], gradient_clip_val=1.0, callbacks=[Scales()])
    ref = copy.deepcopy(net)
    ref_scales, ref_lr = hand_fp16(ref, data, 20, init, sched=True)
    assert scales == ref_scales
    for a, b in zip(module.net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    stats = plugin.amp.stats()
    assert stats["skipped_steps"] > 0 and stats["optimizer_steps"] == 20
    sched = module.trainer.lr_scheduler_configs[0].scheduler
    assert (
        sched.last_epoch == 20 - stats["skipped_steps"] == ref_lr.last_epoch
    )  # skipped steps: no LR step


@pytest.mark.slow
def test_fallback_as_in_ampkits_loop():
    torch.manual_seed(0)
    net = Unstable()
    xs = data(30)
    settings = dict(fallback=True, fallback_patience=3, fallback_check_every=1)
    module = Module(copy.deepcopy(net), lr=3e-3)
    module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), lr=3e-3)
    plugin = AmpkitPrecision("fp16", **settings)
    fit(module, xs, 30, plugins=[plugin])
    ref = copy.deepcopy(net)
    amp = MixedPrecision("fp16", device="cpu", **settings)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    amp.setup(ref, opt)
    for x, y in xs:
        with amp.autocast():
            loss = ref(x, y)
        amp.backward(loss)
        amp.step(opt)
    assert plugin.amp.precision.name == amp.precision.name != "fp16"
    kinds = [e.kind for e in plugin.amp.events]
    assert [k for k in kinds if k != "diagnosis"] == [
        e.kind for e in amp.events
    ] and "fallback" in kinds
    assert kinds.index("diagnosis") < kinds.index("fallback")  # localized: the layer that overflows
    assert plugin.diagnosis.module == "net.big", plugin.diagnosis
    for a, b in zip(module.net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_bf16_pure_keeps_masters_and_matches_the_engine():
    torch.manual_seed(0)
    net = Net()
    data = batches(10)
    module = Module(copy.deepcopy(net))
    plugin = AmpkitPrecision("bf16-true")  # Lightning's name: ampkit's bf16-pure, with fp32 masters
    trainer = fit(module, data, 10, plugins=[plugin], gradient_clip_val=1.0)
    assert trainer.precision == "bf16-true" and plugin.amp.precision.name == "bf16-pure"
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    masters = plugin.amp.master_params()
    assert masters and all(m.dtype == torch.float32 for m in masters)
    ref = copy.deepcopy(net)
    amp = MixedPrecision("bf16-pure", device="cpu", clip_grad_norm=1.0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    amp.setup(ref, opt)
    for x, y in data:
        with amp.autocast():
            loss = ref(x, y)
        amp.backward(loss)
        amp.step(opt)
    for a, b in zip(masters, amp.master_params()):
        assert torch.equal(a, b)
    state = plugin.state_dict()
    assert state["precision"] == "bf16-pure" and state["optimizer_steps"] == 10


def test_bad_precision_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="bf16-pure"):
        AmpkitPrecision("fp61")


def test_fabric_bf16_equals_fabric_bf16_mixed():
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    net = Net()
    data = batches(12)
    out = []
    for kw in ({"plugins": [AmpkitFabricPrecision("bf16")]}, {"precision": "bf16-mixed"}):
        fabric = Fabric(accelerator="cpu", devices=1, **kw)
        model = copy.deepcopy(net)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = fabric.setup(model, opt)
        for x, y in data:
            loss = model(x, y)
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
        out.append(model)
    for a, b in zip(out[0].parameters(), out[1].parameters()):
        assert torch.equal(a, b)


def test_the_engine_state_rides_in_lightnings_checkpoint(tmp_path):
    """Lightning saves the plugin's state (scale, counters, skips) and a resumed fit starts from it."""
    torch.manual_seed(0)
    net = Net()
    data = batches(12)
    first = AmpkitPrecision(
        "fp16", init_scale=2.0**20, growth_interval=3
    )  # skips, backs off, grows
    trainer = fit(Module(copy.deepcopy(net)), data[:6], 6, plugins=[first])
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    saved = first.amp.state_dict()
    assert saved["scaler"]["overflows"] > 0 and saved["scaler"]["scale"] != 2.0**20
    ckpt = torch.load(tmp_path / "half.ckpt", weights_only=False)
    assert ckpt["AmpkitPrecision"]["optimizer_steps"] == 6
    second = AmpkitPrecision("fp16")  # the checkpoint brings the scaler's settings and state
    seen = {}

    class AtStart(pl.Callback):
        def on_train_start(self, trainer, module):
            seen.update(
                second.amp.state_dict(), growth_interval=second.amp.scaler.get_growth_interval()
            )

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[second],
        callbacks=[AtStart()],
    )
    trainer.fit(
        Module(copy.deepcopy(net)),
        torch.utils.data.DataLoader(data[6:], batch_size=None),
        ckpt_path=tmp_path / "half.ckpt",
    )
    for key in ("scaler", "optimizer_steps", "precision", "events"):
        assert seen[key] == saved[key], key
    assert seen["growth_interval"] == 3 and second.amp.optimizer_steps == 12


def test_fabric_bf16_pure_with_the_engine_set_up_first():
    """Fabric shows the plugin no optimizer before its first step: the masters need amp.setup first."""
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    net = Net()
    data = batches(6)
    plugin = AmpkitFabricPrecision("bf16-pure", device="cpu")
    model = copy.deepcopy(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin.amp.setup(model, opt)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(model, opt)
    ref = copy.deepcopy(net)
    amp = MixedPrecision("bf16-pure", device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    amp.setup(ref, ref_opt)
    for x, y in data:
        fabric.backward(model(x, y))
        opt.step()
        opt.zero_grad()
        with amp.autocast():
            loss = ref(x, y)
        amp.backward(loss)
        amp.step(ref_opt)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for a, b in zip(plugin.amp.master_params(), amp.master_params()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="before fabric.setup"):
        other = AmpkitFabricPrecision("bf16-pure", device="cpu")
        fabric2 = Fabric(accelerator="cpu", devices=1, plugins=[other])
        fresh = copy.deepcopy(net)
        m, o = fabric2.setup(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
        fabric2.backward(m(*data[0]))
        o.step()


def test_the_plugin_takes_the_precision_aliases():
    """The one alias table (ampkit.step.aliases) serves the plugin as every other surface."""
    from ampkit.step.aliases import PRECISION_ALIASES
    from ampkit.step.config import canonical_precision
    from ampkit.step.precision import REGISTRY

    for alias in ("16-mixed", "bf16-mixed", "bf16-true", "32-true", "O0", "float32", "bfloat16"):
        name = canonical_precision(PRECISION_ALIASES[alias.lower()])
        assert AmpkitPrecision(alias).precision == REGISTRY[name].lightning_name, alias


def test_a_checkpoint_without_the_plugins_state_is_refused_for_fitting(tmp_path):
    """A Lightning checkpoint without the ``AmpkitPrecision`` entry (written with another precision
    plugin, or the entry lost) resumed a fit with a fresh engine, silently: the step counters
    restarted, a pure precision's fp32 masters rebuilt from the half weights. Resuming a fit from it
    is refused, naming the entry and what it holds; validating from it (no engine state needed)
    still works."""
    from ampkit import CheckpointError

    class Validated(Module):
        def validation_step(self, batch, idx):
            self.log("val", self.net(*batch))

    torch.manual_seed(0)
    data = batches(4)
    trainer = fit(Validated(Net()), data, 2)  # Lightning's own fp32 precision: no ampkit entry
    trainer.save_checkpoint(tmp_path / "plain.ckpt")
    assert "AmpkitPrecision" not in torch.load(tmp_path / "plain.ckpt", weights_only=False)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    plugin = AmpkitPrecision("bf16-pure")
    resumed = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[plugin],
    )
    with pytest.raises(CheckpointError) as e:
        resumed.fit(Validated(Net()), loader, ckpt_path=tmp_path / "plain.ckpt")
    for words in ("'AmpkitPrecision'", "fp32 master weights", "fresh engine"):
        assert words in str(e.value), (words, str(e.value))
    checker = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AmpkitPrecision("bf16")],
    )
    checker.validate(Validated(Net()), loader, ckpt_path=tmp_path / "plain.ckpt", verbose=False)
