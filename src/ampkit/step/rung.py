"""A rung of bf16-pure's memory ladder: a typed value, parsed once, beside the precision.

A rung is what stands in for each weight's fp32 master (``masters``) and how the optimizer's
states are kept between steps (``state_dtype``). It is spelled one way everywhere -- the Python
API, ``--precision``/``--precisions``, TOML, the service, plan and bench rows -- after the
precision it belongs to::

    bf16-pure:split             masters='split', state_dtype='fp32'
    bf16-pure:stochastic+bf16   masters='stochastic', state_dtype='bf16'

The separate settings ``masters=``/``state_dtype=`` of :class:`~ampkit.step.config.MixedPrecisionConfig`
are the same value in two fields (:meth:`Rung.of`). What each rung does is in
:mod:`ampkit.step.policies.pure.ladder`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, get_args

from .precision import REGISTRY, PrecisionError, parse_precision

__all__ = [
    "LADDER",
    "MASTERS",
    "PLAIN",
    "STATE_DTYPES",
    "Rung",
    "RungError",
    "join_spec",
    "ladder_names",
    "ladder_specs",
    "named_twice",
    "spec_key",
    "spec_list",
    "split_spec",
]

Masters = Literal["fp32", "split", "kahan", "stochastic", "none"]
StateDtype = Literal["fp32", "bf16"]
#: what may stand in for an fp32 master, most memory first
MASTERS: tuple[str, ...] = get_args(Masters)
STATE_DTYPES: tuple[str, ...] = get_args(StateDtype)

# bytes per parameter of each master form, and the optimizer state slots per parameter
_MASTER_BYTES = {"fp32": 4, "split": 2, "kahan": 2, "stochastic": 0, "none": 0}
_WHAT = {
    "fp32": "fp32 copies in the optimizer",
    "split": "bf16 weight + int16 remainder (exact fp32)",
    "kahan": "bf16 weight + bf16 compensation",
    "stochastic": "none: updates rounded stochastically into bf16",
    "none": "none (updates below half a bf16 spacing round away)",
}
_STATE_SLOTS = {"adamw": 2, "adam": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1}
_FORM = "<masters>[+bf16]"


class RungError(PrecisionError):
    """An invalid rung, or a rung on a precision without the ladder (a ``ValueError``)."""


@dataclass(frozen=True)
class Rung:
    """``masters`` (fp32, split, kahan, stochastic, none) and ``state_dtype`` (fp32, bf16).

    ``str(rung)`` is its spelling after the precision's colon (``"split"``,
    ``"stochastic+bf16"``); :meth:`parse` reads it back. Validated on construction.
    """

    masters: Masters = "fp32"
    state_dtype: StateDtype = "fp32"

    def __post_init__(self) -> None:
        for name, value, valid in (
            ("masters", self.masters, MASTERS),
            ("state_dtype", self.state_dtype, STATE_DTYPES),
        ):
            if value not in valid:
                close = difflib.get_close_matches(str(value), valid, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise RungError(
                    f"invalid {name}={value!r}{hint}: must be one of: {', '.join(valid)}"
                )

    @classmethod
    def parse(cls, text: str, spec: Optional[str] = None) -> Rung:
        """``"split"``, ``"stochastic+bf16"`` -> the rung; anything else raises :class:`RungError`
        (naming ``spec``, the whole spelling it came in, when given)."""
        masters, plus, state_dtype = str(text).strip().lower().partition("+")
        if masters not in MASTERS or (plus and state_dtype != "bf16"):
            raise RungError(
                f"unknown ladder rung {spec or text!r}{_closest_rung(text, spec)}: write "
                f"{'|'.join(ladder_names())}:{_FORM} "
                f"with masters one of {', '.join(MASTERS)}, e.g. 'bf16-pure:split' or "
                "'bf16-pure:stochastic+bf16'"
            )
        return cls(masters, "bf16" if plus else "fp32")  # type: ignore[arg-type]

    @classmethod
    def of(cls, settings: Any) -> Rung:
        """The rung of anything with ``masters``/``state_dtype`` attributes (a config)."""
        return cls(getattr(settings, "masters", "fp32"), getattr(settings, "state_dtype", "fp32"))

    def __str__(self) -> str:
        return self.masters + ("+bf16" if self.state_dtype == "bf16" else "")

    @property
    def plain(self) -> bool:
        """fp32 masters and fp32 states: what every pure precision does without the ladder."""
        return self == PLAIN

    @property
    def stalls(self) -> bool:
        """``masters='none'``: no masters at all; small updates round away (refused unless forced)."""
        return self.masters == "none"

    @property
    def half_grads(self) -> bool:
        """Whether a one-micro-step window's gradients stay bf16 (stand-ins with no fp32 values:
        :mod:`ampkit.step.policies.pure.grads`); fp32 masters keep fp32 gradients."""
        return self.masters not in ("fp32", "none")

    @property
    def what(self) -> str:
        """What stands in for the fp32 master, in words (for ``describe()`` and the manifest)."""
        return _WHAT[self.masters]

    def describe(self, reason: str) -> str:
        """A precision's ``reason`` (e.g. "bfloat16 weights and compute; fp32 master weights") told
        for this rung: what stands in for the masters, and bf16 optimizer states (run headers)."""
        if self.plain:
            return reason
        what = f"masters: {self.what}" + (
            "; optimizer states in bf16" if self.state_dtype == "bf16" else ""
        )
        plain = "fp32 master weights"
        return reason.replace(plain, what) if plain in reason else f"{reason}; {what}"

    def fields(self) -> dict[str, Any]:
        """The config fields that spell this rung (``allow_stall`` only for the stalling one)."""
        out: dict[str, Any] = {"masters": self.masters, "state_dtype": self.state_dtype}
        return {**out, "allow_stall": True} if self.stalls else out

    def bytes_per_param(self, optimizer: str = "adamw") -> int:
        """Bytes per parameter between steps: the bf16 weight + the master's part + optimizer states.

        ``optimizer`` names the state slots per parameter (AdamW/Adam 2, SGD with momentum, Adagrad,
        RMSprop 1). ``masters='none'``: the optimizer steps the bf16 weights, so its states are bf16.
        """
        slots = _STATE_SLOTS.get(str(optimizer).lower())
        if slots is None:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; choose one of: {', '.join(_STATE_SLOTS)}"
            )
        state = 2 if self.state_dtype == "bf16" or self.stalls else 4
        return 2 + _MASTER_BYTES[self.masters] + slots * state


PLAIN = Rung()
#: the rungs bench and tune measure, most memory first (``masters='none'`` stalls: left out)
LADDER: tuple[Rung, ...] = (
    PLAIN,
    Rung("split"),
    Rung("kahan"),
    Rung("stochastic"),
    Rung("stochastic", "bf16"),
)


def _closest_rung(text: str, spec: Optional[str]) -> str:
    """`` (did you mean 'bf16-pure:split'?)`` for a mistyped rung (``splt``), or ``""``."""
    rungs = [str(Rung(m, d)) for m in MASTERS for d in STATE_DTYPES]  # type: ignore[arg-type]
    close = difflib.get_close_matches(str(text).strip().lower(), rungs, n=1, cutoff=0.6)
    if not close:
        return ""
    head = spec.rpartition(":")[0] if spec and ":" in spec else "bf16-pure"
    return f" (did you mean '{head}:{close[0]}'?)"


def ladder_names() -> list[str]:
    """The canonical names of the precisions that have the ladder (bf16-pure)."""
    return [n for n, row in REGISTRY.items() if row.has_ladder]


def ladder_specs() -> tuple[str, ...]:
    """Every rung of :data:`LADDER` on each precision with the ladder: ``"bf16-pure:fp32"``, ..."""
    return tuple(join_spec(n, r) for n in ladder_names() for r in LADDER)


def split_spec(spec: Any) -> tuple[Any, Optional[Rung]]:
    """``"bf16-pure:split"`` -> ``("bf16-pure", Rung("split"))``; a spec without a rung (or not a
    string: a dtype, a Precision) -> ``(spec, None)``. The precision part is canonicalised when a
    rung is given, and must have the ladder (``O2`` may: it resolves to a pure form); anything else
    raises :class:`RungError` naming the valid choice."""
    if not isinstance(spec, str) or ":" not in spec:
        return spec, None
    base, _, text = spec.partition(":")
    rung = Rung.parse(text, spec)
    name = parse_precision(base)
    if name != "o2" and not (name in REGISTRY and REGISTRY[name].has_ladder):
        ladders = ", ".join(ladder_names())
        raise RungError(
            f"{spec!r} names a memory-ladder rung, but {name} has no ladder; only {ladders} has a "
            f"memory ladder (write {ladders.split(', ')[0]}:{rung})"
        )
    return ("O2" if name == "o2" else name), rung


def spec_list(text: str) -> list[str]:
    """``"fp32,bf16,bf16-pure:split"`` (``--precisions``, a recommendation's ``precisions``): the
    names as typed, each checked as one precision (``PrecisionError``/``RungError``, with its "did you
    mean"). A precision named twice, in any spelling (``bf16,bfloat16``; ``bf16-pure,bf16-pure:fp32``),
    is a ``ValueError``: each
    row is one precision, measured or planned once."""
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names:
        raise ValueError(
            f"{text!r} names no precision; give a comma-separated list, e.g. fp32,bf16"
        )
    twice = named_twice(names)
    if twice is not None:
        raise ValueError(twice)
    return names


def named_twice(names: Sequence[Any], skip_invalid: bool = False) -> Optional[str]:
    """Why ``names`` name one precision twice in any spelling (``bf16,bfloat16``;
    ``bf16-pure,bf16-pure:fp32``), or None. A name that is no precision raises as :func:`spec_key`
    (``skip_invalid``: it is passed over, left to whoever reports it)."""
    seen: dict[str, Any] = {}
    for name in names:
        try:
            key = spec_key(name) if isinstance(name, str) else None
        except ValueError:
            if not skip_invalid:
                raise
            key = None
        if key is None:
            continue
        if key in seen:
            return f"{seen[key]!r} and {name!r} are one precision ({key}); name each precision once"
        seen[key] = name
    return None


def spec_key(name: str) -> str:
    """The one precision ``name`` is, whatever its spelling (``bfloat16`` -> ``bf16``; a ladder
    precision alone is its plain rung: ``bf16-pure:fp32`` -> ``bf16-pure``). Raises as
    :func:`split_spec` for a name that is no precision."""
    base, rung = split_spec(name)
    return join_spec(parse_precision(base), None if rung is None or rung.plain else rung)


def join_spec(precision: str, rung: Optional[Rung]) -> str:
    """The one spelling of ``precision`` on ``rung``: ``"bf16-pure:split"``; the name alone for no rung."""
    return precision if rung is None else f"{precision}:{rung}"
