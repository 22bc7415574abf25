"""The value format of `RedisTier`: one page per value, behind a 32-byte header.

::

    key   = "tkv:" namespace ":" FORMAT "." spec digest (8 hex) ":" page key (hex)
    value = header (32 bytes) | page bytes (spec.page_bytes)

    value header, little-endian (32 bytes)
     0  +---------+---------+---------+---------+
        |  magic b"TKVR"                        |
     4  +---------+---------+---------+---------+
        | format  | codec=0 | flags=1 | 0       |   u8 each (codec 0: raw pages;
     8  +---------+---------+---------+---------+              flags bit 0: page CRC below)
        |  spec digest (8 bytes, blake2b of the page layout)
    16  +---------------------------------------+
        |  payload bytes (u32)  | page CRC32C   |   the page's checksum (tierkv.page_sums)
    24  +---------------------------------------+
        |  XXH3-64 of the payload, seeded with XXH3-64(redis key | bytes 0..24)
    32  +---------------------------------------+  <- HEADER_BYTES, payload follows

The XXH3 checksum is seeded with the Redis key, so a value copied under another key fails too;
it vouches for the value as the publisher stored it. The page CRC-32C is the page's own, from
the publisher's page table (computed when the page's content became final), so a reader checks
the bytes end to end: a page that was already wrong in the publisher's memory fails too.
Format 1 (no page CRC) lived under other keys (the format is in the key): never read.
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
    "page_sum",
    "spec_digest",
    "value_header",
]

FORMAT = 2
CODEC_RAW = 0
FLAG_PAGE_SUM = 1
MAGIC = b"TKVR"
_HEAD = struct.Struct("<4sBBBB8sII")  # magic, format, codec, flags, 0, spec, payload, page sum
_PAGE_SUM = struct.Struct("<I")
_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _SUM.size
_SUM_AT = _HEAD.size
_PAGE_SUM_AT = _HEAD.size - _PAGE_SUM.size


def spec_digest(spec: KVSpec) -> bytes:
    """8 bytes naming a page layout: equal for specs whose pages are interchangeable."""
    doc = json.dumps(spec_fields(spec), sort_keys=True).encode()
    return hashlib.blake2b(doc, digest_size=8, person=b"tierkv-redis").digest()


def value_header(digest: bytes, page_bytes: int) -> bytes:
    """The first 20 bytes of every value of one layout (all but the page CRC-32C and the
    value checksum)."""
    return _HEAD.pack(MAGIC, FORMAT, CODEC_RAW, FLAG_PAGE_SUM, 0, digest, page_bytes, 0)[
        :_PAGE_SUM_AT
    ]


def page_sum(value: bytes) -> int:
    """The page CRC-32C in a value's header (of a value `check_value` accepted)."""
    return int(_PAGE_SUM.unpack_from(value, _PAGE_SUM_AT)[0])


def checksum(rkey: bytes, head: bytes, payload: Any) -> int:
    """XXH3-64 of ``payload`` seeded by the key and header. (~10x zlib's crc32 on one core:
    the check costs ~1% of a load.)"""
    return int(xxhash.xxh3_64_intdigest(payload, seed=xxhash.xxh3_64_intdigest(rkey + head)))


def encode_value(rkey: bytes, head: bytes, payload: Any, crc: int) -> bytes:
    """The value stored under ``rkey``: ``head`` (`value_header`), the page's CRC-32C
    ``crc``, the value checksum, the payload (a buffer)."""
    full = head + _PAGE_SUM.pack(crc)
    return full + _SUM.pack(checksum(rkey, full, payload)) + payload


def check_value(rkey: bytes, value: Any, head: bytes, page_bytes: int) -> str | None:
    """Why ``value`` (read from ``rkey``) is not a page of this layout, or None when it is:
    its length, header (magic, format, codec, layout) and checksum are all checked."""
    if not isinstance(value, bytes) or len(value) != HEADER_BYTES + page_bytes:
        size = len(value) if isinstance(value, bytes) else type(value).__name__
        return f"size {size}, want {HEADER_BYTES + page_bytes}"
    if not value.startswith(head):
        magic, fmt, codec, flags, _, digest, length, _ = _HEAD.unpack_from(value)
        want = _HEAD.unpack_from(head + bytes(_PAGE_SUM.size))[5]
        return (
            f"header magic={magic!r} format={fmt} codec={codec} flags={flags} "
            f"layout={digest.hex()} payload={length}, want format {FORMAT} layout {want.hex()}"
        )
    (want_sum,) = _SUM.unpack_from(value, _SUM_AT)
    if want_sum != checksum(rkey, value[:_SUM_AT], memoryview(value)[HEADER_BYTES:]):
        return "checksum mismatch"
    return None
