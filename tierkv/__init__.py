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
    CorruptPageError,
    EngineError,
    InvalidInputError,
    InvalidTypeError,
    PageStateError,
    PageTableError,
    SequenceError,
    SpecError,
    StoreClosedError,
    StoreTimeoutError,
    TierFullError,
    TierKVError,
    TransferFailedError,
    UnknownPageError,
    UnknownPolicyError,
)
from tierkv.keys import prefix_keys
from tierkv.lease import Lease
from tierkv.page_table import PageState, PageTable
from tierkv.policies import (
    DEFAULT_POLICY,
    POLICIES,
    ChainHint,
    EvictionPolicy,
    PageHint,
    make_policy,
)
from tierkv.spec import KVSpec
from tierkv.store import KVStore
from tierkv.sync import SyncKVStore

__version__ = "0.1.0"

# What a user of the store needs. The rest stays importable from its module: the key helpers
# from tierkv.keys, the page table's events and allocations from tierkv.page_table, every error
# from tierkv.errors.
__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AllocationError",
    "ChainHint",
    "CorruptPageError",
    "EngineError",
    "EvictionPolicy",
    "InvalidInputError",
    "InvalidTypeError",
    "KVSpec",
    "KVStore",
    "Lease",
    "PageHint",
    "PageState",
    "PageStateError",
    "PageTable",
    "PageTableError",
    "SequenceError",
    "SpecError",
    "StoreClosedError",
    "StoreTimeoutError",
    "SyncKVStore",
    "TierFullError",
    "TierKVError",
    "TransferFailedError",
    "UnknownPageError",
    "UnknownPolicyError",
    "__version__",
    "make_policy",
    "prefix_keys",
    "restore_collector",
    "settle_collector",
]
