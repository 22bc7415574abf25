"""Argument checks of the disk medium's calls: raised before anything changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tierkv.errors import InvalidInputError, InvalidTypeError


def check_keys(key_bytes: int, keys: Sequence[bytes]) -> list[bytes]:
    """`keys` as a list; raises InvalidInputError unless each is `key_bytes` bytes."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise InvalidTypeError("keys must be a sequence of bytes keys, not one key")
    out = list(keys)
    for k in out:
        if not isinstance(k, bytes) or len(k) != key_bytes:
            raise InvalidInputError(f"a key must be {key_bytes} bytes, got {k!r:.60}")
    return out


def check_buffers(
    buffers: Sequence[Any], n: int, page_bytes: int, *, writable: bool
) -> list[memoryview]:
    """`n` buffers of `page_bytes` bytes as flat byte views (torch CPU tensors, numpy arrays,
    anything with the buffer protocol); raises InvalidInputError (InvalidTypeError for a
    non-buffer) for a wrong count, size, layout or a read-only buffer to read into."""
    bufs = list(buffers)
    if len(bufs) != n:
        raise InvalidInputError(f"{len(bufs)} buffers for {n} keys")
    out = []
    for b in bufs:
        if hasattr(b, "numpy") and hasattr(b, "is_contiguous"):  # a torch tensor
            if b.device.type != "cpu" or not b.is_contiguous():
                raise InvalidInputError("a buffer tensor must be contiguous, on the CPU")
            b = b.numpy()
        try:
            v = memoryview(b)
        except TypeError as exc:
            raise InvalidTypeError(f"a buffer must support the buffer protocol: {exc}") from exc
        if not v.c_contiguous:
            raise InvalidInputError("a buffer must be contiguous")
        v = v.cast("B") if v.format != "B" or v.ndim != 1 else v
        if v.nbytes != page_bytes:
            raise InvalidInputError(f"a buffer must hold {page_bytes} bytes, got {v.nbytes}")
        if writable and v.readonly:
            raise InvalidInputError("a read's buffer must be writable")
        out.append(v)
    return out
