"""The mmap tier (tierkv.mmap_tier), a plug-in tier: registered through the public path alone
(`register_tier` + its moves), run by `KVStore(tiers=[...])` with KV read back bit-exact, a
damaged page a counted miss, bad configurations typed errors with nothing left behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tierkv import Device, Host
from tierkv import errors as e
from tierkv.chain_plugins import PLUGINS
from tierkv.keys import KEY_BYTES, page_key, prefix_keys
from tierkv.mmap_tier import MAGIC, MMAP, Mmap, MmapForeignFileError, MmapInUseError, MmapTier
from tierkv.store import KVStore
from tierkv.tier import Holds, Tier
from tierkv.tier_names import HOST

sys.path.insert(0, str(Path(__file__).parent))
from store_kv import PAGE, SPEC, cached_kv, fill, tokens

SEQS = 8  # sequences of two full blocks (8 pages of content) each: 64 pages, the host holds 8


def _map(store: KVStore) -> MmapTier:
    tier = store.tiers.chain[-1]
    assert isinstance(tier, MmapTier)
    return tier


@pytest.mark.parametrize("device", [False, True], ids=["host-first", "device-first"])
async def test_a_store_reads_kv_back_bit_exact_through_the_mmap_tier(
    tmp_path: Path, device: bool
) -> None:
    assert PLUGINS[MMAP] is Mmap  # registered by importing its module, nothing else
    chain = [Host(bytes=8 * PAGE), Mmap(path=tmp_path / "kv.map", bytes=80 * PAGE)]
    if device:
        chain.insert(0, Device(bytes=6 * PAGE))
    async with KVStore(SPEC, tiers=chain) as s:
        tier = _map(s)
        assert isinstance(tier, Tier) and tier.medium == MMAP and tier.holds is Holds.CONTENT
        assert (HOST, MMAP) in s.tiers.moves.pairs() and (MMAP, HOST) in s.tiers.moves.pairs()
        for i in range(SEQS):
            await fill(s, f"s{i}", i)
        await s.drain()
        assert tier.stats()["used"] > 0  # the host's victims went down
        assert [await cached_kv(s, i) for i in range(SEQS)] == [8] * SEQS  # bit-exact
        st = s.stats()[MMAP]
        assert st["hits"] > 0 and st["imported"] == st["hits"] and st["corrupt"] == 0
        s.check()
    assert not (tmp_path / "kv.map").exists()  # scratch: removed at close


async def test_a_damaged_page_is_a_counted_miss_never_served(tmp_path: Path) -> None:
    chain = [Host(bytes=8 * PAGE), Mmap(path=tmp_path / "kv.map", bytes=80 * PAGE)]
    async with KVStore(SPEC, tiers=chain) as s:
        for i in range(SEQS):
            await fill(s, f"s{i}", i)
        await s.drain()
        tier = _map(s)
        blocks = prefix_keys(tokens(0), SPEC.page_tokens)
        first = [page_key(b, j) for b in blocks for j in range(SPEC.num_layers)]
        held = [k for k, h in zip(first, tier.lookup(first), strict=True) if h]
        assert held  # sequence 0's pages left the host for the map
        slot = tier.pin_reads(held[:1])[0]
        tier.end_reads(held[:1], [slot], None)
        tier.rows[slot, 7] ^= 0x40  # one bit flipped in the mapped file
        n = await cached_kv(s, 0)  # whatever it finds is bit-exact (checked inside)
        assert n < 8 and tier.stats()["corrupt"] == 1
        assert tier.lookup(held[:1]) == [False]  # dropped, never found again
        s.check()


def test_bad_configurations_are_typed_errors_with_nothing_left(tmp_path: Path) -> None:
    with pytest.raises(e.TierTypeError):
        Mmap(path=3, bytes=PAGE)  # type: ignore[arg-type]
    with pytest.raises(e.TierSizeError):  # at construction, before anything is opened
        KVStore(SPEC, tiers=[Host(bytes=8 * PAGE), Mmap(path=tmp_path / "m", bytes=PAGE - 1)])
    with pytest.raises(e.TierConfigError, match="not a directory"):
        MmapTier.open(tmp_path / "no" / "m", page_bytes=PAGE, nbytes=4 * PAGE)
    first = MmapTier.open(tmp_path / "m", page_bytes=PAGE, nbytes=4 * PAGE)
    try:
        with pytest.raises(MmapInUseError):  # a second store on the file: its lock
            MmapTier.open(tmp_path / "m", page_bytes=PAGE, nbytes=4 * PAGE)
        assert (tmp_path / "m").exists()  # the first one's file stays
    finally:
        first.close()
        first.close()  # idempotent
    assert list(tmp_path.iterdir()) == []


async def test_a_store_on_a_map_in_use_fails_to_open_and_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "kv.map"
    chain = [Host(bytes=8 * PAGE), Mmap(path=path, bytes=16 * PAGE)]
    async with KVStore(SPEC, tiers=chain):
        with pytest.raises(MmapInUseError):
            await KVStore(SPEC, tiers=chain).open()
        assert path.exists()


def test_the_tiers_slots_are_two_phase() -> None:
    import tempfile

    def key(i: int) -> bytes:
        b = bytearray(i.to_bytes(KEY_BYTES, "little"))
        b[0] &= 0x7F
        return page_key(bytes(b), 0)

    with tempfile.TemporaryDirectory() as d:
        tier = MmapTier.open(Path(d) / "m", page_bytes=PAGE, nbytes=3 * PAGE)
        try:
            keys = [key(i) for i in range(4)]
            r = tier.reserve(keys)
            assert [k for k, _ in r] == keys[:3] and tier.lookup(keys) == [False] * 4
            tier.commit(r[:2], [True, False])
            tier.abort(r[2:])
            assert tier.lookup(keys) == [True, False, False, False]
            assert tier.reserve(keys[:1]) == []  # held already
            r = tier.reserve(keys[1:3])
            tier.commit(r, [True, True])
            slot = tier.pin_reads(keys[:1])  # a read in flight keeps its slot
            assert tier.make_room(3) == 3 and tier.stats()["free"] == 2
            tier.end_reads(keys[:1], slot, [True])
            assert tier.stats()["free"] == 3 and tier.free(keys) == 0
        finally:
            tier.close()


def test_a_path_that_is_not_a_plain_file_of_ours_is_refused_and_left_alone(
    tmp_path: Path,
) -> None:
    """The map's file is truncated at open and removed at close: a symbolic link (in a shared
    /dev/shm, anyone's) or a device or FIFO is refused before anything is written through it,
    and a NUL in the path is a typed error, not the OS's ValueError."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    for path in (tmp_path / "link", tmp_path / "fifo", "/dev/null"):
        with pytest.raises(e.TierConfigError, match=r"symbolic link|not a regular file"):
            MmapTier.open(path, page_bytes=PAGE, nbytes=4 * PAGE)
    assert victim.read_bytes() == b"precious"  # the old open truncated it through the link
    assert (tmp_path / "link").is_symlink() and (tmp_path / "fifo").exists()
    with pytest.raises(e.TierConfigError, match="NUL"):
        MmapTier.open(f"{tmp_path}/a\0b", page_bytes=PAGE, nbytes=4 * PAGE)
    with pytest.raises(e.TierConfigError, match="NUL"):
        Mmap(path=f"{tmp_path}/a\0b", bytes=4 * PAGE)


def test_the_budget_follows_the_built_in_entries_rule() -> None:
    """An int >= 0, numpy ints too (as Host takes them), never a bool or a float."""
    assert Mmap(path="m", bytes=np.int64(4 * PAGE)).bytes == 4 * PAGE
    for bad, error in (
        (True, e.TierTypeError),
        (4.0 * PAGE, e.TierTypeError),
        (-1, e.TierSizeError),
    ):
        with pytest.raises(error):
            Mmap(path="m", bytes=bad)  # type: ignore[arg-type]


def test_a_file_that_is_not_a_map_of_ours_is_refused_untouched(tmp_path: Path) -> None:
    """A mistyped path must not destroy a user's file: the old open truncated any regular file
    at the path (and removed it at close). A non-empty file without our header is refused,
    bytes and size unchanged, unless overwrite=True; an empty file, or one a crashed store of
    ours left (the header), is taken over."""
    victim = tmp_path / "notes.txt"
    victim.write_bytes(b"precious" * 1000)
    for open_it in (
        lambda: MmapTier.open(victim, page_bytes=PAGE, nbytes=4 * PAGE),
        lambda: Mmap(path=victim, bytes=4 * PAGE).open(SPEC),
    ):
        with pytest.raises(MmapForeignFileError, match="overwrite=True"):
            open_it()
        assert victim.read_bytes() == b"precious" * 1000
    assert issubclass(MmapForeignFileError, e.TierConfigError)
    with pytest.raises(e.TierTypeError):
        Mmap(path=victim, bytes=4 * PAGE, overwrite="yes")  # type: ignore[arg-type]
    with pytest.raises(e.TierTypeError):
        MmapTier.open(victim, page_bytes=PAGE, nbytes=4 * PAGE, overwrite=1)  # type: ignore[arg-type]
    assert victim.read_bytes() == b"precious" * 1000

    left = tmp_path / "left.map"  # a crashed store's file: its header names it ours
    tier = MmapTier.open(left, page_bytes=PAGE, nbytes=4 * PAGE)
    assert left.read_bytes()[: len(MAGIC)] == MAGIC and tier.capacity == 4
    copy = tmp_path / "copy.map"
    copy.write_bytes(left.read_bytes())
    tier.close()
    again = MmapTier.open(copy, page_bytes=PAGE, nbytes=2 * PAGE)
    assert again.capacity == 2
    again.close()
    assert not copy.exists()

    empty = tmp_path / "empty"
    empty.touch()
    MmapTier.open(empty, page_bytes=PAGE, nbytes=PAGE).close()

    taken = MmapTier.open(victim, page_bytes=PAGE, nbytes=4 * PAGE, overwrite=True)
    assert taken.capacity == 4
    taken.close()
    assert not victim.exists()  # asked for: truncated, and removed at close


async def test_a_store_on_a_foreign_file_fails_to_open_and_leaves_it(tmp_path: Path) -> None:
    victim = tmp_path / "model.bin"
    victim.write_bytes(bytes(range(256)) * 64)
    chain = [Host(bytes=8 * PAGE), Mmap(path=victim, bytes=16 * PAGE)]
    with pytest.raises(MmapForeignFileError):
        await KVStore(SPEC, tiers=chain).open()
    assert victim.read_bytes() == bytes(range(256)) * 64
    chain = [Host(bytes=8 * PAGE), {"tier": "mmap", "path": victim, "bytes": 16 * PAGE}]
    with pytest.raises(MmapForeignFileError):
        await KVStore(SPEC, tiers=chain).open()
    chain[1]["overwrite"] = True  # type: ignore[index]
    async with KVStore(SPEC, tiers=chain) as s:
        await fill(s, "s0", 0)
        s.check()
    assert not victim.exists()
