"""store.lease(blocks=) pins only the named pages; Lease.kv_blocks reads them in order (the
layer's last page up to its length) and refuses pages it does not pin or bad block lists."""

from __future__ import annotations

import pytest
import torch

from tierkv import KVSpec, SequenceError, SpecError
from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="fp32", page_tokens=4)


async def test_a_lease_of_some_blocks() -> None:
    async with KVStore(SPEC, device_bytes=16 * SPEC.page_bytes, host_bytes=1 << 20) as store:
        await store.add_sequence("s", list(range(14)))
        g = torch.Generator().manual_seed(0)
        k, v = torch.randn(2, 14, 8, generator=g), torch.randn(2, 14, 8, generator=g)
        async with store.lease(["s"], [0]) as lease:
            await lease.append("s", 0, k, v)
        async with store.lease(["s"], [0], blocks={"s": [0, 3]}) as lease:
            assert store.stats()["pages_leased"] >= 2
            got_k, got_v = lease.kv_blocks("s", 0, [0, 3])
            want = torch.cat([k[:, 0:4], k[:, 12:14]], dim=1)  # page 3 holds 2 tokens
            assert torch.equal(got_k, want)
            assert torch.equal(got_v, torch.cat([v[:, 0:4], v[:, 12:14]], dim=1))
            assert lease.kv_blocks("s", 0, [])[0].shape == (2, 0, 8)
            with pytest.raises(SpecError):
                lease.kv_blocks("s", 0, [3, 0])  # out of order
            with pytest.raises(SpecError):
                lease.kv_blocks("s", 0, [4])  # no such page
        async with store.lease(["s"], [0], blocks={}) as lease:
            got = lease.kv_blocks("s", 0, [1])  # resident on the device: pinned now, read
            assert torch.equal(got[0], k[:, 4:8])
        await store.drain()  # (write-behind copies pin pages while in flight)
        table = store.tiers.table
        assert all(table.pins(key, "device") == 0 for key in table.keys("device"))


async def test_kv_blocks_refuses_a_page_off_the_device() -> None:
    async with KVStore(
        SPEC, device_bytes=4 * SPEC.page_bytes, host_bytes=1 << 20, codec=None
    ) as store:
        await store.add_sequence("s", list(range(16)))
        for layer in (0, 1):
            async with store.lease(["s"], [layer]) as lease:
                await lease.append("s", layer, torch.ones(2, 16, 8), torch.ones(2, 16, 8))
        # layer 1's pages pushed layer 0's off the device
        async with (
            store.lease(["s"], [1], blocks={}) as lease,
            store.lease(["s"], [0], blocks={}) as other,
        ):
            del lease
            with pytest.raises(SequenceError):
                other.kv_blocks("s", 0, [0])


@pytest.mark.parametrize(
    ("blocks", "error"),
    [
        ([0], InvalidTypeError),  # was an AttributeError ('list' has no 'items')
        ({"s": "ab"}, InvalidTypeError),  # was a TypeError ('<=' between int and str)
        ({"s": [1.5]}, InvalidTypeError),  # was taken (passed over)
        ({"s": 3}, InvalidTypeError),
        ({"s": [-1]}, InvalidInputError),  # was taken (passed over)
        ({"other": [0]}, SequenceError),  # a sequence the lease does not name: was ignored
    ],
)
async def test_bad_blocks_are_refused_at_entry(blocks: object, error: type[Exception]) -> None:
    async with KVStore(SPEC, device_bytes=16 * SPEC.page_bytes, host_bytes=1 << 20) as store:
        await store.add_sequence("s", list(range(14)))
        await store.add_sequence("other", list(range(100, 104)))
        with pytest.raises(error):
            store.lease(["s"], [0], blocks=blocks)  # type: ignore[arg-type]
        async with store.lease(["s"], [0], blocks={"s": [0, 99]}):  # past the end: passed over
            pass
        store.check()
