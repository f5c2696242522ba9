"""Argument checks of the engine's verbs: they raise before anything is changed, saying the right usage."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .overrides import match_modules

__all__ = ["check_setup", "stepped_optimizers"]


def check_setup(
    model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], keep_fp32: Sequence[str]
) -> None:
    """What ``MixedPrecision.setup`` needs: a module, optimizers over its parameters, ``keep_fp32`` that matches."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"setup() expects a torch.nn.Module first, got {type(model).__name__}")
    if keep_fp32:
        match_modules(model, keep_fp32)  # raises for patterns that match nothing
    params = {id(p) for p in model.parameters()}
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"setup() argument {i + 2} must be a torch.optim.Optimizer, got {type(opt).__name__}"
            )
        foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in params)
        if foreign:
            raise ValueError(
                f"optimizer {i} ({type(opt).__name__}) holds {foreign} parameter(s) that are "
                "not in the model; build the optimizer from model.parameters()"
            )


def stepped_optimizers(
    given: Sequence[torch.optim.Optimizer], registered: list[torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    """The optimizers a ``step()`` call acts on: ``given``, or all registered ones; all must be set up."""
    if not given:
        if not registered:
            raise RuntimeError(
                "step() has no optimizer: pass it to setup(model, optimizer) or to step(optimizer)"
            )
        return registered
    for opt in given:  # (plain loops: this runs every step)
        for o in registered:
            if o is opt:
                break
        else:
            raise ValueError(
                f"step() got an optimizer ({type(opt).__name__}) that was not set up; "
                "pass it to amp.setup(model, optimizer) first"
            )
    return list(given)
