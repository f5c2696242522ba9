"""Read a W&B offline run file (``run-*.wandb``): the history rows and the last summary.

The file is W&B's record log (LevelDB's log format): a 7-byte header, then 32 KiB blocks of
chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)
holding one protobuf ``Record``. wandb 0.31 ships no reader, so the test carries this one.
"""

import glob
import json
import os
import struct
import time

BLOCK = 32768


def _payloads(data):
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left  # block trailer padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_run(run_dir):
    """``(history, summary)`` of the one offline run under ``run_dir`` (a ``wandb`` dir's parent)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    records, deadline = [], time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        # run.finish() can return before W&B's writer process has written the end of the file
        assert time.monotonic() < deadline, f"{path} has no exit record"
        time.sleep(0.2 if records else 0)
        with open(path, "rb") as f:
            data = f.read()
        assert data[:4] == b":W&B", path
        records = []
        for payload in _payloads(data):
            rec = pb.Record()
            rec.ParseFromString(payload)
            records.append(rec)
    history, summary = [], {}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            history.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in rec.history.item
                }
            )
        elif kind == "summary":
            for item in rec.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return history, summary
