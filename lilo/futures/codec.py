"""The canonical bytes of a request's payload, which its fingerprint hashes: JSON through orjson (sorted keys), with
token and float arrays packed as little-endian binary.

A Tinker request is mostly long lists of token ids and per-token weights; as JSON number lists they are several
times larger and slower to write than as packed arrays. ``encode`` replaces every list made only of ints (or only
of floats) with a reference into a binary tail, in the narrowest type that holds every value exactly (int32 or
int64; float32 when each value survives the trip, as 0/1 weights do, else float64), tagged with that type and its
length: two payloads that differ in a value, a type or a shape encode differently.

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
_DTYPES = {"i4": np.dtype("<i4"), "i8": np.dtype("<i8"), "f4": np.dtype("<f4"), "f8": np.dtype("<f8")}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _packed(values: list) -> tuple[str, bytes] | None:
    """(dtype code, bytes) for a flat list of numbers, in the narrowest exact type: integers (a boolean among them
    counts as 0 or 1) as int32 or int64, else floats as float32 or float64. Anything else stays JSON. The types are
    read by numpy in one pass, not per element in Python: this runs on every request's fingerprint."""
    if len(values) < MIN_PACKED_LEN:
        return None
    try:
        array = np.asarray(values)
    except (ValueError, OverflowError):  # ragged nesting, or an integer beyond 64 bits
        return None
    if array.ndim != 1 or array.dtype.kind not in "if":  # nested lists, all booleans, text, None: JSON
        return None
    if array.dtype.kind == "i":
        if _INT32_MIN <= array.min() and array.max() <= _INT32_MAX:
            return "i4", array.astype(_DTYPES["i4"]).tobytes()
        return "i8", array.astype(_DTYPES["i8"]).tobytes()
    wide = array.astype(_DTYPES["f8"])
    with np.errstate(over="ignore"):  # a value too large for float32 just fails the exactness check below
        narrow = wide.astype(_DTYPES["f4"])
    # Exact only where every value survives float32 (NaN never compares equal, so it stays float64).
    if np.array_equal(narrow.astype(_DTYPES["f8"]), wide):
        return "f4", narrow.tobytes()
    return "f8", wide.tobytes()


def _packed_array(array: np.ndarray) -> tuple[str, bytes] | None:
    """A 1-D numeric numpy array, kept in its own type (it decodes back as that type's numbers)."""
    code = {"int32": "i4", "int64": "i8", "float32": "f4", "float64": "f8"}.get(array.dtype.name)
    if code is None or array.ndim != 1:
        return None
    return code, np.ascontiguousarray(array, dtype=_DTYPES[code]).tobytes()


def encode(payload: Any) -> bytes:
    blobs: list[bytes] = []
    offset = 0

    def walk(value: Any) -> Any:
        nonlocal offset
        if isinstance(value, dict):
            # In key order, as the skeleton is written: the arrays' offsets in the tail must not depend on the
            # order the keys came in (a protobuf map's, or a client's JSON object's).
            return {key: walk(value[key]) for key in sorted(value)}
        if isinstance(value, np.ndarray):
            packed = _packed_array(value)
            if packed is None:
                return walk(value.tolist())
        elif isinstance(value, (list, tuple)):
            packed = _packed(value) if isinstance(value, list) else None
            if packed is None:
                return [walk(item) for item in value]
        else:
            return value
        code, blob = packed
        blobs.append(blob)
        ref = {REF: [code, offset, len(value)]}
        offset += len(blob)
        return ref

    # Sorted keys: the same payload always encodes to the same bytes, so fingerprints compare retries.
    skeleton = orjson.dumps(walk(payload), option=orjson.OPT_SORT_KEYS)
    return b"".join([MAGIC, struct.pack("<I", len(skeleton)), skeleton, *blobs])
