"""Budgets are limits (issue 13, finding 5): the README's store (8 GiB device, 64 GiB host)
opens on a machine with less memory than that, with a small RSS, and works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierkv
from tierkv.store import KVStore

GIB = 1 << 30
MIB = 1 << 20
SPEC = tierkv.KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _strict_overcommit() -> bool:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2"
    except OSError:
        return True


pytestmark = pytest.mark.skipif(
    not Path("/proc/self/status").exists() or _strict_overcommit(),
    reason="needs Linux without strict overcommit (vm.overcommit_memory=2 commits up front)",
)


async def test_the_readme_store_opens_with_a_small_rss_and_works() -> None:
    before = rss_bytes()
    async with KVStore(SPEC, device_bytes=8 << 30, host_bytes=64 << 30) as store:
        opened = rss_bytes() - before
        # bookkeeping only (the page table's ~1.4M slots), never the 72 GiB of budget
        assert opened < 512 * MIB, f"open grew the RSS by {opened / MIB:.0f} MiB"
        refs = {}
        for i in range(3):
            sid = f"req-{i}"
            prompt = [1000 * i + j for j in range(40)]
            assert await store.add_sequence(sid, prompt) == 0
            async with store.lease([sid]) as lease:
                for layer in range(SPEC.num_layers):
                    g = torch.Generator().manual_seed(100 * i + layer)
                    shape = (SPEC.num_kv_heads, len(prompt), SPEC.head_dim)
                    k = torch.randn(shape, generator=g).to(torch.float16)
                    v = torch.randn(shape, generator=g).to(torch.float16)
                    await lease.append(sid, layer, k, v)
                    refs[sid, layer] = (k, v)
        for i in range(3):
            sid = f"req-{i}"
            async with store.lease([sid]) as lease:
                for layer in (0, SPEC.num_layers - 1):
                    got_k, got_v = lease.kv(sid, layer)
                    k, v = refs[sid, layer]
                    assert torch.equal(got_k, k) and torch.equal(got_v, v)
        await store.drain()
        used = rss_bytes() - before
        # 3 sequences x 3 pages x 32 layers x 64 KiB = 18 MiB of KV (plus its host copies)
        assert used < 768 * MIB, f"RSS grew by {used / MIB:.0f} MiB for 18 MiB of KV"
        for i in range(3):
            await store.release(f"req-{i}")
        store.tiers.table.check()
        assert store.lookup([j for j in range(32)]) == 32  # req-0's two full blocks stay cached
