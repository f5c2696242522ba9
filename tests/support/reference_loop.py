"""The one hand-written torch.amp training loop that ampkit's step is checked against.

It is the loop users write today (PyTorch's AMP recipe, nanoGPT's ``train.py``): each micro-batch's
loss computed under ``torch.autocast``, divided by the accumulation steps, backpropagated through
``GradScaler.scale``; at the end of the window ``unscale_`` then ``clip_grad_norm_`` over
``model.parameters()``, ``scaler.step`` and ``scaler.update``, ``zero_grad(set_to_none=True)``.
Ported to ampkit (``MixedPrecision(precision, accumulation_steps=accum, clip_grad_norm=clip)``,
``amp.autocast()``, ``amp.backward(loss)``, ``amp.step(opt)``) it must give bitwise the same
parameters. Tests with a loop of another shape (timm's short last window) keep their own.
"""

import math

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def call_model(model, batch):
    """``model(*batch)``: the built-in models return their loss from ``(inputs, targets)``."""
    return model(*batch)


def torch_amp_loop(
    model,
    optimizer,
    batches,
    precision,
    *,
    steps,
    accum=1,
    clip=None,
    device="cpu",
    loss_fn=call_model,
    scaler_kwargs=None,
    skip_nonfinite=False,
    poison=(),
):
    """Train ``model`` for ``steps`` optimizer steps of ``accum`` micro-batches from ``batches`` (a list).

    ``skip_nonfinite``: in bf16/fp32 also skip a step whose gradient norm is non-finite (ampkit
    does; GradScaler only skips in fp16) -- needs ``clip``. ``poison``: ``(step, micro)`` pairs whose
    loss is multiplied by inf (an overflow on purpose). Returns ``(model, scaler, losses)``;
    ``losses`` holds each window's mean loss (fp32, detached).
    """
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16", **(scaler_kwargs or {}))
    losses = []
    for step in range(steps):
        total = None
        for micro in range(accum):
            with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model, batches[step * accum + micro])
            if (step, micro) in poison:
                loss = loss * math.inf
            total = loss.detach().float() if total is None else total + loss.detach().float()
            scaler.scale(loss / accum).backward()
        losses.append(total / accum)
        norm = None
        if clip is not None:
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if precision == "fp16" or not skip_nonfinite:
            scaler.step(optimizer)
            scaler.update()
        elif torch.isfinite(norm):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, scaler, losses
