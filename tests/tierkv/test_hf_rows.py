"""TieredCache's store side without a model: batch rows reuse one common cached prefix, padded
rows share nothing, and copied rows hold the same KV as their sources, independently."""

from __future__ import annotations

import pytest
import torch

import tierkv
from tierkv.integrations.hf_rows import add_rows, copy_rows

SPEC = tierkv.KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="fp32", page_tokens=4)


def _store() -> tierkv.KVStore:
    return tierkv.KVStore(
        SPEC, device_bytes=64 * SPEC.page_bytes, host_bytes=256 * SPEC.page_bytes, codec=None
    )


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


async def _fill(store: tierkv.KVStore, sid: str, tokens: list[int], seed: int) -> None:
    """One sequence whose prompt KV is computed (every layer) and published at release."""
    await store.add_sequence(sid, tokens)
    async with store.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            await lease.append(sid, layer, *_kv(len(tokens), seed + layer))
    await store.release(sid)


async def test_rows_reuse_their_common_prefix() -> None:
    a = list(range(1, 18))  # 4 full blocks + 1 token
    async with _store() as store:
        await _fill(store, "a", a, 0)
        assert store.lookup(a) == 16
        # row 0 shares 3 blocks with a, row 1 shares 2: the batch reuses 2 blocks
        rows = [[*a[:12], 99, 98], [*a[:8], 77, 76, 75, 74, 73]]
        reused = await add_rows(store, ["r0", "r1"], rows)
        assert reused == 8
        for sid, row in zip(["r0", "r1"], rows):
            seq = store.sequence(sid)
            assert seq.kv_len == [8, 8] and seq.tokens == row
        # a whole cached prompt still leaves one token to compute (whole pages only)
        assert await add_rows(store, ["r2"], [a[:16]]) == 12
        assert store.stats()["prefix_tokens_reused"] == 8 + 8 + 12
        store.check()


async def test_a_padded_row_shares_nothing() -> None:
    a = list(range(1, 18))
    async with _store() as store:
        await _fill(store, "a", a, 0)
        assert await add_rows(store, ["p0", "p1"], [a, None]) == 0
        assert store.sequence("p0").tokens == a and store.sequence("p1").tokens == []
        store.check()


async def test_copied_rows_hold_the_same_kv_independently() -> None:
    a = list(range(1, 18))
    async with _store() as store:
        await _fill(store, "a", a, 0)
        reused = await add_rows(store, ["src"], [[*a, 50, 51, 52]])
        assert reused == 16
        async with store.lease(["src"]) as lease:  # the rest of the prompt plus 3 private ones
            for layer in range(SPEC.num_layers):
                await lease.append("src", layer, *_kv(4 + 3, 10 + layer))
        await copy_rows(store, ["src"], ["dst"])
        async with store.lease(["src", "dst"]) as lease:
            for layer in range(SPEC.num_layers):
                ks, vs = lease.kv("src", layer)
                kd, vd = lease.kv("dst", layer)
                assert ks.shape[1] == 23 and torch.equal(ks, kd) and torch.equal(vs, vd)
        assert store.sequence("dst").tokens == store.sequence("src").tokens
        # the source goes on (and goes away): the copy keeps its own KV
        before = {}
        async with store.lease(["dst"]) as lease:
            for layer in range(SPEC.num_layers):
                before[layer] = [t.clone() for t in lease.kv("dst", layer)]
        async with store.lease(["src"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("src", layer, *_kv(2, 20 + layer))
        await store.release("src")
        async with store.lease(["dst"]) as lease:
            for layer in range(SPEC.num_layers):
                k, v = lease.kv("dst", layer)
                assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
        store.check()


async def test_a_failed_copy_leaves_nothing() -> None:
    async with _store() as store:
        await store.add_sequence("src", [1, 2, 3])
        await store.add_sequence("taken", [])
        with pytest.raises(tierkv.SequenceError, match="already exists"):
            await copy_rows(store, ["src", "src"], ["new", "taken"])
        with pytest.raises(tierkv.SequenceError):
            store.sequence("new")  # the first destination was released
        store.check()
