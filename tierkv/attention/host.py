"""Read pages where the host or cold tier holds them, for attention computed on the host.

Pages that the host tier holds and the device tier does not are pinned in the host tier
(:meth:`TierSet.pin_host`: none can be evicted or overwritten meanwhile), gathered token-major
from the host arena's memory into one host tensor (a host-to-host copy, the same gather the
device tier does for a lease) and unpinned. Pages that only the cold tier holds are pinned
there, checked against their payload checksums and decoded by the codec in host memory
(:meth:`ColdStorage.decode_on_host`; int8: the native one-pass decode), then unpinned. Nothing
is copied to the device tier: the page table's placement, the device arena and the transfer
engine are not touched, so these pages' bytes to the device are zero by construction
(``stats()["bytes_h2d"]`` does not move).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from tierkv.spec import KVSpec
from tierkv.tier_names import COLD, DEVICE, HOST
from tierkv.tiers import TierSet

__all__ = ["cold_only", "host_only", "read_cold_tokens", "read_host_tokens"]


def host_only(tiers: TierSet, keys: Sequence[bytes]) -> set[bytes]:
    """Those of ``keys`` readable in the host tier and not on the device (none in a store
    without a host tier: a host-first store's leased pages are in host memory already)."""
    table = tiers.table
    if HOST not in table.tier_names:
        return set()
    on_host = set(table.readable(keys, HOST))
    if not on_host:
        return on_host
    return on_host - set(table.readable(list(on_host), DEVICE))


def cold_only(tiers: TierSet, keys: Sequence[bytes]) -> set[bytes]:
    """Those of ``keys`` readable in the cold tier and in neither the host nor the device
    tier (none in a store without a cold tier)."""
    table = tiers.table
    if COLD not in table.tier_names:
        return set()
    got = set(table.readable(keys, COLD))
    for tier in (HOST, DEVICE):
        if got and tier in table.tier_names:
            got -= set(table.readable(list(got), tier))
    return got


def read_cold_tokens(tiers: TierSet, spec: KVSpec, keys: Sequence[bytes]) -> torch.Tensor:
    """The pages ``keys`` (readable in the cold tier) decoded on the host, as ``[2, H, n * T,
    D]`` on the cpu. Raises as :meth:`ColdStorage.decode_on_host` (nothing pinned after)."""
    raw = tiers.cold.decode_on_host(keys)
    pages = raw.view(spec.dtype).view(len(keys), *spec.page_shape)
    return _token_major(pages, spec)


def _token_major(
    pages: torch.Tensor, spec: KVSpec, idx: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N, 2, H, T, D]`` pages (those at ``idx`` when given) as ``[2, H, n * T, D]``: one
    copy."""
    got = pages.permute(1, 2, 0, 3, 4)
    if idx is not None:
        got = got.index_select(2, idx)
    return got.reshape(2, spec.num_kv_heads, -1, spec.head_dim)


def read_host_tokens(tiers: TierSet, spec: KVSpec, keys: Sequence[bytes]) -> torch.Tensor:
    """The pages ``keys`` (readable in the host tier) as ``[2, H, n * T, D]`` on the cpu.

    Raises PageStateError / UnknownPageError (nothing pinned) when one is not readable there.
    """
    if not keys:
        return torch.empty((2, spec.num_kv_heads, 0, spec.head_dim), dtype=spec.dtype)
    slots = tiers.glue.pin_host(keys)
    try:
        raw = torch.from_numpy(tiers.glue.host_array)  # the arena's memory, no copy
        pages = raw[:, : 2 * spec.kv_bytes].view(spec.dtype).view(raw.shape[0], *spec.page_shape)
        idx = torch.frombuffer(array("q", slots), dtype=torch.int64)
        return _token_major(pages, spec, idx)
    finally:
        tiers.glue.unpin_host(keys)
