"""Read back the records of an offline W&B run file (``run-<id>.wandb``), the way W&B's sync would.

The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type) that join
into protobuf ``Record`` messages. W&B's writer may still be appending while a test reads: a chunk cut short or
failing its checksum is the tail it has not finished, so reading stops there and leaves out the record it began.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list:
    data = path.read_bytes()
    records, partial, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < HEADER:
            pos += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if length == 0 and kind == 0:
            pos += left_in_block
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        if len(chunk) < length or crc != zlib.crc32(chunk, zlib.crc32(bytes([kind]))):
            break  # the writer's unfinished tail
        pos += HEADER + length
        if kind == FULL:
            records.append(chunk)
        elif kind == FIRST:
            partial = chunk
        elif kind == MIDDLE:
            partial += chunk
        elif kind == LAST:
            records.append(partial + chunk)
    parsed = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def history_rows(path: Path) -> list[dict[str, str]]:
    return [
        {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
        for record in read_records(path) if record.WhichOneof("record_type") == "history"
    ]


def metric_definitions(path: Path) -> list:
    return [record.metric for record in read_records(path) if record.WhichOneof("record_type") == "metric"]


def has_exit_record(path: Path) -> bool:
    """Whether the run's writer has finished the file (its exit record is written last)."""
    return any(record.WhichOneof("record_type") == "exit" for record in read_records(path))
