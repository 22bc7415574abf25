"""The disk tier's admission filter (`tierkv.disk.admission.SeenTwice`): a page evicted from the
host is written on its second offer only, within a bounded memory; a store closing still writes
its pages down whatever the filter says (a restart finds them)."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest

from tierkv.chain_config import Device, Disk, Host
from tierkv.disk.admission import SeenTwice
from tierkv.disk.tier import DiskTier
from tierkv.errors import InvalidInputError, InvalidTypeError, TierTypeError
from tierkv.store import KVStore

sys.path.insert(0, str(Path(__file__).parent))
from store_kv import SPEC
from test_store_disk import PAGE, SLOT, cached_kv, fill_many, store, tokens


def k(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=18).digest()


def test_admitted_on_the_second_offer() -> None:
    f = SeenTwice(1000)
    assert f.admit([k(1), k(2)]) == [False, False]
    assert f.admit([k(1), k(3)]) == [True, False]
    assert f.admit([k(4), k(4)]) == [False, True]  # twice in one call: the second is admitted
    assert f.admit([k(1)]) == [True]  # still remembered
    assert f.stats() == {"admitted": 3, "refused": 4, "memory": 1000}
    assert f.admit([]) == []


def test_memory_is_bounded_old_offers_are_forgotten() -> None:
    f = SeenTwice(100)
    f.admit([k(0)])
    f.admit([k(i) for i in range(1, 151)])  # 150 newer distinct offers: k(0) is forgotten
    assert f.admit([k(0)]) == [False]
    f.admit([k(i) for i in range(1000, 1040)])  # fewer than memory / 2 since: remembered
    assert f.admit([k(0)]) == [True]
    # the bits do not grow with the keys offered
    f.admit([k(i) for i in range(2000, 12000)])
    assert f.stats()["memory"] == 100
    assert sum(len(b.array) for b in (f._new, f._old)) == 2 * (50 * 10 // 8 + 1)


def test_first_offers_are_rarely_admitted_by_mistake() -> None:
    f = SeenTwice(20000)
    wrong = sum(f.admit([k(i) for i in range(10000)]))
    assert wrong < 300  # ~1% false positives at 10 bits a key (3 positions)


def test_bad_arguments_are_typed_errors_and_record_nothing() -> None:
    for memory in (0, 1, True, 2.5, "4"):
        with pytest.raises(InvalidInputError):
            SeenTwice(memory)  # type: ignore[arg-type]
    f = SeenTwice(100)
    for bad in ([k(1), b""], [k(1), "text"], [k(1), None]):
        with pytest.raises((InvalidInputError, InvalidTypeError)):
            f.admit(bad)  # type: ignore[arg-type]
    assert f.stats()["refused"] == 0 and f.admit([k(1)]) == [False]


def test_a_disk_tier_without_a_filter_admits_everything(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    tier = DiskTier.open(tmp_path / "a", page_bytes=PAGE, disk_bytes=8 * SLOT)
    try:
        assert tier.admit([k(1), k(1)]) == [True, True] and "admission" not in tier.stats()
    finally:
        tier.close()
    tier = DiskTier.open(tmp_path / "b", page_bytes=PAGE, disk_bytes=8 * SLOT, seen_twice=True)
    try:
        assert tier.admission is not None and tier.admission.memory == 4 * 8
        assert tier.admit([k(1)]) == [False] and tier.admit([k(1)]) == [True]
        assert tier.stats()["admission"]["admitted"] == 1
    finally:
        tier.close()


def filtered_store(path: Path) -> KVStore:
    """`store_kv.store`'s tiers, its disk with the admission filter (``Disk(seen_twice=True)``)."""
    return KVStore(
        SPEC,
        tiers=[
            Device(bytes=6 * PAGE),
            Host(bytes=8 * PAGE),
            Disk(path=path, bytes=64 * SLOT, seen_twice=True),
        ],
    )


async def test_a_store_writes_an_evicted_page_on_its_second_eviction(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    async with filtered_store(tmp_path / "d") as s:
        await fill_many(s, range(8))  # 32 pages, the host holds 8: evicted once each
        d = s.stats()["disk"]
        assert d["offered"] > 0 and d["not_admitted"] == d["offered"] and d["used"] == 0
        assert s.lookup(tokens(0)) == 0
        await fill_many(s, range(8, 16))  # pushes seeds 0-7's pages out of the host again
        await fill_many(s, range(8))  # seen again (recomputed), then evicted a second time
        await fill_many(s, range(8, 16))
        d = s.stats()["disk"]
        assert d["used"] > 0 and d["stored"] > 0 and d["write_failed"] == 0
        assert s.lookup(tokens(0)) == 8 and await cached_kv(s, 0) == 8
    async with store(tmp_path / "d") as s2:  # the first store's close wrote its host pages
        assert [await cached_kv(s2, i) for i in range(8, 16)] == [8] * 8


async def test_the_filter_is_off_by_default_and_checked(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    async with store(tmp_path / "d") as s:  # the keyword shorthand: no filter
        await fill_many(s, range(8))
        d = s.stats()["disk"]
        assert d["offered"] > 0 and d["not_admitted"] == 0 and d["used"] > 0
    with pytest.raises(TierTypeError, match="seen_twice"):
        Disk(path=tmp_path, bytes=64 * SLOT, seen_twice="yes")  # type: ignore[arg-type]
    assert sorted(os.listdir(tmp_path)) == ["d"]  # nothing created


def test_a_tier_deriving_from_the_protocol_admits_everything_by_default() -> None:
    from tierkv.tier import Tier

    class Plain(Tier):
        """A tier with no filter of its own."""

    assert Plain().admit([k(1), k(2)]) == [True, True]
