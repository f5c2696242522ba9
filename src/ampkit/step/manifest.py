"""The precision manifest: what dtype each parameter is stored, computed, reduced and stepped in.

``amp.manifest()`` answers "what precision is each thing actually in?" per parameter, grouped by
module, from the live tensors (never from what the precision's name promises):

=================  ===========================================================================
column             what it is
=================  ===========================================================================
storage            the parameter's own dtype (under FSDP2: the local shard's)
compute            the dtype its module's main op runs in: the autocast dtype for the modules
                   autocast casts (Linear, convolutions, RNNs, attention), float8 for torchao's
                   ``Float8Linear``, float32 for ``keep_fp32`` modules, else the dtype the
                   weight reaches the forward in (FSDP2: the policy's ``param_dtype``)
grad               the dtype backward produces the gradient in
accumulation       where gradients of an accumulation window are summed: the fp32 master's
                   gradient, FSDP2's ``reduce_dtype``, else the parameter's ``.grad``
reduce             the dtype gradients are averaged over ranks in (None: one process)
master             the dtype of the tensor the optimizer steps when it is not the parameter
                   (pure precisions' fp32 masters; FSDP2: the fp32 shards)
optimizer_state    the dtypes of the optimizer's state for it (``""``: not created yet, at the
                   first step; None: no optimizer steps it)
=================  ===========================================================================

plus the loss-scaling state. Building one reads host metadata only (dtypes, ids), no device data;
reading the scale value is the one exception (``read_scale=True``, a **sync**).
:mod:`ampkit.step.manifest_check` checks a manifest for silent downgrades.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["AUTOCAST_MODULES", "HALF", "Manifest", "ParamEntry", "build_manifest", "fsdp_policies"]

HALF = ("bfloat16", "float16")

#: module types whose main op autocast runs in its lower-precision dtype (torch's autocast op lists)
AUTOCAST_MODULES: tuple[type, ...] = (
    torch.nn.Linear,
    torch.nn.Bilinear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.ConvTranspose1d,
    torch.nn.ConvTranspose2d,
    torch.nn.ConvTranspose3d,
    torch.nn.MultiheadAttention,
    torch.nn.RNNBase,
)


def _dt(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class ParamEntry:
    """One parameter's row of the manifest (dtype names such as ``"bfloat16"``; see the module doc)."""

    name: str
    module: str
    module_type: str
    storage: str
    compute: str
    grad: str
    accumulation: str
    reduce: Optional[str]
    master: Optional[str]
    optimizer_state: Optional[str]
    trainable: bool = True
    kept_fp32: bool = False
    sharded: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamEntry:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class Manifest:
    """Every parameter's dtypes (model order) and the loss-scaling state; ``to_dict`` is JSON-safe."""

    precision: str
    parallel: str  # none / ddp / fsdp
    accumulation_steps: int
    loss_scaling: dict[str, Any]
    params: tuple[ParamEntry, ...] = field(default_factory=tuple)
    #: the memory-ladder rung when not the plain one (``"stochastic+bf16"``), for the header
    rung: Optional[str] = None

    def modules(self) -> dict[str, list[ParamEntry]]:
        """The entries grouped by module (qualified name; ``""`` is the model itself), in model order."""
        out: dict[str, list[ParamEntry]] = {}
        for e in self.params:
            out.setdefault(e.module, []).append(e)
        return out

    def entry(self, name: str) -> ParamEntry:
        """The entry of parameter ``name`` (raises ``KeyError`` listing a few valid names)."""
        for e in self.params:
            if e.name == name:
                return e
        raise KeyError(
            f"no parameter {name!r} in the manifest; parameters: "
            f"{', '.join(e.name for e in self.params[:8])}{' ...' if len(self.params) > 8 else ''}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "parallel": self.parallel,
            "accumulation_steps": self.accumulation_steps,
            "loss_scaling": dict(self.loss_scaling),
            "params": [asdict(e) for e in self.params],
            "rung": self.rung,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        return cls(
            d["precision"],
            d.get("parallel", "none"),
            int(d.get("accumulation_steps", 1)),
            dict(d.get("loss_scaling", {})),
            tuple(ParamEntry.from_dict(p) for p in d.get("params", [])),
            d.get("rung"),
        )

    def table(self, *, collapse: bool = True) -> str:
        """A plain-text table, one block per module; ``collapse`` merges a module's rows that agree."""
        cols = ("param", "storage", "compute", "grad", "accum", "reduce", "master", "opt state")
        rows: list[tuple[str, ...]] = []
        for module, entries in self.modules().items():
            rows.append(
                (f"{module or '(model)'}  [{entries[0].module_type}]",) + ("",) * (len(cols) - 1)
            )
            groups: dict[tuple[str, ...], list[str]] = {}
            for e in entries:
                key = _cells(e)
                short = e.name[len(module) + 1 :] if module else e.name
                if collapse:
                    groups.setdefault(key, []).append(short)
                else:
                    groups[(short,) + key] = [short]
            for key, names in groups.items():
                cells = key[1:] if not collapse else key
                rows.append(("  " + ", ".join(names),) + cells)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
        out = [line, "-" * len(line)]
        out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        ls = self.loss_scaling
        scale = f", scale {ls['scale']:g}" if ls.get("scale") is not None else ""
        out.append(
            f"loss scaling: {'dynamic' if ls.get('dynamic') else 'constant'}{scale}"
            if ls.get("enabled")
            else "loss scaling: none"
            + (" (non-finite steps skipped)" if ls.get("skips_nonfinite") else "")
        )
        out.append(
            f"precision {self.precision}{':' + self.rung if self.rung else ''}, "
            f"parallel {self.parallel}, "
            f"accumulation_steps {self.accumulation_steps}"
        )
        return "\n".join(out)


def _cells(e: ParamEntry) -> tuple[str, ...]:
    state = "-" if e.optimizer_state is None else (e.optimizer_state or "(first step)")
    compute = e.compute + (" (keep_fp32)" if e.kept_fp32 else "")
    return (e.storage, compute, e.grad, e.accumulation, e.reduce or "-", e.master or "-", state)


def fsdp_policies(model: torch.nn.Module) -> dict[int, Any]:
    """``id(sharded parameter) -> MixedPrecisionPolicy`` for every FSDP2-managed parameter (empty when
    ``torch.distributed.fsdp`` was never imported: then ``fully_shard`` cannot have been applied)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return {}
    from torch.distributed.fsdp import FSDPModule

    out: dict[int, Any] = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # torch keeps each parameter's policy on its FSDPParam (no public reader; see
            # ampkit.step.parallel.fsdp.FSDPParallel.retarget, which writes the same attributes).
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    out[id(fp.sharded_param)] = fp.mp_policy
    return out


def build_manifest(amp: Any, *, read_scale: bool = False) -> Manifest:
    """The manifest of ``amp`` (a set-up :class:`~ampkit.MixedPrecision`). Host metadata only;
    ``read_scale=True`` also reads the loss scale's value (**syncs**)."""
    model = amp.model
    if model is None:
        raise RuntimeError(
            "manifest() called before setup(); call model, optimizer = amp.setup(model, optimizer) first"
        )
    precision, policy = amp.precision, amp.policy
    ddp = isinstance(model, DistributedDataParallel)
    inner = model.module if ddp else model
    policies = fsdp_policies(inner)
    parallel = "fsdp" if policies else ("ddp" if ddp else "none")
    kept = tuple(
        n[len("module.") :] if ddp and n.startswith("module.") else n
        for n in amp.overridden_modules
    )
    stepped_by: dict[int, Any] = {}
    for opt in amp.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                stepped_by[id(p)] = opt
    modules = dict(inner.named_modules())
    entries = []
    for name, p in inner.named_parameters():
        mod_name = name.rpartition(".")[0]
        module = modules.get(mod_name, inner)
        entries.append(
            _entry(
                name,
                mod_name,
                module,
                p,
                precision,
                policy,
                policies.get(id(p)),
                _is_kept(mod_name, kept),
                stepped_by,
                parallel,
            )
        )
    scaler = amp.scaler
    scaling = {
        "enabled": precision.needs_scaler,
        "dynamic": precision.needs_scaler and amp.config.dynamic_scaling,
        "skips_nonfinite": scaler.is_enabled(),
        "scale": scaler.get_scale() if read_scale and precision.needs_scaler else None,
    }
    rung = amp.config.rung
    return Manifest(
        precision.name,
        parallel,
        amp.config.accumulation_steps,
        scaling,
        tuple(entries),
        None if rung.plain or not precision.row.has_ladder else str(rung),
    )


def _is_kept(module: str, kept: tuple[str, ...]) -> bool:
    return any(module == k or module.startswith(k + ".") for k in kept)


def _entry(
    name: str,
    mod_name: str,
    module: torch.nn.Module,
    p: torch.Tensor,
    precision: Any,
    policy: Any,
    mp: Any,
    kept: bool,
    stepped_by: dict[int, Any],
    parallel: str,
) -> ParamEntry:
    storage = p.dtype
    gathered = (mp.param_dtype or storage) if mp is not None else storage
    forward_casts = (
        precision.autocast_enabled or precision.family == "pure"
    )  # pure forms autocast too
    if kept and p.is_floating_point():
        compute = torch.float32
    elif type(module).__name__ == "Float8Linear" and name.endswith("weight"):
        compute = None  # torchao's fp8 matmul
    elif forward_casts and isinstance(module, AUTOCAST_MODULES) and p.is_floating_point():
        compute = precision.compute_dtype
    else:
        compute = gathered
    stepped = policy.stepped(p)
    has_master = stepped is not p
    # the ladder's stand-ins are fp32 (bf16 only while they hold a kept bf16 gradient: .pure.grads)
    stepped_dtype = torch.float32 if has_master and policy.before_step else stepped.dtype
    if mp is not None:
        reduce = accumulation = mp.reduce_dtype or gathered
        master = _dt(storage) if precision.family == "pure" else None  # the shards are the masters
    else:
        accumulation = stepped_dtype if has_master else storage
        reduce = None if parallel == "none" else (stepped_dtype if has_master else storage)
        master = _dt(stepped_dtype) if has_master else None
    opt = stepped_by.get(id(stepped))
    state: Optional[str] = None
    if opt is not None:
        st = opt.state.get(stepped, {})
        state = ",".join(
            sorted(
                {
                    _dt(v.dtype) or ""
                    for k, v in st.items()
                    if isinstance(v, torch.Tensor) and k != "step" and v.dim() > 0
                }
            )
        )
    return ParamEntry(
        name=name,
        module=mod_name,
        module_type=type(module).__name__,
        storage=_dt(storage) or "",
        compute=_dt(compute) or "float8",
        grad=_dt(gathered) or "",
        accumulation=_dt(accumulation) or "",
        reduce=_dt(reduce),
        master=master,
        optimizer_state=state,
        trainable=p.requires_grad,
        kept_fp32=kept,
        sharded=mp is not None,
    )
