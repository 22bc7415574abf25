"""The remote tier's moves as handlers of the core's registry (issue 25, point 1): host ->
remote (the push's staging gather, carrying the pages' checksums to the source) and remote ->
host (a source's read as an engine job, reporting the checksums it verified in the batch's
`PageCheck`); the remote tier is a `Tier` at the end of the chain."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tierkv import Device, Host, Remote
from tierkv.page_sums import PageCheck, row_sums
from tierkv.remote_tier import StoreRemote
from tierkv.store import KVStore
from tierkv.tier import Holds, Tier
from tierkv.tier_names import DEVICE, HOST, REMOTE

sys.path.insert(0, str(Path(__file__).parent))
from dict_source import DictSource
from store_kv import PAGE, SPEC, cached_kv, fill


class CheckingSource(DictSource):
    """A source that takes declared checksums on publish and verifies them on load: a page
    whose bytes no longer match is dropped and counted corrupt (the read stops there)."""

    checks_pages = True

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[bytes, int] = {}

    async def publish(
        self, keys: list[bytes], array: Any, slots: list[int], sums: list[int] | None = None
    ) -> int:
        assert sums is not None and len(sums) == len(keys)  # declared by the push move
        assert sums == row_sums(array, slots)  # as the staged bytes are
        self.sums.update(zip(keys, sums))
        return await super().publish(keys, array, slots)

    async def load(  # type: ignore[override]
        self, keys: list[bytes], array: Any, slots: list[int], check: PageCheck | None = None
    ) -> int:
        assert check is not None  # the batch's check, handed over by the import move
        n = await super().load(keys, array, slots)
        for i in range(n):
            if row_sums(array, [slots[i]])[0] != self.sums[keys[i]]:
                check.corrupt += n - i
                return i
            check.sums.append(self.sums[keys[i]])
        return n


async def test_pushes_and_imports_are_registered_moves_with_checksums() -> None:
    source = CheckingSource()
    chain = [Device(bytes=6 * PAGE), Host(bytes=8 * PAGE), Remote(sources=[source])]
    async with KVStore(SPEC, tiers=chain, remote_push_wait=1.0) as first:
        moves = first.tiers.moves
        assert (HOST, REMOTE) in moves.pairs() and (REMOTE, HOST) in moves.pairs()
        remote = first.tiers.chain[-1]
        assert isinstance(remote, StoreRemote) and isinstance(remote, Tier)
        assert [t.medium for t in first.tiers.chain] == [DEVICE, HOST, REMOTE]
        assert remote.holds is Holds.CONTENT
        for i in range(6):  # the host fills: victims pushed through the (host, remote) move
            await fill(first, f"s{i}", i)
        await first.drain()
        assert await remote.flush(5.0)
        assert remote.counters.hits == 0 and remote.pusher is not None
        assert remote.pusher.counters.pushed > 0 and source.sums
    key = next(iter(source.pages))
    async with KVStore(SPEC, tiers=[Host(bytes=8 * PAGE), Remote(sources=[source])]) as second:
        assert await cached_kv(second, 0) == 8  # imported by the (remote, host) move
        held = [k for k in source.sums if second.tiers.holds(k)]
        assert held  # their checksums are the ones the source verified (via the batch)
        assert second.tiers.table.sums(held) == [source.sums[k] for k in held]
        second.check()
    # a page damaged at the source: the read reports it corrupt, the store counts it and
    # serves no byte of it
    damaged = bytearray(source.pages[key])
    damaged[0] ^= 0xFF
    source.pages[key] = bytes(damaged)
    async with KVStore(SPEC, tiers=[Host(bytes=8 * PAGE), Remote(sources=[source])]) as third:
        for i in range(6):
            await third.add_sequence(f"r{i}", [1000 * i + j for j in range(10)])
        assert sum(third.tiers.stats.corrupt.values()) >= 1
        assert not third.tiers.holds(key)
        third.check()


async def test_the_remote_tiers_slots_are_its_staging_rows() -> None:
    source = DictSource()
    remote = StoreRemote([source], PAGE, push_pages=4)
    keys = [bytes([i]) * 18 for i in range(6)]
    reserved = remote.reserve(keys)
    assert [k for k, _ in reserved] == keys[:4]  # four rows
    assert remote.lookup(keys) == [True] * 4 + [False] * 2
    assert remote.reserve(keys[:2]) == []  # staged already
    remote.commit(reserved[:3], [True, True, False])
    assert remote.lookup(keys[:4]) == [True, True, False, True]
    remote.abort(reserved[3:])
    assert remote.lookup(keys) == [True, True] + [False] * 4
    assert remote.make_room(3) == 1  # the oldest staged page goes
    assert remote.free(keys) == 1 and remote.lookup(keys) == [False] * 6
    assert remote.pusher is not None and remote.pusher.counters.dropped == 2
