"""Read back what an offline W&B run wrote: its ``run-<id>.wandb`` file (LevelDB's log format of protobuf
records, as W&B's docs describe it), without a network or a W&B service."""

from __future__ import annotations

import glob
import json
import struct
from typing import Any

BLOCK = 32768
HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes) -> list[bytes]:
    out, pos, pending = [], HEADER, b""  # the file starts with a 7-byte ':W&B' header
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            out.append(pending + body)
        elif kind == 0 and length == 0:
            break
    return out


def history(run_dir: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the logged history rows, the run record's fields) of the offline run in ``run_dir``."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir}/run-*.wandb")
    with open(path, "rb") as f:
        data = f.read()
    rows, run = [], {}
    for raw in _records(data):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind == "run":
            run = {"run_id": record.run.run_id, "job_type": record.run.job_type, "project": record.run.project}
    return rows, run
