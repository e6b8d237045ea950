"""Payload codec: JSON through orjson, with token and float arrays packed as little-endian binary.

A Tinker request is mostly long lists of token ids and per-token weights; as JSON number lists they are several
times larger and slower to parse than as packed arrays. ``encode`` replaces every list made only of ints (or only
of floats) with a reference into a binary tail; ``decode`` puts them back, exactly: ints as int64, floats as the
float64 they already were in Python.

Layout: ``MAGIC | u32 skeleton length | orjson skeleton | packed arrays``.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson

MAGIC = b"LFP1"
# A dict key no JSON payload of a client can carry (NUL is not allowed in Tinker identifiers).
REF = "\x00packed"
# Short lists are cheaper left as JSON.
MIN_PACKED_LEN = 8
_INT64 = np.dtype("<i8")
_FLOAT64 = np.dtype("<f8")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _pack_kind(values: list) -> str | None:
    """'i' or 'f' when the list is all ints (no bools) in int64 range, or all floats; else None."""
    if len(values) < MIN_PACKED_LEN:
        return None
    first = type(values[0])
    if first is int:
        if all(type(v) is int for v in values) and _INT64_MIN <= min(values) and max(values) <= _INT64_MAX:
            return "i"
    elif first is float and all(type(v) is float for v in values):
        return "f"
    return None


def encode(payload: Any) -> bytes:
    blobs: list[bytes] = []
    offset = 0

    def walk(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            kind = _pack_kind(value) if isinstance(value, list) else None
            if kind is None:
                return [walk(item) for item in value]
            blob = np.asarray(value, dtype=_INT64 if kind == "i" else _FLOAT64).tobytes()
            blobs.append(blob)
            ref = {REF: [kind, offset, len(value)]}
            offset += len(blob)
            return ref
        return value

    skeleton = orjson.dumps(walk(payload))
    return b"".join([MAGIC, struct.pack("<I", len(skeleton)), skeleton, *blobs])


def decode(data: bytes) -> Any:
    if data[:4] != MAGIC:
        raise ValueError("not a lilo payload (bad magic)")
    (length,) = struct.unpack_from("<I", data, 4)
    tail = memoryview(data)[8 + length:]

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            ref = value.get(REF)
            if ref is not None and len(value) == 1:
                kind, start, count = ref
                dtype = _INT64 if kind == "i" else _FLOAT64
                return np.frombuffer(tail, dtype=dtype, count=count, offset=start).tolist()
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value

    return walk(orjson.loads(data[8:8 + length]))
