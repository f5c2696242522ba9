"""``ampkit train --save_model DIR``: the trained weights in fp32, written atomically.

A Hugging Face model is saved with ``save_pretrained`` (``AutoModelForCausalLM.from_pretrained(DIR)``
loads it); any other model as ``DIR/model.pt``, its fp32 state dict (``torch.load(...,
weights_only=True)``), beside ``DIR/ampkit.json`` (model, size, precision, steps). For pure half
precisions the fp32 master weights are what is saved. The directory is written as
``DIR.partial`` and renamed, so a crash never leaves a half-written model under ``DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

from ..step.engine import MixedPrecision

__all__ = ["save_model"]


def save_model(
    model: torch.nn.Module, amp: MixedPrecision, directory: str, meta: dict[str, Any]
) -> str:
    from .hf_configs import CausalLM

    directory = os.path.abspath(directory)
    tmp = directory + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    state = {
        k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
        for k, v in amp.full_precision_state_dict().items()
    }
    if isinstance(model, CausalLM):
        model.hf.save_pretrained(
            tmp, state_dict={k[len("hf.") :]: v for k, v in state.items() if k.startswith("hf.")}
        )
        cfg_path = os.path.join(
            tmp, "config.json"
        )  # save_pretrained records the live (training) dtype;
        with open(cfg_path, encoding="utf-8") as f:  # the weights written are fp32
            cfg = json.load(f)
        cfg.update({k: "float32" for k in ("dtype", "torch_dtype") if k in cfg})
        with open(cfg_path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2)
        kind = "huggingface"
    else:
        torch.save(state, os.path.join(tmp, "model.pt"))
        kind = "state_dict"
    with open(os.path.join(tmp, "ampkit.json"), "w", encoding="utf-8") as f:
        json.dump({**meta, "format": kind}, f, indent=2)
    old = directory + ".old"
    if os.path.exists(directory):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory
