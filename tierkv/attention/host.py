"""Read pages where the host tier holds them, for attention computed on the host.

Pages that the host tier holds and the device tier does not are pinned in the host tier
(:meth:`TierSet.pin_host`: none can be evicted or overwritten meanwhile), gathered token-major
from the host arena's memory into one host tensor (a host-to-host copy, the same gather the
device tier does for a lease) and unpinned. Nothing is copied to the device tier: the page
table, the device arena and the transfer engine are not touched, so these pages' bytes to
the device are zero by construction (``stats()["bytes_h2d"]`` does not move).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from tierkv.spec import KVSpec
from tierkv.tier_names import DEVICE, HOST
from tierkv.tiers import TierSet

__all__ = ["host_only", "read_host_tokens"]


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


def read_host_tokens(tiers: TierSet, spec: KVSpec, keys: Sequence[bytes]) -> torch.Tensor:
    """The pages ``keys`` (readable in the host tier) as ``[2, H, n * T, D]`` on the cpu.

    Raises PageStateError / UnknownPageError (nothing pinned) when one is not readable there.
    """
    h, t, d = spec.num_kv_heads, spec.page_tokens, spec.head_dim
    if not keys:
        return torch.empty((2, h, 0, d), dtype=spec.dtype)
    slots = tiers.glue.pin_host(keys)
    try:
        raw = torch.from_numpy(tiers.glue.host_array)  # the arena's memory, no copy
        pages = raw[:, : 2 * spec.kv_bytes].view(spec.dtype).view(raw.shape[0], *spec.page_shape)
        idx = torch.frombuffer(array("q", slots), dtype=torch.int64)
        return pages.permute(1, 2, 0, 3, 4).index_select(2, idx).reshape(2, h, len(keys) * t, d)
    finally:
        tiers.glue.unpin_host(keys)
