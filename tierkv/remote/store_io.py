"""Move a prompt's cached prefix between a local store and a page source, as whole blocks.

The peer is any `PageSource`: a page server (`RemoteTier`) or Redis (`RedisTier`).

A block's pages go block-major (``[b0 l0, b0 l1, ..., b1 l0, ...]``), so a page prefix the peer
holds maps to a block prefix. Imported pages land in the local host tier as unowned cached
pages (two-phase: reserved WRITING, committed once the peer confirmed them), exactly as if this
store had computed and released them; `KVStore.add_sequence` then reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from tierkv import validate
from tierkv.keys import page_key, prefix_keys
from tierkv.page_source import PageSource, load_checked, publish_checked, tier_label
from tierkv.page_sums import PageCheck
from tierkv.prompt import prompt_keys
from tierkv.runtime import TransferError
from tierkv.store import KVStore
from tierkv.tenant_names import check_salt
from tierkv.tenants import tenant_index

__all__ = ["import_prefix", "prefix_pages", "publish_prefix", "stage_prefix"]


def prefix_pages(
    store: KVStore, tokens: Sequence[int], *, salt: str | bytes | None = None
) -> list[bytes]:
    """Page keys (block-major) of the blocks `add_sequence` would reuse for ``tokens``
    (under cache salt ``salt``, as `add_sequence(..., salt=)` keys them).

    Raises InvalidTypeError / SpecError for token ids that are not ints in range (checked as
    the store checks them: a float or a string is refused, not truncated)."""
    t = store.spec.page_tokens
    toks = validate.token_array(tokens)
    blocks = prefix_keys(toks[: max(0, len(toks) - 1) // t * t], t, store.namespace, salt=salt)
    return [page_key(b, layer) for b in blocks for layer in range(store.spec.num_layers)]


async def _prefix_pages(
    store: KVStore, tokens: Sequence[int], salt: str | bytes | None
) -> tuple[list[bytes], int]:
    """:func:`prefix_pages` hashed in slices with a loop turn between them (long prompts), and
    the pages of every full block of ``tokens`` (what `KVStore.lookup` counts) after them."""
    t = store.spec.page_tokens
    toks, blocks = await prompt_keys(tokens, t, store.namespace, salt=check_salt(salt))
    pages = [page_key(b, layer) for b in blocks for layer in range(store.spec.num_layers)]
    return pages, max(0, len(toks) - 1) // t * store.spec.num_layers


async def stage_prefix(
    store: KVStore, tokens: Sequence[int], *, salt: str | bytes | None = None
) -> int:
    """Copy the cached blocks of ``tokens``' prefix that are only (or newer) on the device down
    to the host tier, where a page server can serve them; returns the pages this call copied.

    It waits for the store's background work first (`KVStore.drain`), so the pages a lease's
    write-behind already copied are not copied again (and not counted). Use it to have a
    prefix servable now: after a prefill with ``write_behind=False``, or to be sure the
    write-behind has finished.
    """
    check_salt(salt)
    await store.drain()
    every, n = await _prefix_pages(store, tokens, salt)
    return await store.tiers.pages.write_behind(every[:n])


async def import_prefix(
    store: KVStore,
    peer: PageSource,
    tokens: Sequence[int],
    *,
    salt: str | bytes | None = None,
    tenant: str | None = None,
) -> int:
    """Load from ``peer`` the blocks of ``tokens``' prefix this store lacks; returns the prompt
    tokens now cached locally (what `add_sequence` will reuse), as many leading blocks as the
    host tier has room for (free and evictable slots). A long prompt is checked and
    hashed in slices with a loop turn between them; the read is a job of the store's transfer
    engine.

    ``salt``: the cache salt the prompt is keyed under (`add_sequence(..., salt=)`);
    ``tenant``: the store's tenant charged for the imported pages (as `add_sequence`'s
    imports are charged to the sequence's tenant).

    Raises TierFullError (the local host tier is full of pinned pages), PeerGoneError,
    RemoteTimeoutError, RemoteError; InvalidTypeError / SpecError for bad token ids;
    TenantError / UnknownTenantError for a bad salt or a tenant the store lacks. On any
    error (or cancellation) no local page has changed.
    """
    tiers = store.tiers
    table = tiers.table
    who = tenant_index(store.tenants, tenant)
    every, n = await _prefix_pages(store, tokens, salt)
    pages = every[:n]
    layers = store.spec.num_layers
    have = table.lookup(pages) // layers * layers  # any tier
    held = have + (await peer.lookup(pages[have:])) // layers * layers
    # an import is all or nothing: ask for the leading blocks the host tier can take
    top = tiers.top  # the host tier (the leased tier of a host-first store)
    room = table.capacity(top) - table.used(top) + table.evictable(top)
    held = min(held, have + max(0, room) // layers * layers)
    somewhere = set(table.held(pages[have:held]))
    want = [k for k in pages[have:held] if k not in somewhere]
    if want:
        if who is not None and store.tenants is not None:
            store.tenants.charge(want, who, fresh=True)
        check = PageCheck()  # the peer's pages are checked as they land (counted if corrupt)

        async def load(keys: list[bytes], host: npt.NDArray[np.uint8], slots: list[int]) -> int:
            return await load_checked(peer, keys, host, slots, check)

        try:
            await tiers.glue.import_host(
                want,
                load,
                timeout=store.timeout,
                make_room=False,
                check=check,
                tier=tier_label(peer),
            )
        except TransferError as exc:  # the peer's own error, as it raised it
            raise (exc.__cause__ or exc) from None
    return tiers.table.lookup(every) // layers * store.spec.page_tokens  # = store.lookup


async def publish_prefix(
    store: KVStore, peer: PageSource, tokens: Sequence[int], *, salt: str | bytes | None = None
) -> int:
    """Write the cached blocks of ``tokens``' prefix that sit in the local host tier to
    ``peer``; returns the pages the peer newly stored. Call `stage_prefix` first so that
    pages computed on the device are in the host tier. The write is a job of the store's
    transfer engine; the pages stay pinned until it has ended.

    Raises RemoteFullError, PeerGoneError, RemoteTimeoutError, RemoteError.
    """
    tiers = store.tiers
    every, n = await _prefix_pages(store, tokens, salt)
    pages = every[:n]
    layers = store.spec.num_layers
    n = tiers.table.lookup(pages, tiers.top) // layers * layers
    if not n:
        return 0

    async def send(keys: list[bytes], host: npt.NDArray[np.uint8], slots: list[int]) -> int:
        return await publish_checked(peer, keys, host, slots, tiers.glue.host_sums(keys, slots))

    try:
        return await tiers.glue.export_host(pages[:n], send, timeout=store.timeout)
    except TransferError as exc:  # the peer's own error, as it raised it
        raise (exc.__cause__ or exc) from None
