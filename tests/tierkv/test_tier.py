"""The tier interface and the registry of moves (tierkv.tier), and the disk tier plugged into
it (tierkv.disk.tier): lookup by (source medium, destination medium), never by tier name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tierkv.chain import LowerChain
from tierkv.disk import StoreStatus
from tierkv.disk.tier import DiskTier, register_moves
from tierkv.errors import InvalidInputError, InvalidTypeError, UnknownNameError
from tierkv.keys import KEY_BYTES, page_key, private_key
from tierkv.runtime import TransferEngine, create_backend
from tierkv.tier import Batch, Holds, Moves, Tier, UnknownMoveError
from tierkv.tier_names import DISK, HOST

PAGE = 8192


def block(i: int) -> bytes:
    b = bytearray(i.to_bytes(KEY_BYTES, "little"))
    b[0] &= 0x7F  # a content key
    return bytes(b)


def _nop(*_: object) -> object:
    raise AssertionError("not called")


def test_moves_are_looked_up_by_the_pair_of_media() -> None:
    moves = Moves()
    moves.register("a", "b", _nop)
    assert moves.get("a", "b") is _nop and moves.has("a", "b")
    assert not moves.has("b", "a")
    with pytest.raises(UnknownMoveError, match="a->b"):
        moves.get("b", "a")
    assert issubclass(UnknownMoveError, UnknownNameError)
    assert moves.pairs() == [("a", "b")]


@pytest.mark.parametrize(
    ("source", "dest", "handler", "error"),
    [
        ("a", "b", _nop, InvalidInputError),  # registered twice
        ("a", "a", _nop, InvalidInputError),
        ("", "b", _nop, InvalidTypeError),
        (1, "b", _nop, InvalidTypeError),
        ("c", "d", "not callable", InvalidTypeError),
    ],
)
def test_bad_registrations_are_refused_and_change_nothing(
    source: object, dest: object, handler: object, error: type[Exception]
) -> None:
    moves = Moves()
    moves.register("a", "b", _nop)
    with pytest.raises(error):
        moves.register(source, dest, handler)  # type: ignore[arg-type]
    assert moves.pairs() == [("a", "b")]


def test_holds_content_takes_content_keys_only() -> None:
    content, private = page_key(block(1), 0), page_key(private_key("s", 0), 0)
    assert Holds.CONTENT.accepts(content) and not Holds.CONTENT.accepts(private)
    assert Holds.ANY.accepts(content) and Holds.ANY.accepts(private)


async def test_the_disk_tier_moves_pages_as_engine_jobs_through_the_registry(
    tmp_path: Path,
) -> None:
    moves = Moves()
    register_moves(moves)
    assert moves.pairs() == sorted([(HOST, DISK), (DISK, HOST)])
    backend = create_backend("cpu")
    host = backend.create_arena("host", slot_bytes=PAGE, num_slots=8, kind="pinned")
    ids = [int(i) for i in host.allocate(8)]
    keys = [page_key(block(i), 0) for i in range(3)]
    rng = np.random.default_rng(7)
    pages = [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in keys]
    for p, i in zip(pages, ids[:3], strict=True):
        host.array[i] = p
    tier = DiskTier.open(tmp_path, page_bytes=PAGE, disk_bytes=8 * (PAGE + 4096))
    try:
        assert isinstance(tier, Tier) and tier.medium == DISK
        async with TransferEngine(backend) as engine:
            saved = moves.get(HOST, tier.medium)(engine, tier, Batch(keys, host, ids[:3]))
            assert host.is_busy(ids[:3])  # pinned while the job runs
            await saved
            assert saved.result() == [StoreStatus.STORED] * 3
            assert tier.lookup([*keys, page_key(block(9), 0)]) == [True] * 3 + [False]
            loaded = moves.get(tier.medium, HOST)(engine, tier, Batch(keys, host, ids[3:6]))
            await loaded
            assert loaded.result() == [True] * 3
            for p, i in zip(pages, ids[3:6], strict=True):
                assert np.array_equal(host.array[i], p)  # bit-exact
        # the two-phase slots of the interface: a reservation is found only once committed
        more = [page_key(block(i), 1) for i in range(2)]
        r = tier.reserve(more)
        assert tier.lookup(more) == [False, False]
        tier.commit(r[:1], [False])  # a failed write is never found
        tier.abort(r[1:])
        assert tier.lookup(more) == [False, False]
        assert tier.free(keys[:1]) == 1 and tier.lookup(keys[:1]) == [False]
        assert tier.make_room(8) == 2  # the two left, least recently used first
        assert tier.stats()["used"] == 0
    finally:
        tier.close()


def test_a_chain_refuses_a_tier_without_moves(tmp_path: Path) -> None:
    tier = DiskTier.open(tmp_path, page_bytes=PAGE, disk_bytes=8 * (PAGE + 4096))
    try:
        assert isinstance(tier, Tier)
        with pytest.raises(UnknownMoveError):
            LowerChain([tier], lambda moves: None, timeout=5.0)
    finally:
        tier.close()


async def test_a_disk_stores_moves_are_the_cores_registry(tmp_path: Path) -> None:
    """The chain's host <-> disk moves join the tier core's `Moves` (one registry per store)."""
    from tierkv.store import KVStore
    from tierkv.tier_names import DEVICE

    from .test_store import PAGE as STORE_PAGE
    from .test_store import SPEC

    size = 16 * (STORE_PAGE + 4096)
    async with KVStore(
        SPEC,
        device_bytes=4 * STORE_PAGE,
        host_bytes=8 * STORE_PAGE,
        codec=None,
        disk_path=tmp_path,
        disk_bytes=size,
    ) as store:
        assert store.tiers.moves.pairs() == sorted(
            [(DEVICE, HOST), (HOST, DEVICE), (HOST, DISK), (DISK, HOST)]
        )


async def test_the_core_moves_are_handlers_looked_up_by_media() -> None:
    """Issue 25, point 1: device <-> host copies, host -> cold encode and cold -> device / host
    decode are handlers of the core's `Moves` registry; a decode into the host gives the same
    bytes as one into the device (one handler, any target arena)."""
    import torch

    from tierkv.jobs import job_done
    from tierkv.store import KVStore
    from tierkv.tier import Target
    from tierkv.tier_names import COLD, DEVICE

    from .test_store import PAGE, SPEC, fill

    async with KVStore(SPEC, device_bytes=4 * PAGE, host_bytes=8 * PAGE, codec=None) as plain:
        assert plain.tiers.moves.pairs() == [(DEVICE, HOST), (HOST, DEVICE)]
    async with KVStore(SPEC, device_bytes=4 * PAGE, host_bytes=16 * PAGE, codec="fp16") as store:
        tiers = store.tiers
        assert tiers.moves.pairs() == sorted(
            [(DEVICE, HOST), (HOST, DEVICE), (HOST, COLD), (COLD, DEVICE), (COLD, HOST)]
        )
        await fill(store, "a", 1, n=8)
        await fill(store, "b", 2, n=8)  # a's pages leave the device (written back)
        await store.drain()
        pages = store.sequence("a").all_pages()
        assert await tiers.cold.compress_idle(pages) == len(pages)  # the (host, cold) move
        key = store.sequence("a").all_pages()[0]
        cold_slot = tiers.table.slot(key, COLD)
        spare = [page_key(block(200), 0)]
        alloc = tiers.glue.reserve_host(spare)
        assert alloc is not None
        dev = await tiers.reserve_device(spare)
        arenas = tiers._arenas
        try:
            for dst, slots in ((HOST, alloc.slots), (DEVICE, dev)):
                move = tiers.moves.get(COLD, dst)
                batch = Batch([key], arenas[COLD], [cold_slot])
                await job_done(move(tiers.engine, Target(arenas[dst], slots), batch))
            assert torch.equal(
                arenas[HOST].tensor[alloc.slots[0]], arenas[DEVICE].tensor[dev[0]].cpu()
            )
            assert arenas[HOST].tensor[alloc.slots[0]].any()  # a page was decoded
        finally:
            tiers.glue.commit_host(spare, ok=False)
            tiers.abort_device(spare, pinned=False, owned=False)
        store.check()
