"""The error tree of tierkv's semantic layer.

::

    TierKVError                                (this, UnknownNameError, InvalidInputError and
                                                InvalidTypeError are defined in the lowest
                                                layer, transports.errors, and re-exported here)
     ├── UnknownNameError (also LookupError)   a registry has no factory of that name: each
     │                                         registry's own error below is one too
     ├── InvalidInputError (also ValueError)   a bad argument, rejected at entry: nothing changed
     │    ├── InvalidTypeError (also TypeError) an argument of the wrong type: a float, str or
     │    │                                     None token, a list or numpy array as ``k``,
     │    │                                     ``"1G"`` as a budget, a float sequence id
     │    ├── SpecError                         an invalid KVSpec, or a tensor whose shape,
     │    │    │                                dtype or device does not match it; a layer or
     │    │    │                                token id out of range
     │    │    └── UnknownPolicyError           no eviction policy of that name (also an
     │    │                                     UnknownNameError)
     │    ├── TierConfigError                   a bad ``KVStore(tiers=[...])`` chain
     │    │    │                                (:mod:`tierkv.chain_config`), refused before
     │    │    │                                anything is allocated
     │    │    ├── UnknownTierError             a tier kind no chain knows (also an
     │    │    │                                UnknownNameError)
     │    │    ├── TierTypeError                an entry or a field of the wrong type (also an
     │    │    │                                InvalidTypeError)
     │    │    ├── TierOrderError               tiers out of order, twice, or a combination
     │    │    │                                the core cannot run (no tier for leases)
     │    │    ├── TierSizeError                a tier that holds no page (also a SpecError)
     │    │    ├── TierConflictError            ``tiers=`` and an old keyword argument of the
     │    │    │                                same tier (``host_bytes=``...) both given
     │    │    └── QuotaConfigError             tenants' quotas that do not add up (reservations
     │    │                                     over a tier's capacity, reserve > limit)
     │    └── TenantError                       a bad tenant name or cache salt
     │         │                                (:mod:`tierkv.tenant_names`)
     │         └── UnknownTenantError           a tenant nobody configured (also an
     │                                          UnknownNameError)
     ├── PageTableError                        misuse of the page table; nothing was changed
     │    ├── UnknownPageError (also KeyError)  a key that the tier does not hold
     │    ├── PageStateError                    a page in the wrong state (double complete, ...)
     │    └── PinError                          unpinning a page that is not pinned
     ├── TierFullError                         no room: every page is pinned or moving
     │    └── QuotaExceededError               no room without breaking a tenant's quota
     │                                         (:mod:`tierkv.tenants`; HTTP 429)
     ├── StoreClosedError                      use of a store after close()
     ├── SequenceError (also KeyError)         an unknown or already released sequence
     ├── EngineError                           the runtime underneath failed (see __cause__)
     │    ├── TransferFailedError              a page copy failed or was dropped
     │    └── AllocationError (also MemoryError) a tier's memory cannot be reserved
     ├── StoreTimeoutError (also TimeoutError) a bounded wait ran out
     └── CorruptPageError                      a page's bytes failed their checksum: dropped,
                                               never served (docs/security.md)

The runtime's tree (``tierkv.runtime.errors``, rooted at ``RuntimeEngineError``) and the
transports' (``tierkv.transports.errors``, ``TransportError``) hang under ``TierKVError`` too, and
so do the codecs' (``tierkv.codecs.CodecError``), the remote tier's
(``tierkv.remote.RemoteError``) and the serving engine's (``tierkv.serving.RequestError``). The
unknown-name errors of the four registries are one kind, :class:`UnknownNameError`::

    UnknownNameError
     ├── runtime.UnknownBackendError      (also BackendUnavailableError)
     ├── transports.UnknownTransportError (also TransportError)
     ├── UnknownPolicyError               (also SpecError, a ValueError)
     └── codecs.UnknownCodecError         (also CodecError and KeyError)

Whatever :class:`~tierkv.store.KVStore`, :class:`~tierkv.lease.Lease` and
:class:`~tierkv.sync.SyncKVStore` raise is a ``TierKVError``: their public methods map lower
errors at the boundary (:mod:`tierkv.boundary`) with ``raise ... from exc``, so ``__cause__``
keeps the original::

    runtime.WaitTimeoutError                 -> StoreTimeoutError
    runtime.TransferError (and Cancelled)    -> TransferFailedError
    runtime.EngineClosedError                -> StoreClosedError
    runtime.ArenaError (cannot map a tier)   -> AllocationError
    any other runtime.RuntimeEngineError     -> EngineError
    transports.TransportError                -> tierkv.remote.RemoteError (its own subtree)
    TimeoutError (an asyncio bound, or a SyncKVStore call past twice the store's timeout)
                                             -> StoreTimeoutError

Arguments are checked at entry, before anything is allocated (:mod:`tierkv.validate`); the
ranges and types accepted are documented there and in ``docs/store.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

# the root and the registries' error live in the lowest layer; re-exported here
from tierkv.transports.errors import InvalidInputError as InvalidInputError
from tierkv.transports.errors import InvalidTypeError as InvalidTypeError
from tierkv.transports.errors import TierKVError as TierKVError
from tierkv.transports.errors import UnknownNameError as UnknownNameError


class SpecError(InvalidInputError):
    """An invalid :class:`~tierkv.spec.KVSpec`, or a tensor that does not match it."""


class UnknownPolicyError(SpecError, UnknownNameError):
    """No eviction policy is registered under that name."""


class TierConfigError(InvalidInputError):
    """A bad chain of tiers (``KVStore(tiers=[...])``, :mod:`tierkv.chain_config`), refused
    before anything is allocated."""


class UnknownTierError(TierConfigError, UnknownNameError):
    """A tier kind that no chain knows (``{"tier": "ssd"}``)."""


class TierTypeError(TierConfigError, InvalidTypeError):
    """A chain entry, or one of its fields, of the wrong type (``"host"`` with no size,
    ``bytes="1G"``)."""


class TierOrderError(TierConfigError):
    """Tiers not fastest to slowest, a tier twice, or a chain the core cannot run (no device
    or host tier to lease pages from; a tier below the device with no host tier between)."""


class TierSizeError(TierConfigError, SpecError):
    """A tier whose budget holds no page (also a SpecError, as the keyword budgets raise)."""


class TierConflictError(TierConfigError):
    """``tiers=`` given together with a keyword argument that configures a tier too
    (``device_bytes``, ``host_bytes``, ``codec``, ``cold_fraction``, ``disk_path``,
    ``disk_bytes``, ``remote``)."""


class PageTableError(TierKVError):
    """Misuse of the page table. The table is left exactly as it was."""


class UnknownPageError(PageTableError, KeyError):
    """A key that the named tier does not hold (or does not hold in a usable state)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown page"


class PageStateError(PageTableError):
    """A page is in the wrong state for the operation (for example a double complete)."""


class PinError(PageTableError):
    """A pin count would go negative: the page was not pinned."""


class QuotaConfigError(TierConfigError):
    """Tenants' quotas that cannot hold (:mod:`tierkv.tenants`): reservations summing over a
    tier's capacity, a reservation above its limit, a quota for a tier the store lacks.
    Raised at construction; nothing is allocated."""


class TierFullError(TierKVError):
    """A tier has no room because every page in it is pinned or moving."""


class QuotaExceededError(TierFullError):
    """No room in a tier without taking a page of a tenant at or below its reservation
    (:mod:`tierkv.tenants`): the admission refused. ``tenant``: the tenant whose pages were
    refused, where one is known."""

    def __init__(self, msg: str, *, tenant: str | None = None) -> None:
        super().__init__(msg)
        self.tenant = tenant


class StoreClosedError(TierKVError):
    """The store was used after it was closed."""


class SequenceError(TierKVError, KeyError):
    """An unknown sequence id, or one that was already released."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown sequence"


class EngineError(TierKVError):
    """The runtime underneath the store failed; ``__cause__`` holds the runtime's error."""


class TransferFailedError(EngineError):
    """A page copy failed, or was dropped before it ran (runtime ``TransferError``)."""


class AllocationError(EngineError, MemoryError):
    """A tier's memory could not be reserved (runtime ``ArenaError`` while opening)."""


class StoreTimeoutError(TierKVError, TimeoutError):
    """A bounded wait ran out (runtime ``WaitTimeoutError``, or a SyncKVStore call's bound)."""


class CorruptPageError(TierKVError):
    """Pages whose bytes failed their CRC-32C where they crossed a boundary (a cold copy read
    back, pages a peer's page server refused at commit): never served, counted in
    ``tierkv_corrupt_pages_total``.

    Attributes:
        tier: where the bytes came from (``cold``, ``peer``, ``redis``).
        pages: how many pages failed.
        stored: pages of the same call that were stored intact (a publish).
        keys: the keys of the pages that failed, where known.

    The codecs' :class:`~tierkv.codecs.CorruptEncodingError` (an encoded buffer that does not
    parse) is one of these too.
    """

    def __init__(
        self,
        msg: str,
        *,
        tier: str = "",
        pages: int = 0,
        stored: int = 0,
        keys: Sequence[bytes] = (),
    ) -> None:
        super().__init__(msg)
        self.tier, self.pages, self.stored, self.keys = tier, pages, stored, list(keys)


class TenantError(InvalidInputError):
    """A tenant name or a cache salt that is not acceptable (:mod:`tierkv.tenant_names`):
    not a string (or bytes, for a salt), empty, too long, or with characters outside the
    allowed set. Raised at entry; nothing changed."""


class UnknownTenantError(TenantError, UnknownNameError):
    """A request named a tenant the store (or server) was not configured with."""
