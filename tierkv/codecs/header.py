"""The fixed 32-byte header that starts every encoded page.

An encoded page is self-contained: its header names the codec and the page geometry, its
scales (if any) follow, then the payload, then zero padding to a multiple of 128 bytes::

    encoded page (E = codec.encoded_bytes(spec) bytes, E % 128 == 0)
    offset
     0  +---------+---------+---------+---------+
        |  magic b"TKVC"                        |
     4  +---------+---------+---------+---------+
        | version | codec id| dtype   | flags=0 |   u8 each
     8  +---------+---------+---------+---------+
        |  H  = num_kv_heads            (u32 LE)|
    12  |  T  = page_tokens             (u32 LE)|
    16  |  D  = head_dim                (u32 LE)|
    20  |  G  = group size, 0 if none   (u32 LE)|
    24  |  E  = encoded bytes           (u32 LE)|
    28  |  reserved, 0                  (u32 LE)|
    32  +---------------------------------------+  <- HEADER_BYTES
        |  scales, fp32 LE (int8 codecs only)   |  scale_bytes(spec)
        +---------------------------------------+  <- 32 + scale_bytes
        |  payload (codec-specific element type)|  payload_bytes(spec)
        +---------------------------------------+
        |  zero padding                         |
        +---------------------------------------+  <- E

The header holds no checksum: a bit flip in the scales or payload is not detected here
(the transports verify bytes in flight). Everything in the header is checked on decode.
"""

from __future__ import annotations

import struct

import torch

from tierkv.spec import KVSpec

HEADER_BYTES = 32
MAGIC = b"TKVC"
VERSION = 1
_FMT = "<4sBBBBIIIIII"  # magic, version, codec, dtype, flags, H, T, D, G, E, reserved
assert struct.calcsize(_FMT) == HEADER_BYTES

DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float8_e4m3fn: 4,
}
_CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}


def pack_header(codec_id: int, spec: KVSpec, group_size: int, encoded_bytes: int) -> torch.Tensor:
    """The header bytes of one encoded page as a ``[32]`` uint8 tensor."""
    raw = struct.pack(
        _FMT,
        MAGIC,
        VERSION,
        codec_id,
        DTYPE_CODES[spec.dtype],
        0,
        spec.num_kv_heads,
        spec.page_tokens,
        spec.head_dim,
        group_size,
        encoded_bytes,
        0,
    )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def unpack_header(row: torch.Tensor) -> dict[str, object]:
    """Parse the first 32 bytes of ``row`` (uint8) into named fields; no checking."""
    raw = bytes(row[:HEADER_BYTES].contiguous().tolist())
    magic, version, codec, dtype, flags, h, t, d, g, e, _ = struct.unpack(_FMT, raw)
    return {
        "magic": magic,
        "version": version,
        "codec_id": codec,
        "dtype": _CODE_DTYPES.get(dtype, f"code {dtype}"),
        "flags": flags,
        "num_kv_heads": h,
        "page_tokens": t,
        "head_dim": d,
        "group_size": g,
        "encoded_bytes": e,
    }


def describe_mismatch(row: torch.Tensor, expected: torch.Tensor) -> str:
    """Say which header fields of ``row`` differ from ``expected`` (for error messages)."""
    got, want = unpack_header(row), unpack_header(expected)
    diffs = [f"{k}={got[k]!r} (expected {want[k]!r})" for k in want if got[k] != want[k]]
    return ", ".join(diffs) or "reserved bytes are not zero"
