"""The store's page summaries (``KVStore.summaries``, keyed by page key): a block's summary
follows its publish (the private key renamed to the content key), so a later sequence that
reuses the block finds it known; pages no tier holds are pruned once past the limit."""

from __future__ import annotations

import torch

from tierkv import KVSpec
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes


async def test_a_reused_block_carries_its_summary() -> None:
    gen = torch.Generator().manual_seed(1)
    prompt = list(range(9))  # 2 full blocks and one token
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=32 * PAGE, codec=None) as store:
        await store.add_sequence("a", prompt[:1])
        store.add_tokens("a", prompt[1:])  # generated tokens: their blocks are private keys
        ks = []
        async with store.lease(["a"]) as lease:
            for layer in range(2):
                k = torch.randn(2, 9, 8, generator=gen)
                ks.append(k)
                await lease.append("a", layer, k, torch.randn(2, 9, 8, generator=gen))
                store.summaries.append(store.sequence("a").pages(layer), k, 0, 4)
            private = store.sequence("a").pages(0)[:2]
        await store.release("a")  # the full blocks published under their content keys
        await store.drain()
        assert await store.add_sequence("b", prompt) == 8  # both blocks reused
        for layer in range(2):
            keys = store.sequence("b").pages(layer)[:2]
            assert not set(keys) & set(private)  # renamed, not the same keys
            got = store.summaries.table(keys)
            want = ks[layer][:, :8].reshape(2, 2, 4, 8)
            assert torch.equal(got[:, 0], want.amin(dim=2).transpose(0, 1))
            assert torch.equal(got[:, 1], want.amax(dim=2).transpose(0, 1))
            assert torch.allclose(got[:, 2], want.mean(dim=2).transpose(0, 1), atol=1e-6)
        await store.release("b")


async def test_summaries_of_pages_gone_everywhere_are_pruned() -> None:
    async with KVStore(SPEC, device_bytes=4 * PAGE, host_bytes=4 * PAGE, codec=None) as store:
        assert store.summaries.limit == 2 * (4 + 4)
        ghosts = [b"gone-%d" % i for i in range(17)]  # no tier holds these
        store.summaries.append(ghosts, torch.ones(2, 17 * 4, 8), 0, 4)
        assert store.summaries.due()
        store.step()
        assert len(store.summaries) == 0
