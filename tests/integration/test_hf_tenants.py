"""TieredCache with a salt and a tenant (issue 29): a cache reuses the prompt blocks of caches
of its salt only, its pages are charged to its tenant, a copy keeps both."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import sys
from pathlib import Path

import torch

import tierkv
from tierkv.errors import TenantError
from tierkv.integrations.hf import TieredCache
from tierkv.integrations.hf_store import StoreOwner

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_store import CFG, SPEC

LAYERS = CFG.num_hidden_layers
PROMPT = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]


def _prefill(cache: TieredCache) -> int:
    reused = cache.set_prompt(PROMPT)
    n = len(PROMPT[0]) - reused
    for layer in range(LAYERS):
        k = torch.ones(1, 2, n, 16) * layer
        cache.layers[layer].update(k, k + 1)
    return reused


def test_salted_caches_share_only_with_their_salt_and_charge_their_tenant() -> None:
    quotas = {"a": tierkv.Quota(), "b": tierkv.Quota()}
    with tierkv.SyncKVStore(
        SPEC, device_bytes=32 * SPEC.page_bytes, host_bytes=1 << 20, tenants=quotas
    ) as store:
        with TieredCache(store=store, salt="a", tenant="a") as first:
            assert _prefill(first) == 0
            twin = copy.deepcopy(first)
            twin.close()
        with TieredCache(store=store, salt="b", tenant="b") as other:
            assert _prefill(other) == 0  # the same prompt under another salt: nothing reused
        with TieredCache(store=store, salt="a", tenant="a") as again:
            assert _prefill(again) == 8  # two full blocks of its own salt
        tenants = store.call(lambda: store.store.stats()["tenants"])
        assert tenants["a"]["tiers"]["device"]["pages"] == 2 * LAYERS  # 2 blocks, cached
        assert tenants["b"]["tiers"]["device"]["pages"] == 2 * LAYERS
        assert tenants["a"]["prefix_tokens_reused"] == 16  # the copy's 8 and the last 8
    with pytest.raises(TenantError):
        TieredCache(CFG, device_bytes=1 << 20, host_bytes=1 << 20, salt=b"")


def test_a_tenant_the_store_lacks_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quotas = {"a": tierkv.Quota()}
    with tierkv.SyncKVStore(
        SPEC, device_bytes=32 * SPEC.page_bytes, host_bytes=1 << 20, tenants=quotas
    ) as store:
        for bad in ("A", "b", "a "):  # another spelling, another tenant, a bad name
            with pytest.raises(TenantError):  # (UnknownTenantError is one)
                TieredCache(store=store, tenant=bad)
        assert store.call(lambda: store.store.sequence_ids()) == []
    closed: list[object] = []
    real = StoreOwner.drop

    def drop(self: StoreOwner) -> None:
        closed.append(self)
        real(self)

    monkeypatch.setattr(StoreOwner, "drop", drop)
    with pytest.raises(tierkv.UnknownTenantError):  # a store without tenants knows none
        TieredCache(CFG, device_bytes=1 << 20, host_bytes=1 << 20, tenant="a")
    assert len(closed) == 1  # the store that cache opened was closed again
