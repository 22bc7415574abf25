"""tierkv: a tiered (GPU / pinned host / remote) paged KV cache for LLM inference servers.

The public entry point. Import what you need from here::

    import tierkv
    spec = tierkv.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    async with tierkv.KVStore(spec, device_bytes=8 << 30, host_bytes=64 << 30) as store:
        ...

The names load lazily (PEP 562): ``import tierkv`` runs no submodule, and the first use of a name
imports the module that defines it (``tierkv.KVStore`` the store and torch). So the lower layers
cost only themselves: ``import tierkv.transports`` runs this file and the transports, never the
store or torch (tests/test_lazy_import.py checks it). A submodule is an attribute once imported,
or on first use (``tierkv.runtime``), as an eager package would have it.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it. The type checker reads the imports below instead.
_LAZY = {
    "Cold": "tierkv.chain_config",
    "Device": "tierkv.chain_config",
    "Disk": "tierkv.chain_config",
    "Host": "tierkv.chain_config",
    "Remote": "tierkv.chain_config",
    "register_tier": "tierkv.chain_plugins",
    "restore_collector": "tierkv.collector",
    "settle_collector": "tierkv.collector",
    "AllocationError": "tierkv.errors",
    "CorruptPageError": "tierkv.errors",
    "EngineError": "tierkv.errors",
    "InvalidInputError": "tierkv.errors",
    "InvalidTypeError": "tierkv.errors",
    "PageStateError": "tierkv.errors",
    "PageTableError": "tierkv.errors",
    "SequenceError": "tierkv.errors",
    "SpecError": "tierkv.errors",
    "StoreClosedError": "tierkv.errors",
    "StoreTimeoutError": "tierkv.errors",
    "TenantError": "tierkv.errors",
    "QuotaConfigError": "tierkv.errors",
    "QuotaExceededError": "tierkv.errors",
    "Quota": "tierkv.tenants",
    "TierConfigError": "tierkv.errors",
    "TierFullError": "tierkv.errors",
    "TierKVError": "tierkv.errors",
    "TransferFailedError": "tierkv.errors",
    "UnknownNameError": "tierkv.errors",
    "UnknownPageError": "tierkv.errors",
    "UnknownTenantError": "tierkv.errors",
    "UnknownPolicyError": "tierkv.errors",
    "prefix_keys": "tierkv.keys",
    "Lease": "tierkv.lease",
    "PageState": "tierkv.page_table",
    "PageTable": "tierkv.page_table",
    "DEFAULT_POLICY": "tierkv.policies",
    "POLICIES": "tierkv.policies",
    "ChainHint": "tierkv.policies",
    "EvictionPolicy": "tierkv.policies",
    "PageHint": "tierkv.policies",
    "create_policy": "tierkv.policies",
    "make_policy": "tierkv.policies",
    "KVSpec": "tierkv.spec",
    "KVStore": "tierkv.store",
    "SyncKVStore": "tierkv.sync",
}

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and editors
    from tierkv.chain_config import Cold, Device, Disk, Host, Remote
    from tierkv.chain_plugins import register_tier
    from tierkv.collector import restore_collector, settle_collector
    from tierkv.errors import (
        AllocationError,
        CorruptPageError,
        EngineError,
        InvalidInputError,
        InvalidTypeError,
        PageStateError,
        PageTableError,
        QuotaConfigError,
        QuotaExceededError,
        SequenceError,
        SpecError,
        StoreClosedError,
        StoreTimeoutError,
        TenantError,
        TierConfigError,
        TierFullError,
        TierKVError,
        TransferFailedError,
        UnknownNameError,
        UnknownPageError,
        UnknownPolicyError,
        UnknownTenantError,
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
        create_policy,
        make_policy,
    )
    from tierkv.spec import KVSpec
    from tierkv.store import KVStore
    from tierkv.sync import SyncKVStore
    from tierkv.tenants import Quota

# What a user of the store needs. The rest stays importable from its module: the key helpers
# from tierkv.keys, the page table's events and allocations from tierkv.page_table, every error
# from tierkv.errors.
__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AllocationError",
    "ChainHint",
    "Cold",
    "CorruptPageError",
    "Device",
    "Disk",
    "EngineError",
    "EvictionPolicy",
    "Host",
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
    "Quota",
    "QuotaConfigError",
    "QuotaExceededError",
    "Remote",
    "SequenceError",
    "SpecError",
    "StoreClosedError",
    "StoreTimeoutError",
    "SyncKVStore",
    "TenantError",
    "TierConfigError",
    "TierFullError",
    "TierKVError",
    "TransferFailedError",
    "UnknownNameError",
    "UnknownPageError",
    "UnknownPolicyError",
    "UnknownTenantError",
    "__version__",
    "create_policy",
    "make_policy",
    "prefix_keys",
    "register_tier",
    "restore_collector",
    "settle_collector",
]


def __getattr__(name: str) -> Any:
    """A public name on first use (imports its module and keeps the value), else a submodule."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    public = name.isidentifier() and not name.startswith("_")
    if public and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # the import binds the attribute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
