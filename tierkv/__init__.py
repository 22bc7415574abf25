"""tierkv: a tiered (GPU / pinned host / remote) paged KV cache for LLM inference servers.

The public entry point. Import what you need from here::

    import tierkv
    spec = tierkv.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    async with tierkv.KVStore(spec, device_bytes=8 << 30, host_bytes=64 << 30) as store:
        ...
"""

from __future__ import annotations

from tierkv.collector import restore_collector, settle_collector
from tierkv.errors import (
    AllocationError,
    EngineError,
    InvalidInputError,
    InvalidTypeError,
    PageStateError,
    PageTableError,
    PinError,
    SequenceError,
    SpecError,
    StoreClosedError,
    StoreTimeoutError,
    TierFullError,
    TierKVError,
    TransferFailedError,
    UnknownPageError,
)
from tierkv.keys import KeyKind, PageKey, block_key, key_kind, prefix_keys, private_key, root_key
from tierkv.lease import Lease
from tierkv.page_table import PageEvent, PageState, PageTable, StoreAllocation
from tierkv.policies import DEFAULT_POLICY, POLICIES, EvictionPolicy, PageHint, make_policy
from tierkv.spec import KVSpec
from tierkv.store import KVStore
from tierkv.sync import SyncKVStore

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AllocationError",
    "EngineError",
    "EvictionPolicy",
    "InvalidInputError",
    "InvalidTypeError",
    "KVSpec",
    "KVStore",
    "KeyKind",
    "Lease",
    "PageEvent",
    "PageHint",
    "PageKey",
    "PageState",
    "PageStateError",
    "PageTable",
    "PageTableError",
    "PinError",
    "SequenceError",
    "SpecError",
    "StoreAllocation",
    "StoreClosedError",
    "StoreTimeoutError",
    "SyncKVStore",
    "TierFullError",
    "TierKVError",
    "TransferFailedError",
    "UnknownPageError",
    "__version__",
    "block_key",
    "key_kind",
    "make_policy",
    "prefix_keys",
    "private_key",
    "restore_collector",
    "root_key",
    "settle_collector",
]
