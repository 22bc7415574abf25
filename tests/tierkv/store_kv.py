"""The KV of the store tests that fill sequences and read them back (the disk tier's and the
chain's): one layout, sequences of ``N`` tokens (two full blocks, content-keyed and cached at
release, and a private one), KV a function of the sequence's seed."""

from __future__ import annotations

from pathlib import Path

import torch

from tierkv import KVSpec
from tierkv.disk.layout import ALIGN
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SLOT = ALIGN + -(-PAGE // ALIGN) * ALIGN  # a disk slot: header + page padded to 4 KiB
N = 10  # tokens per sequence: two full blocks (content, cached) and a private one


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def tokens(seed: int, n: int = N) -> list[int]:
    return [1000 * seed + i for i in range(n)]


def store(path: Path, **kw: object) -> KVStore:
    """A store with a disk tier on ``path`` and small device and host tiers."""
    kw.setdefault("disk_bytes", 64 * SLOT)
    return KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, codec=None, disk_path=path, **kw
    )  # type: ignore[arg-type]


async def fill(
    s: KVStore, sid: str, seed: int, salt: str | None = None, tenant: str | None = None
) -> None:
    await s.add_sequence(sid, tokens(seed), salt=salt, tenant=tenant)
    async with s.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            await lease.append(sid, layer, *kv(N, seed * 10 + layer))
    await s.release(sid)


async def cached_kv(s: KVStore, seed: int) -> int:
    """Re-add sequence `seed`'s prompt; check the cached KV is bit-exact; return its tokens."""
    sid = f"again-{seed}"
    n = await s.add_sequence(sid, tokens(seed))
    async with s.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            k, v = kv(N, seed * 10 + layer)
            got_k, got_v = lease.kv(sid, layer)
            assert torch.equal(got_k[:, :n], k[:, :n]), (seed, layer)
            assert torch.equal(got_v[:, :n], v[:, :n]), (seed, layer)
    await s.release(sid)
    return n


async def fill_many(s: KVStore, seeds: range) -> None:
    for i in seeds:
        await fill(s, f"s{i}", i)
    await s.drain()
