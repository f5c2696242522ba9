"""``ampkit export SHARDED_DIR OUT.pt``: a sharded (DCP) checkpoint as one file, in one process."""

from __future__ import annotations

from typing import Any

from .invocation import Invocation


def cmd_export(inv: Invocation) -> int:
    args = inv.args
    import os

    from ..loop.checkpoint import export_single_file

    path = export_single_file(args.source, args.out)
    print(
        f"wrote {path} ({os.path.getsize(path) / 2**20:.1f} MiB): loads with torch.load(weights_only=True); "
        "resume a single-process run from it by putting it in a --checkpoint_dir"
    )
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export", help="turn a sharded checkpoint directory (multi-process run) into one file"
    )
    p.add_argument("source", help="a sharded checkpoint directory (e.g. CKPT_DIR/ckpt-00000100)")
    p.add_argument(
        "out", help="the single checkpoint file to write (atomically), e.g. ckpt-00000100.pt"
    )
    p.set_defaults(func=cmd_export)
