"""Checking the precision manifest for silent downgrades, at setup, every N steps and on resume.

A *violation* is a parameter whose precision is lower than the training precision promises, and
that nothing would report otherwise (the run goes on, it just learns less):

================  =====================================================================================
component         when
================  =====================================================================================
master            a trainable half-precision parameter with no fp32 master: updates smaller than half
                  its spacing round away (a bf16 weight at 1.0 ignores AdamW steps below 2**-8)
accumulation      ``accumulation_steps > 1`` and the window's gradients are summed in half precision
storage           a parameter's dtype changed after setup (e.g. a norm weight cast to bf16), or
                  differs from the dtype the checkpoint was saved with
optimizer_state   the optimizer state's dtype differs from the checkpoint's (after a resume)
compute           FSDP2's ``param_dtype`` equals the stored dtype of a pure precision or of a half
                  shard: the all-gather "cast" does nothing
================  =====================================================================================

What the configuration itself asked for is no violation: bf16-pure's bottom rung (``masters='none'``,
refused unless forced with ``allow_stall``, and warned about at setup) has no master and sums gradients
in bf16 by definition. The other rungs keep their optimizer states' dtype across a resume
(:mod:`~ampkit.step.policies.pure.ladder`), so a bitwise-equal resume reports nothing.

The engine records each as a ``manifest_violation`` event (``param``, ``component``, ``expected``,
``found``, ``detail``, ``when``: ``setup`` / ``step`` / ``resume``), once per parameter and
component. Checks read dtypes only (host metadata): no device sync, and none on the steps between
checks (``manifest_check_every``).

A pure precision on a model sharded by ``fully_shard`` *without* the matching
``MixedPrecisionPolicy`` would train with fp32 weights and fp32 compute while claiming bf16: at
setup the policy is applied (no policy given) or the setup refused with the fix (another one
given); :func:`refuse_unsafe_sharding`.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from .manifest import HALF, Manifest, ParamEntry, build_manifest, fsdp_policies
from .precision import REGISTRY

__all__ = [
    "Manifest",
    "ManifestWatch",
    "Violation",
    "build_manifest",
    "declared_components",
    "find_violations",
    "refuse_unsafe_sharding",
]


@dataclass(frozen=True)
class Violation:
    """A silent downgrade of one parameter's ``component`` (module doc)."""

    param: str
    component: str
    expected: str
    found: str
    detail: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def find_violations(
    manifest: Manifest,
    *,
    baseline: Optional[dict[str, str]] = None,
    saved: Optional[Manifest] = None,
    declared: Collection[str] = (),
) -> list[Violation]:
    """The violations in ``manifest`` (model order). ``baseline``: each parameter's storage dtype at
    setup; ``saved``: the manifest saved with the checkpoint being resumed; ``declared``: components
    the configuration itself chose and announced (:func:`declared_components`), not reported."""
    found = _violations(manifest, baseline, saved)
    return [v for v in found if v.component not in declared]


def declared_components(precision: str, config: Any) -> tuple[str, ...]:
    """Components whose half precision the configuration asked for: bf16-pure's bottom rung
    (``masters='none'``, forced with ``allow_stall`` and warned about at setup) keeps no master and
    sums gradients in bf16 -- what it promises, so no silent downgrade. ``masters='stochastic'``
    under FSDP2 stores the shards in bf16 on purpose, so their all-gather casts nothing (the
    ``compute`` finding is only ever about sharded parameters)."""
    ladder = precision in REGISTRY and REGISTRY[precision].has_ladder
    if ladder and getattr(config, "masters", "fp32") == "none":
        return ("master", "accumulation")
    if ladder and getattr(config, "masters", "fp32") == "stochastic":
        return ("compute",)
    return ()


def _violations(
    manifest: Manifest, baseline: Optional[dict[str, str]], saved: Optional[Manifest]
) -> list[Violation]:
    out: list[Violation] = []
    before = {e.name: e for e in saved.params} if saved is not None else {}
    pure = manifest.precision in REGISTRY and REGISTRY[manifest.precision].keeps_masters
    for e in manifest.params:
        optimized = e.trainable and e.optimizer_state is not None
        if optimized and e.storage in HALF and e.master is None:
            out.append(
                Violation(
                    e.name,
                    "master",
                    "float32 master",
                    "none",
                    f"{e.storage} parameter with no fp32 master: updates smaller than half its spacing "
                    "round away (norm weights freeze); train in the pure precision (fp32 masters), "
                    "keep this module in fp32 (keep_fp32) or leave the model in fp32",
                )
            )
        if optimized and manifest.accumulation_steps > 1 and e.accumulation in HALF:
            out.append(
                Violation(
                    e.name,
                    "accumulation",
                    "float32",
                    e.accumulation,
                    f"gradients of {manifest.accumulation_steps} micro-steps are summed in "
                    f"{e.accumulation}: each addition rounds to 8 (bf16) or 11 (fp16) bits",
                )
            )
        if e.sharded and (pure or e.storage in HALF) and e.compute == e.storage and not e.kept_fp32:
            out.append(
                Violation(
                    e.name,
                    "compute",
                    "a half param_dtype",
                    e.compute,
                    f"FSDP2 param_dtype equals the stored dtype {e.storage}: the all-gather casts "
                    "nothing; shard with ampkit.distributed.shard(model, precision)",
                )
            )
        if baseline is not None and e.name in baseline and baseline[e.name] != e.storage:
            out.append(
                Violation(
                    e.name,
                    "storage",
                    baseline[e.name],
                    e.storage,
                    f"cast from {baseline[e.name]} to {e.storage} after setup; the precision's "
                    "policy did not do it (cast the model before amp.setup, or not at all)",
                )
            )
        old = before.get(e.name)
        if old is not None:
            out += _resume_diff(old, e)
    return out


def _resume_diff(old: ParamEntry, new: ParamEntry) -> list[Violation]:
    out = []
    if old.storage != new.storage and old.master == new.master:
        out.append(
            Violation(
                new.name,
                "storage",
                old.storage,
                new.storage,
                f"saved as {old.storage}, resumed as {new.storage}",
            )
        )
    if old.optimizer_state and new.optimizer_state and old.optimizer_state != new.optimizer_state:
        out.append(
            Violation(
                new.name,
                "optimizer_state",
                old.optimizer_state,
                new.optimizer_state,
                f"optimizer state saved in {old.optimizer_state}, resumed in {new.optimizer_state} "
                "(torch casts loaded state to the stepped tensor's dtype: was the model cast, or "
                "the master weights lost?)",
            )
        )
    elif old.master and not new.master and new.optimizer_state is not None:
        out.append(
            Violation(
                new.name, "master", old.master, "none", "saved with an fp32 master, resumed without"
            )
        )
    return out


def refuse_unsafe_sharding(model: torch.nn.Module, precision: Any) -> None:
    """A pure ``precision`` on a model sharded by ``fully_shard`` without its ``MixedPrecisionPolicy``.

    Left alone it would all-gather and compute in fp32 (the shards' dtype) while claiming bf16. A
    model sharded with no policy at all (``param_dtype`` None) gets the precision's policy applied,
    with a warning naming the explicit spelling; a policy with another ``param_dtype`` (the user
    chose one) is refused with a ``ValueError`` naming the fix. Otherwise nothing happens.
    """
    if precision.family != "pure":
        return
    policies = fsdp_policies(model)
    wrong = {
        str(p.param_dtype) for p in policies.values() if p.param_dtype != precision.param_dtype
    }
    if not wrong:
        return
    half = str(precision.param_dtype).replace("torch.", "")
    fix = (
        f"shard it with ampkit.distributed.shard(model, {precision.name!r}) instead of fully_shard, or pass "
        f"fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.{half}, reduce_dtype=torch.{half})) "
        f"(= ampkit.distributed.fsdp_policy({precision.name!r})) to every fully_shard call"
    )
    if wrong != {"None"}:
        raise ValueError(
            f"precision {precision.name!r} on a model sharded with fully_shard whose "
            f"MixedPrecisionPolicy has param_dtype {', '.join(sorted(wrong))}: it would all-gather "
            f"and compute in that dtype while claiming {half}. To train in {precision.name}, {fix}; "
            "or train in 'bf16' (autocast over the fp32 shards)"
        )
    from .parallel.fsdp import FSDPParallel

    adapter = FSDPParallel.of(model)
    assert adapter is not None  # (fsdp_policies found FSDP modules)
    adapter.retarget(precision)
    warnings.warn(
        f"precision {precision.name!r} on a model sharded with fully_shard without a "
        f"MixedPrecisionPolicy: it would all-gather and compute in fp32; ampkit applied "
        f"{precision.name}'s policy (param_dtype={half}, reduce_dtype={half}). To say so "
        f"yourself, {fix}",
        UserWarning,
        stacklevel=4,
    )


class ManifestWatch:
    """The engine's checker: the setup baseline, the periodic check, the resume diff (module doc).

    ``setup(amp)`` at the end of ``amp.setup``; ``after_step(amp)`` after every optimizer step
    (checks every ``config.manifest_check_every`` steps and on the first step after a resume);
    ``saved(amp)`` goes into ``amp.state_dict()``; ``resumed(amp, saved)`` from ``load_state_dict``.
    """

    def __init__(self) -> None:
        self._baseline: Optional[dict[str, str]] = None
        self._precision: Optional[str] = None
        self._pending: Optional[Manifest] = (
            None  # a resumed checkpoint's manifest, not yet compared
        )
        self._reported: set[tuple[str, str, str]] = set()

    def setup(self, amp: Any) -> None:
        refuse_unsafe_sharding(amp.model, amp.precision)
        self._baseline = None
        self.check(amp, "setup")

    def after_step(self, amp: Any) -> None:
        every = amp.config.manifest_check_every
        if self._pending is not None or (every and amp.optimizer_steps % every == 0):
            self.check(amp, "step")

    def saved(self, amp: Any) -> Optional[dict[str, Any]]:
        """The manifest to keep in the engine's state (None before setup)."""
        return build_manifest(amp).to_dict() if amp.model is not None else None

    def resumed(self, amp: Any, saved: Optional[dict[str, Any]]) -> None:
        if not saved or amp.model is None:
            return
        self._pending = Manifest.from_dict(saved)
        self.check(amp, "resume")

    def check(self, amp: Any, when: str) -> list[Violation]:
        """Build the manifest, record a ``manifest_violation`` event per new violation; returns them all."""
        manifest = build_manifest(amp)
        if (
            self._baseline is None or self._precision != amp.precision.name
        ):  # setup, or after a switch
            self._baseline = {e.name: e.storage for e in manifest.params}
            self._precision = amp.precision.name
        found = find_violations(
            manifest,
            baseline=self._baseline,
            saved=self._pending,
            declared=declared_components(amp.precision.name, amp.config),
        )
        if self._pending is not None and (
            when == "step"
            or all(e.optimizer_state for e in manifest.params if e.optimizer_state is not None)
        ):
            self._pending = None  # compared with live optimizer state (or after the first step)
        for v in found:
            key = (v.param, v.component, v.found)
            if key not in self._reported:
                self._reported.add(key)
                amp.record_event("manifest_violation", **v.to_dict(), when=when)
        return found
