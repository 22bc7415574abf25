"""vLLM offload keys -> tierkv content keys, with the model and the KV layout in the key.

A vLLM `OffloadKey` is a block hash plus a group index; the same bytes could name a block of
another model, another dtype, another parallel layout or another chunking. `layout_digest`
hashes everything of vLLM's offloading config that changes a chunk's bytes (the FileMapper's
fields, and the chunk size), and `PageKeys` hashes that digest with each offload key
(BLAKE2b, stable across processes and machines: never Python's ``hash()``). The top bit of the
first byte is cleared: a tierkv *content* key, which the disk medium keeps across restarts.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tierkv.errors import InvalidInputError, InvalidTypeError

__all__ = [
    "KEY_BYTES",
    "MAX_OFFLOAD_KEY",
    "PageKeys",
    "check_key",
    "layout_digest",
    "layout_fields",
]

KEY_BYTES = 16
MAX_OFFLOAD_KEY = 1024
"""Longest offload key taken, bytes (vLLM's: a block hash, 32 bytes with sha256, plus 4)."""
_PERSON = b"tierkv-vllm-v1"


def layout_fields(offloading_spec: Any, chunk_bytes: int) -> dict[str, Any]:
    """What of vLLM's `OffloadingSpec` decides a chunk's bytes (JSON-able)."""
    config = offloading_spec.config
    parallel = config.parallel
    return {
        "model": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names), g.group_id] for g in config.groups],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "parallel": [parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "replicated_layout": bool(config.replicated_layout),
        "canonical_layout": bool(config.canonical_layout),
        "kv_cache_layout": config.kv_cache_layout,
        "chunk_bytes": chunk_bytes,
    }


def layout_digest(fields: dict[str, Any]) -> bytes:
    """A 32-byte digest of `layout_fields` (canonical JSON, SHA-256)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).digest()


def check_key(offload_key: Any) -> bytes:
    """``offload_key`` as bytes. Raises InvalidTypeError unless it is bytes-like (an int was
    ``bytes(n)``: n zero bytes, the key of another chunk, and a large one an allocation of
    that size; a str or None was a silent miss), InvalidInputError when empty or over
    `MAX_OFFLOAD_KEY` bytes."""
    if not isinstance(offload_key, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(
            f"an offload key must be bytes (vLLM's OffloadKey), got {type(offload_key).__name__}"
        )
    raw = bytes(offload_key)
    if not 0 < len(raw) <= MAX_OFFLOAD_KEY:
        raise InvalidInputError(
            f"an offload key must be 1 to {MAX_OFFLOAD_KEY} bytes, got {len(raw)}"
        )
    return raw


class PageKeys:
    """Maps offload keys of one model and layout to 16-byte tierkv content keys."""

    def __init__(self, digest: bytes) -> None:
        self.digest = digest

    def __call__(self, offload_key: bytes) -> bytes:
        """The tierkv content key of one vLLM offload key (`check_key`'s errors)."""
        raw = check_key(offload_key)
        h = hashlib.blake2b(self.digest, digest_size=KEY_BYTES, person=_PERSON)
        h.update(raw)
        out = bytearray(h.digest())
        out[0] &= 0x7F  # a content key (tierkv.keys.is_content)
        return bytes(out)

    def many(self, offload_keys: Any) -> list[bytes]:
        """`__call__` over a collection, in order."""
        return [self(k) for k in offload_keys]
