"""The tier core's arenas as `Tier`s (issue 25, point 2) and the media their moves are keyed by.

A store's chain is a list of `Tier` objects end to end (`TierSet.chain`): the core's arenas
(device, host, cold: `ArenaTier`, each over its column of the page table, the one owner of its
slots) then the lower chain's tiers. Each move is looked up by the media of its two ends; a
host-first store's leased tier is in host memory, so its moves are keyed by ``host`` (there is
no device medium in such a store).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from tierkv import Cold, Device, Disk, Host
from tierkv.arena_tier import ArenaTier
from tierkv.jobs import job_done
from tierkv.keys import KEY_BYTES, page_key
from tierkv.store import KVStore
from tierkv.tier import Batch, Holds, Target, Tier
from tierkv.tier_names import COLD, DEVICE, DISK, HOST

sys.path.insert(0, str(Path(__file__).parent))
from store_kv import PAGE, SLOT, SPEC, cached_kv, fill

NONE_PAGE = PAGE + 128  # a page encoded by the "none" codec


def block(i: int) -> bytes:
    b = bytearray(i.to_bytes(KEY_BYTES, "little"))
    b[0] &= 0x7F  # a content key
    return bytes(b)


async def test_a_host_first_stores_moves_are_keyed_by_host_memory(tmp_path: Path) -> None:
    """Regression: a host-first store registered the codec's moves from ``device`` (the core's
    column name) and device <-> host copies with no second arena, while the lower chain looked
    its moves up under ``host``: one store, two names for the one leased arena in host memory."""
    chain = [
        Host(bytes=8 * PAGE),
        Cold(codec="none", bytes=12 * NONE_PAGE),
        Disk(path=tmp_path, bytes=64 * SLOT),
    ]
    async with KVStore(SPEC, tiers=chain) as s:
        assert s.tiers.moves.pairs() == sorted(
            [(HOST, COLD), (COLD, HOST), (HOST, DISK), (DISK, HOST)]
        )
        for i in range(6):  # the leased tier's victims go to disk and cold by those moves
            await fill(s, f"s{i}", i)
        await s.drain()
        assert [await cached_kv(s, i) for i in range(6)] == [8] * 6
        s.check()


async def test_the_chain_is_tier_objects_end_to_end(tmp_path: Path) -> None:
    chain = [
        Device(bytes=6 * PAGE),
        Host(bytes=8 * PAGE),
        Cold(codec="none", bytes=12 * NONE_PAGE),
        Disk(path=tmp_path, bytes=64 * SLOT),
    ]
    async with KVStore(SPEC, tiers=chain) as s:
        tiers = s.tiers.chain
        assert all(isinstance(t, Tier) for t in tiers)
        assert [t.medium for t in tiers] == [DEVICE, HOST, COLD, DISK]
        assert [t.holds for t in tiers] == [Holds.ANY] * 3 + [Holds.CONTENT]
        core = [t for t in tiers if isinstance(t, ArenaTier)]
        assert [t.stats()["capacity"] for t in core] == [6, 8, 12]
    async with KVStore(SPEC, tiers=[Host(bytes=8 * PAGE)]) as s:
        (leased,) = s.tiers.chain
        assert isinstance(leased, ArenaTier) and leased.medium == HOST
        assert leased.name == DEVICE  # (the core's leased column, in host memory)


async def test_an_arena_tier_moves_its_slots_by_registered_moves_only() -> None:
    """The host arena as a Tier: two-phase slots (a reservation is found once committed), its
    bytes written by the (device, host) move of the registry, bit-exact; free drops idle
    copies; make_room drops only copies another exact copy holds."""
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, codec=None) as s:
        core = s.tiers
        device, host = (t for t in core.chain if isinstance(t, ArenaTier))
        keys = [page_key(block(i), 0) for i in range(3)]
        dev = await core.reserve_device(keys)
        rng = np.random.default_rng(3)
        pages = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in keys]
        for p, slot in zip(pages, dev, strict=True):
            device.arena.array[slot] = p
        core.commit_device(keys)
        reserved = host.reserve(keys)
        assert [k for k, _ in reserved] == keys and host.lookup(keys) == [False] * 3
        move = core.moves.get(device.medium, host.medium)
        target = Target(host.arena, [slot for _, slot in reserved])
        await job_done(move(core.engine, target, Batch(keys, device.arena, dev)))
        host.commit(reserved, [True, True, False])  # the third write "failed": never found
        assert host.lookup(keys) == [True, True, False]
        for (_, slot), p in zip(reserved[:2], pages[:2], strict=True):
            assert np.array_equal(host.arena.array[slot], p)
        # the device copies are dirty (newer than their host copies, or without one): kept
        assert device.make_room(6) == 0 and device.lookup(keys) == [True] * 3
        assert await core.pages.write_behind(keys) == 3  # written down: clean now
        assert device.make_room(6) == 3 and device.lookup(keys) == [False] * 3
        assert host.make_room(8) == 0  # their host copies are the only ones left
        assert host.free(keys) == 3 and host.lookup(keys) == [False] * 3
        core.check()


def test_the_page_server_names_the_host_tier_through_the_core() -> None:
    """Regression: the page server's directory and server named the host column ``HOST``
    (eight places) while the core's glue, the chain and the remote tier use ``tiers.top``;
    only the refusal of a store without a host tier (hosting.py) compares with the name."""
    import ast

    server = Path(__file__).resolve().parents[2] / "tierkv" / "remote" / "server"
    named = []
    for path in sorted(server.glob("*.py")):
        if path.name == "hosting.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == "HOST":
                named.append(f"{path.name}:{node.lineno}")
    assert named == []


async def test_room_is_made_past_victims_whose_host_copies_are_busy() -> None:
    """Regression (issue 25's follow-up: a TierFullError after a device-room wait with most
    device pages evictable). The eviction put back victims whose host copies were busy (a
    copy reading or writing them: pinned only transiently) and then waited for a change,
    retrying the same victims each time, although clean pages with idle host copies could go
    at once: with a holder that outlives the wait, the wait ran out with the device full of
    evictable pages. Now the eviction passes over them and takes the next victims."""
    async with KVStore(
        SPEC, device_bytes=8 * PAGE, host_bytes=16 * PAGE, codec=None, policy="lru"
    ) as s:
        core = s.tiers
        keys = [page_key(block(i), 0) for i in range(8)]
        for k in keys:  # one at a time: the first ones are the least recently used
            await core.reserve_device([k])
            core.commit_device([k])
        assert await core.pages.write_behind(keys) == 8  # clean, each with a host copy
        old = keys[:2]
        core.pages.mark_dirty(old)  # written again: newer than their host copies ...
        core.glue.pin_host(old)  # ... which something else reads now (a push, an export)
        try:
            new = [page_key(block(100 + i), 0) for i in range(2)]
            await core.reserve_device(new, timeout=0.5)  # TierFullError on the old code
            core.commit_device(new)
            assert core.table.present(old, DEVICE) == old  # the busy ones stayed, dirty
            assert len(core.table.present(keys[2:], DEVICE)) == 4  # two clean ones went
        finally:
            core.glue.unpin_host(old)
        s.check()
