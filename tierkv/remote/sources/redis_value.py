"""The value format of `RedisTier`: one page per value, behind a 32-byte header.

::

    key   = "tkv:" namespace ":" FORMAT "." spec digest (8 hex) ":" page key (hex)
    value = header (32 bytes) | page bytes (spec.page_bytes)

    value header, little-endian (32 bytes)
     0  +---------+---------+---------+---------+
        |  magic b"TKVR"                        |
     4  +---------+---------+---------+---------+
        | format  | codec=0 | flags=0 | 0       |   u8 each (codec 0: raw pages)
     8  +---------+---------+---------+---------+
        |  spec digest (8 bytes, blake2b of the page layout)
    16  +---------------------------------------+
        |  payload bytes (u32)  |  0 (u32)      |
    24  +---------------------------------------+
        |  XXH3-64 of the payload, seeded with XXH3-64(redis key | bytes 0..24)
    32  +---------------------------------------+  <- HEADER_BYTES, payload follows

The checksum is seeded with the Redis key, so a value copied under another key fails too.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import xxhash

from tierkv.remote.protocol.wire import spec_fields
from tierkv.spec import KVSpec

__all__ = [
    "FORMAT",
    "HEADER_BYTES",
    "check_value",
    "encode_value",
    "spec_digest",
    "value_header",
]

FORMAT = 1
CODEC_RAW = 0
MAGIC = b"TKVR"
_HEAD = struct.Struct("<4sBBBB8sII")  # magic, format, codec, flags, 0, spec, payload, 0
_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _SUM.size
_SUM_AT = _HEAD.size


def spec_digest(spec: KVSpec) -> bytes:
    """8 bytes naming a page layout: equal for specs whose pages are interchangeable."""
    doc = json.dumps(spec_fields(spec), sort_keys=True).encode()
    return hashlib.blake2b(doc, digest_size=8, person=b"tierkv-redis").digest()


def value_header(digest: bytes, page_bytes: int) -> bytes:
    """The first 24 bytes of every value of one layout (all but the checksum)."""
    return _HEAD.pack(MAGIC, FORMAT, CODEC_RAW, 0, 0, digest, page_bytes, 0)


def checksum(rkey: bytes, head: bytes, payload: Any) -> int:
    """XXH3-64 of ``payload`` seeded by the key and header. (~10x zlib's crc32 on one core:
    the check costs ~1% of a load.)"""
    return int(xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(rkey + head)))


def encode_value(rkey: bytes, head: bytes, payload: Any) -> bytes:
    """The value stored under ``rkey``: ``head``, the checksum, the payload (a buffer)."""
    return head + _SUM.pack(checksum(rkey, head, payload)) + payload


def check_value(rkey: bytes, value: Any, head: bytes, page_bytes: int) -> str | None:
    """Why ``value`` (read from ``rkey``) is not a page of this layout, or None when it is:
    its length, header (magic, format, codec, layout) and checksum are all checked."""
    if not isinstance(value, bytes) or len(value) != HEADER_BYTES + page_bytes:
        size = len(value) if isinstance(value, bytes) else type(value).__name__
        return f"size {size}, want {HEADER_BYTES + page_bytes}"
    if not value.startswith(head):
        magic, fmt, codec, _, _, digest, length, _ = _HEAD.unpack_from(value)
        want = _HEAD.unpack_from(head)[5]
        return (
            f"header magic={magic!r} format={fmt} codec={codec} layout={digest.hex()} "
            f"payload={length}, want layout {want.hex()}"
        )
    (want_sum,) = _SUM.unpack_from(value, _SUM_AT)
    if want_sum != checksum(rkey, head, memoryview(value)[HEADER_BYTES:]):
        return "checksum mismatch"
    return None
