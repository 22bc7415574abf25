"""Cache salts (issue 29): a salt is mixed into the first block's content key, so a prompt
cached under one salt is never a hit under another (or under none) in any local tier: device,
host, cold, disk; without a salt the keys are exactly the unsalted ones of before."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tierkv import KVStore, prefix_keys
from tierkv.errors import InvalidTypeError, TenantError
from tierkv.keys import page_key, root_key
from tierkv.prompt import prompt_keys

sys.path.insert(0, str(Path(__file__).parent))
from store_kv import PAGE, SPEC, N, fill, store, tokens

# prefix_keys(list(range(32)), 16) before salts existed (tests/tierkv/test_prompt.py too)
UNSALTED = ["77e6dc863351cc8a13f8e4dfcd2529a4"]


def test_no_salt_gives_the_keys_of_before_byte_for_byte() -> None:
    assert prefix_keys(list(range(32)), 16)[1].hex() == UNSALTED[0]
    assert prefix_keys(list(range(32)), 16, salt=None) == prefix_keys(list(range(32)), 16)
    assert root_key("ns", None) == root_key("ns")
    assert prefix_keys(list(range(32)), 16, "ns")[0].hex() == "516b140246d5ff8fa9776a4990141bbd"


def test_salts_separate_every_block_and_str_equals_its_utf8() -> None:
    toks = list(range(64))
    plain = prefix_keys(toks, 16)
    a = prefix_keys(toks, 16, salt="tenant-a")
    b = prefix_keys(toks, 16, salt="tenant-b")
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert prefix_keys(toks, 16, salt=b"tenant-a") == a
    assert prefix_keys(toks, 16, salt="é") == prefix_keys(toks, 16, salt="é".encode())
    # a salt is not a namespace: ("ns", salt) never meets another namespace's keys
    assert prefix_keys(toks, 16, "x", salt="y") != prefix_keys(toks, 16, "y", salt="x")
    ids, chained = asyncio.run(prompt_keys(toks, 16, salt=b"tenant-a"))
    assert chained == a and list(ids) == toks


@pytest.mark.parametrize("salt", [b"", "", "x" * 257, 7, ["a"], bytearray(b"a")])
def test_bad_salts_are_typed_errors(salt: object) -> None:
    with pytest.raises(TenantError):
        prefix_keys(list(range(16)), 16, salt=salt)  # type: ignore[arg-type]
    if not isinstance(salt, str | bytes):
        with pytest.raises(InvalidTypeError):
            prefix_keys(list(range(16)), 16, salt=salt)  # type: ignore[arg-type]


async def test_a_bad_salt_changes_nothing_in_the_store() -> None:
    async with KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=8 * PAGE, codec=None) as s:
        for bad in (b"", 3, "x" * 300, bytearray(b"s"), memoryview(b"s"), ["s"]):
            with pytest.raises(TenantError):
                await s.add_sequence("a", tokens(1), salt=bad)  # type: ignore[arg-type]
            with pytest.raises(TenantError):
                s.lookup(tokens(1), salt=bad)  # type: ignore[arg-type]
            with pytest.raises(TenantError):
                await s.fetch_prefix(tokens(1), salt=bad)  # type: ignore[arg-type]
        assert s.sequence_ids() == [] and s.stats()["tiers"]["device"]["used"] == 0
        s.check()


async def fill_salted(s: KVStore, sid: str, seed: int, salt: str | None) -> None:
    await fill(s, sid, seed, salt)
    await s.drain()


def pages(seed: int, salt: str | None) -> list[bytes]:
    blocks = prefix_keys(tokens(seed)[: (N - 1) // 4 * 4], 4, salt=salt)
    return [page_key(b, layer) for b in blocks for layer in range(SPEC.num_layers)]


async def probe(s: KVStore, seed: int, owner: str) -> None:
    """The prompt of ``seed`` is cached under ``owner`` only: another salt, or none, gets 0
    tokens from lookup, fetch_prefix and add_sequence, and the owner still gets its 8."""
    for other in ("intruder", None):
        assert s.lookup(tokens(seed), salt=other) == 0
        assert await s.fetch_prefix(tokens(seed), salt=other) == 0
        assert await s.add_sequence("probe", tokens(seed), salt=other) == 0
        await s.release("probe")
    assert s.lookup(tokens(seed), salt=owner) == 8


def tiers_holding(s: KVStore, keys: list[bytes]) -> set[str]:
    table = s.tiers.table
    return {t for k in keys for t in table.tiers_of(k)}


async def test_salted_pages_on_the_device_are_no_hit_for_another_salt() -> None:
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=16 * PAGE, codec=None) as s:
        await fill_salted(s, "a", 1, "owner")
        assert "device" in tiers_holding(s, pages(1, "owner"))
        await probe(s, 1, "owner")
        s.check()


async def test_salted_pages_in_the_host_tier_are_no_hit_for_another_salt() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=32 * PAGE, codec=None) as s:
        await fill_salted(s, "a", 1, "owner")
        for i in range(2, 6):  # other prompts push it off the device
            await fill_salted(s, f"o{i}", i, None)
        assert tiers_holding(s, pages(1, "owner")) == {"host"}
        await probe(s, 1, "owner")


async def test_salted_pages_in_the_cold_pool_are_no_hit_for_another_salt() -> None:
    async with KVStore(
        SPEC, device_bytes=6 * PAGE, host_bytes=32 * PAGE, codec="fp16", compress_after=1
    ) as s:
        await fill_salted(s, "a", 1, "owner")
        for i in range(2, 6):
            await fill_salted(s, f"o{i}", i, None)
        for _ in range(3):
            s.step()
            await s.drain()
        assert "cold" in tiers_holding(s, pages(1, "owner"))
        await probe(s, 1, "owner")


async def test_salted_pages_on_disk_are_no_hit_for_another_salt(tmp_path: Path) -> None:
    async with store(tmp_path) as s:
        await fill_salted(s, "a", 1, "owner")
        for i in range(2, 10):  # the host holds 8 pages: the salted ones go down to disk
            await fill(s, f"o{i}", i)
        await s.drain()
        keys = pages(1, "owner")
        assert not tiers_holding(s, keys) and all(s._chain.lookup(keys))  # type: ignore[union-attr]
        await probe(s, 1, "owner")
    async with store(tmp_path) as s2:  # a later process on the same disk: still apart
        await probe(s2, 1, "owner")
