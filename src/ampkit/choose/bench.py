"""Choose by measurement: train every candidate precision side by side, then recommend one.

``compare`` trains one copy of the model per precision from the same seed on the same batches,
in lockstep: blocks of steps rotate through the precisions (the order shifts every round), so
drift of the machine hits all alike. fp32 is always included: it is the reference for speed-up
and fidelity. ``tune`` picks the fastest precision whose final loss stays within a tolerance of
fp32's and that needed no fallback, and says why every other candidate lost. What was timed is
a whole training step (forward, backward, optimizer) on the process's threads, in ``repeats``
blocks; each speed-up carries the spread of its blocks' paired ratios, and one inside it reads
"within noise" (:mod:`.speed`). ``tune`` does not pick a precision it cannot tell apart from
fp32: a speed-up within noise loses to fp32 (nothing gained that the measurement can show, and
fp32 carries no numerics risk).

Rungs of bf16-pure's memory ladder are candidates too, spelt as for ``estimate``/``plan``
(``"bf16-pure:split"``, ``"bf16-pure:stochastic+bf16"``; :data:`RUNGS` lists them). Each row then
also carries ``bytes_per_param``: the resident weights, masters and optimizer state measured from
the live tensors after training, per parameter. With rungs among the candidates ``tune`` prefers
memory: the fewest bytes per parameter within the tolerance, ties to the faster step.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from ..loop.batches import IndexedBatches
from ..loop.steps import LossFn, Steps, batch_loss
from ..observe.memory import activations, breakdown
from ..observe.report import save_figure
from ..step.engine import MixedPrecision
from ..step.hardware import device_info, normalize_device
from ..step.precision import REFERENCE, REGISTRY, Precision, PrecisionError, resolve_precision
from ..step.rung import join_spec, ladder_specs, named_twice, split_spec
from .speed import noise_words, paired_ratio, within_noise

__all__ = ["BenchReport", "BenchResult", "RUNGS", "compare", "with_rungs"]

DEFAULT_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
#: bf16-pure's rungs, most memory first (``masters="none"`` stalls and is left out)
RUNGS = ladder_specs()


def with_rungs(precisions: Optional[Sequence[str]]) -> list[str]:
    """``precisions`` (default: :data:`DEFAULT_PRECISIONS`) with a plain ``bf16-pure`` replaced by
    every rung of its ladder (:data:`RUNGS`), or the rungs appended when it is absent."""
    names = list(precisions or DEFAULT_PRECISIONS)
    at = [i for i, n in enumerate(names) if n in REGISTRY and REGISTRY[n].has_ladder]
    if not at:
        return list(dict.fromkeys(names + list(RUNGS)))
    i = at[0]
    return list(dict.fromkeys(names[:i] + list(RUNGS) + names[i + 1 :]))


@dataclass
class BenchResult:
    """One precision's measurements (``status == "skipped"`` with a ``reason`` when it could not run)."""

    precision: str
    status: str = "ok"
    reason: str = ""
    step_ms: Optional[float] = None  # median over timed blocks
    step_ms_p10: Optional[float] = None
    step_ms_p90: Optional[float] = None
    samples_per_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    speedup_vs_fp32: Optional[float] = None
    speedup_spread: Optional[float] = None  # the blocks' paired speed-ups' spread (inf: one block)
    activation_bytes: Optional[int] = None
    static_bytes: Optional[int] = None  # parameters + gradients + optimizer state (+ scaler), exact
    bytes_per_param: Optional[float] = (
        None  # weights + masters + optimizer state between steps, per parameter
    )
    peak_mem_bytes: Optional[int] = (
        None  # CUDA only: this run's resident state + one step's peak on top
    )
    final_loss: Optional[float] = None  # mean of the last few steps' losses
    loss_gap: Optional[float] = None  # (final_loss - fp32 final_loss) / fp32 final_loss
    skipped_steps: int = 0
    fallbacks: int = 0
    final_precision: Optional[str] = None
    losses: list[float] = field(default_factory=list)


@dataclass
class BenchReport:
    """All results plus the setting they were measured in."""

    results: list[BenchResult]
    device: str
    device_name: str
    model: str
    steps: int
    batch_size: Optional[int]
    accumulation_steps: int
    torch_version: str = torch.__version__
    threads: Optional[int] = None  # torch's intra-op threads while timing
    repeats: Optional[int] = None  # timed blocks per precision

    @property
    def timed(self) -> str:
        """What the times are: "whole training step, 2 threads, 5 repeats" (spreads per row)."""
        text = "whole training step"
        if self.threads:
            text += f", {self.threads} thread{'s' if self.threads != 1 else ''}"
        if self.repeats:
            text += f", {self.repeats} repeat{'s' if self.repeats != 1 else ''}"
        return text

    def result(self, precision: str) -> Optional[BenchResult]:
        return next((r for r in self.results if r.precision == precision), None)

    def to_dict(self, losses: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not losses:
            for r in d["results"]:
                r.pop("losses", None)
        return d

    def table(self) -> Any:
        from rich.table import Table

        t = Table(
            title=f"ampkit bench: {self.model} on {self.device_name} ({self.device}), {self.steps} steps",
            caption=f"timed: {self.timed}; a speed-up inside its repeats' spread says "
            "'within noise'",
        )
        cols = (
            "precision",
            "ms/step",
            "p10–p90",
            "speed-up",
            "samples/s",
            "tokens/s",
            "activations",
            "params+grads+opt",
            "B/param",
            "peak",
            "final loss",
            "gap vs fp32",
            "skipped",
            "fallbacks",
        )
        for c in cols:
            t.add_column(c, justify="left" if c == "precision" else "right")
        for r in self.results:
            if r.status != "ok":
                t.add_row(r.precision, "[yellow]skipped[/]", *[""] * (len(cols) - 2))
                continue
            t.add_row(
                r.precision,
                _f(r.step_ms, "{:.2f}"),
                f"{_f(r.step_ms_p10, '{:.2f}')}–{_f(r.step_ms_p90, '{:.2f}')}",
                _speedup_cell(r),
                _f(r.samples_per_s, "{:,.0f}"),
                _f(r.tokens_per_s, "{:,.0f}"),
                _mib(r.activation_bytes),
                _mib(r.static_bytes),
                _f(r.bytes_per_param, "{:.2f}"),
                _mib(r.peak_mem_bytes),
                _f(r.final_loss, "{:.4f}"),
                _f(None if r.loss_gap is None else 100 * r.loss_gap, "{:+.2f}%"),
                str(r.skipped_steps),
                str(r.fallbacks),
            )
        return t

    def plot(self, path: str) -> str:
        """Speed-up and memory bars, loss curves overlaid: one PNG (needs ``ampkit[plot]``)."""
        from ..observe.plots import pyplot

        plt = pyplot()
        ok = [r for r in self.results if r.status == "ok"]
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4.5), dpi=100)
        names = [r.precision for r in ok]
        a1.bar(names, [r.speedup_vs_fp32 or 0 for r in ok], color="tab:blue")
        a1.axhline(1.0, color="grey", linewidth=0.8)
        a1.set(title="speed-up vs fp32", ylabel="x")
        act = [(r.activation_bytes or 0) / 2**20 for r in ok]
        static = [(r.static_bytes or 0) / 2**20 for r in ok]
        a2.bar(names, static, label="params+grads+optimizer", color="tab:gray")
        a2.bar(names, act, bottom=static, label="activations", color="tab:orange")
        a2.set(title="memory (MiB)")
        a2.legend(fontsize=8)
        for r in ok:
            a3.plot(range(1, len(r.losses) + 1), r.losses, label=r.precision, linewidth=1)
        a3.set(title="loss", xlabel="optimizer step")
        a3.legend(fontsize=8)
        for a in (a1, a2, a3):
            a.grid(alpha=0.3)
        fig.suptitle(f"{self.model} on {self.device_name}")
        fig.tight_layout()
        save_figure(fig, path)  # atomic: a stopped bench leaves the old image or none, never a cut one
        plt.close(fig)
        return path


def _speedup_cell(r: BenchResult) -> str:
    if r.speedup_vs_fp32 is None:
        return "—"
    spread = r.speedup_spread
    if r.precision == REFERENCE or spread is None or not within_noise(r.speedup_vs_fp32, spread):
        return f"{r.speedup_vs_fp32:.2f}x"
    return f"{r.speedup_vs_fp32:.2f}x within noise ({noise_words(spread)})"


def _f(v: Optional[float], fmt: str) -> str:
    return "—" if v is None else fmt.format(v)


def _mib(n: Optional[int]) -> str:
    return "—" if not n else f"{n / 2**20:,.1f} MiB"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(eq=False)
class _Run:
    """One precision's training in ``compare``: its steps, where it is in the data, what it measured."""

    steps: Steps
    losses: list[torch.Tensor] = field(
        default_factory=list
    )  # each optimizer step's mean loss (device)
    times: list[float] = field(default_factory=list)  # ms per optimizer step, one per timed block
    index: int = 0  # the next batch

    def train(self, batches: Callable[[int], Any], n: int, accumulation_steps: int) -> None:
        means, self.index = self.steps.run(batches, n, start=self.index, count=accumulation_steps)
        self.losses += means


def compare(
    model_factory: Callable[[], torch.nn.Module],
    batch_factory: Any,
    precisions: Optional[Sequence[str]] = None,
    *,
    steps: int = 30,
    warmup: int = 5,
    repeats: int = 5,
    device: Union[str, torch.device, None] = None,
    lr: float = 1e-3,
    accumulation_steps: int = 1,
    seed: int = 0,
    fallback: bool = False,
    model_name: str = "model",
    loss_window: int = 5,
    loss_fn: Optional[LossFn] = None,
    **amp_overrides: Any,
) -> BenchReport:
    """Train ``model_factory()`` once per precision on ``batch_factory``'s batches and measure each.

    ``batch_factory`` is what the Trainer takes: a function of the batch index, a DataLoader, a
    list, a function returning a fresh iterator (read in order, epoch after epoch, each batch kept
    for the other precisions: :class:`~ampkit.loop.batches.IndexedBatches`).
    The loss is ``loss_fn(model, batch)``, as the Trainer's (default: ``model(*batch)``, or
    ``model(**batch)`` for a dict, returns the scalar loss). Every precision starts from the same weights
    (``torch.manual_seed(seed)`` before each ``model_factory()`` call) and sees the same batches.
    After ``warmup`` steps, ``steps`` optimizer steps run in ``repeats`` blocks per precision,
    interleaved. A precision the device cannot run is listed as skipped with the reason. The
    batch factory may expose ``samples_per_batch`` / ``tokens_per_batch`` for throughput.
    """
    if steps < 1 or warmup < 0 or repeats < 1 or accumulation_steps < 1:
        raise ValueError(
            f"steps={steps} and repeats={repeats} must be >= 1, warmup={warmup} >= 0, "
            f"accumulation_steps={accumulation_steps} >= 1"
        )
    dev = normalize_device(device)
    info = device_info(dev)
    batch_factory = IndexedBatches.of(batch_factory)
    twice = named_twice(precisions or (), skip_invalid=True)  # (a bad name: its row says why)
    if twice is not None:
        raise ValueError(f"precisions: {twice}")
    wanted = list(dict.fromkeys(["fp32", *(precisions or DEFAULT_PRECISIONS)]))
    results: dict[str, BenchResult] = {}
    runs: dict[str, _Run] = {}
    for name in wanted:
        try:
            base, rung = split_spec(name)  # "bf16-pure:split": a rung of bf16-pure's ladder
            p = resolve_precision(base, info, emulate_fp8=bool(amp_overrides.get("fp8_emulate")))
        except (PrecisionError, ValueError) as e:
            results[name] = BenchResult(
                precision=name,
                status="skipped",
                reason=str(e).split(": ", 1)[-1].split(". Choose")[0],
            )
            continue
        label = join_spec(p.name, rung)
        if label in results:  # e.g. "auto" resolved to one already listed
            continue
        results[label], run = _start(
            p,
            model_factory,
            batch_factory,
            dev,
            seed,
            lr,
            accumulation_steps,
            fallback,
            {**amp_overrides, **(rung.fields() if rung else {})},
            loss_fn or batch_loss,
        )
        results[label].precision = label
        if run is not None:
            runs[label] = run
    for run in runs.values():
        run.train(batch_factory, warmup, accumulation_steps)
    _timed_blocks(runs, batch_factory, steps, min(repeats, steps), accumulation_steps, dev)
    for name, run in runs.items():
        _measurements(results[name], run, batch_factory, accumulation_steps, loss_window, dev)
    _relative_to_fp32(results)
    ref = runs.get("fp32")
    for name, run in runs.items():
        if ref is not None and run.times and len(run.times) == len(ref.times):
            results[name].speedup_spread = paired_ratio(ref.times, run.times)[1]
    return BenchReport(
        results=list(results.values()),
        device=str(dev),
        device_name=info.name,
        model=model_name,
        steps=steps,
        batch_size=getattr(batch_factory, "batch_size", None),
        accumulation_steps=accumulation_steps,
        threads=torch.get_num_threads(),
        repeats=min(repeats, steps),
    )


def _start(
    p: Precision,
    model_factory: Callable[[], torch.nn.Module],
    batch_factory: Callable[[int], Any],
    dev: torch.device,
    seed: int,
    lr: float,
    accumulation_steps: int,
    fallback: bool,
    amp_overrides: dict[str, Any],
    loss_fn: LossFn = batch_loss,
) -> tuple[BenchResult, Optional[_Run]]:
    """``p``'s result row and its run: the model from ``seed``, a fused AdamW, the engine set up;
    a skipped row (and no run) when the engine cannot apply ``p``."""
    torch.manual_seed(seed)
    model = model_factory().to(dev)
    fused = dev.type in ("cpu", "cuda") and all(q.is_floating_point() for q in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    try:
        amp = MixedPrecision(
            p.name,
            device=dev,
            accumulation_steps=accumulation_steps,
            fallback=fallback,
            **amp_overrides,
        )
        model, opt = amp.setup(model, opt)
    except (PrecisionError, ValueError) as e:
        return BenchResult(precision=p.name, status="skipped", reason=str(e)), None
    # activations() cannot follow torchao's fp8 casts yet: the column stays empty for fp8 (it raised
    # and lost the whole comparison on an H200, the first GPU where fp8 is not skipped)
    act = None
    if p.row.measures_activations:
        example = batch_factory(0)
        act = (
            activations(model, example, p)
            if loss_fn is batch_loss
            else activations(
                _Loss(model, loss_fn), (_cast(example, p) if p.is_pure else example,), p
            )
        ).total
    return BenchResult(precision=p.name, activation_bytes=act), _Run(
        Steps(model, opt, amp, loss_fn)
    )


def _cast(batch: Any, p: Precision) -> Any:
    """The batch's floating tensors in ``p``'s parameter dtype (what ``activations`` does to the
    inputs of a pure precision's model, here inside the batch the loss function takes)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(p.param_dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast(v, p) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast(v, p) for v in batch)
    return batch


class _Loss(torch.nn.Module):
    """``model`` whose forward of a batch is ``loss_fn(model, batch)``: what ``activations`` runs."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _timed_blocks(
    runs: dict[str, _Run],
    batches: Callable[[int], Any],
    steps: int,
    repeats: int,
    accumulation_steps: int,
    dev: torch.device,
) -> None:
    """``steps`` optimizer steps per run in ``repeats`` blocks, the runs' order rotating each round."""
    block = max(1, steps // repeats)
    names = list(runs)
    done = 0
    for r in range(repeats):
        n = block if r < repeats - 1 else steps - done
        done += n
        order = names[r % len(names) :] + names[: r % len(names)] if names else []
        for name in order:
            run = runs[name]
            _sync(dev)
            t0 = time.perf_counter()
            run.train(batches, n, accumulation_steps)
            _sync(dev)
            run.times.append((time.perf_counter() - t0) / n * 1e3)


def _measurements(
    res: BenchResult,
    run: _Run,
    batch_factory: Callable[[int], Any],
    accumulation_steps: int,
    loss_window: int,
    dev: torch.device,
) -> None:
    """Fill ``res`` from ``run``: step times, throughput, losses, engine counters, memory."""
    amp, model, times = run.steps.amp, run.steps.model, sorted(run.times)
    res.losses = [float(v) for v in torch.stack(run.losses).tolist()]
    res.step_ms = statistics.median(times)
    res.step_ms_p10, res.step_ms_p90 = times[len(times) // 10], times[(9 * len(times)) // 10]
    per_s = 1e3 / res.step_ms
    samples = getattr(batch_factory, "samples_per_batch", None)
    tokens = getattr(batch_factory, "tokens_per_batch", None)
    res.samples_per_s = samples * accumulation_steps * per_s if samples else None
    res.tokens_per_s = tokens * accumulation_steps * per_s if tokens else None
    tail = [v for v in res.losses[-loss_window:] if math.isfinite(v)]
    res.final_loss = statistics.mean(tail) if tail else math.nan
    stats = amp.stats()
    res.skipped_steps = stats["skipped_steps"]
    res.fallbacks = sum(1 for e in stats["events"] if e["kind"] == "fallback")
    res.final_precision = stats["precision"]
    # step() leaves gradients at None; during a step they take exactly the parameters' shape and dtype
    kept = breakdown(model, run.steps.optimizer, amp)
    resident = kept.total
    grads = sum(q.numel() * q.element_size() for q in model.parameters() if q.requires_grad)
    res.static_bytes = resident + grads
    # per parameter: weights, masters, states; the ladder's fixed scratch is in static_bytes only
    per_param = resident - kept.by_category["scratch"]
    res.bytes_per_param = per_param / max(1, sum(q.numel() for q in model.parameters()))
    if dev.type == "cuda":
        # The other precisions' models stay alive in this process: count only this run's
        # resident state plus what one of its steps allocates on top.
        _sync(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        run.train(batch_factory, 1, accumulation_steps)
        _sync(dev)
        res.peak_mem_bytes = int(torch.cuda.max_memory_allocated(dev) - base + resident)


def _relative_to_fp32(results: dict[str, BenchResult]) -> None:
    """Speed-up and final-loss gap of every measured precision against fp32 (when fp32 ran)."""
    ref = results.get("fp32")
    if ref is None or ref.status != "ok":
        return
    for res in results.values():
        if res.status != "ok":
            continue
        res.speedup_vs_fp32 = ref.step_ms / res.step_ms if res.step_ms else None
        if ref.final_loss and math.isfinite(ref.final_loss) and res.final_loss is not None:
            res.loss_gap = (res.final_loss - ref.final_loss) / abs(ref.final_loss)
