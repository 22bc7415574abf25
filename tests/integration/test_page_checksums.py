"""Page checksums end to end (tierkv/page_sums.py): corruption injected at each boundary (a page
server's host slots after publish, the bytes a reader got after the transport's own checks,
Redis values, the cold pool, a writer's declared checksums) is never served, and each corrupt
page is counted.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch

from tierkv import CorruptPageError, KVSpec, prefix_keys
from tierkv.keys import page_key
from tierkv.page_sums import NO_SUM, row_sums
from tierkv.page_table import PageTable
from tierkv.remote import PageServer, RemoteTier
from tierkv.remote.protocol.control import Control
from tierkv.remote.store_io import import_prefix, publish_prefix, stage_prefix
from tierkv.store import KVStore
from tierkv.tiers import COLD, DEVICE, HOST
from tierkv.transports.crc32c_native import crc32c, crc32c_rows
from tierkv.transports.tcp import TcpTransport

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SECRET = b"page-checksums-test"
TIMEOUT = 5.0
N = 128  # pages published to the server
BAD = 32  # of them flipped in its host tier


def content_keys(seed: int, n: int = N) -> list[bytes]:
    toks = np.random.default_rng(seed).integers(0, 1000, n // 2 * 4).tolist()
    return [page_key(b, layer) for b in prefix_keys(toks, 4) for layer in range(2)]


def pages(seed: int, n: int = N) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed + 1).integers(0, 256, (n, PAGE), np.uint8)


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@contextlib.asynccontextmanager
async def page_server(kind: str, pages: int = 2 * N) -> AsyncIterator[PageServer]:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=pages * PAGE, codec=None)
    async with store, PageServer(store, transports=[kind], secret=SECRET) as srv:
        yield srv


def peer(srv: PageServer, kind: str) -> RemoteTier:
    return RemoteTier(srv.address, transport=kind, secret=SECRET, spec=SPEC, timeout=TIMEOUT)


def flip(srv: PageServer, keys: list[bytes], rng: np.random.Generator) -> None:
    """Flip one random bit of each page of ``keys`` in the server's host tier."""
    table, host = srv.store.tiers.table, srv.store.tiers.glue.host_array
    for k in keys:
        pos = int(rng.integers(0, PAGE))
        host[table.slot(k, HOST), pos] ^= np.uint8(1 << int(rng.integers(0, 8)))


# -- the native batch ----------------------------------------------------------------------
def test_crc32c_rows_is_one_call_over_many_rows() -> None:
    rows = pages(0, 16)
    slots = [15, 0, 7, 7]
    assert crc32c_rows(rows, slots) == [crc32c(rows[s]) for s in slots]
    assert crc32c_rows(rows, []) == []
    with pytest.raises(IndexError):
        crc32c_rows(rows, [0, 16])


# -- the page table owns them ----------------------------------------------------------------
def test_a_checksum_lives_while_some_tier_holds_its_page_and_follows_a_rename() -> None:
    table = PageTable({"a": 4, "b": 4})
    for tier in ("a", "b"):
        alloc = table.prepare_store([b"k"], tier)
        assert alloc is not None
        table.complete_store([b"k"], tier)
    table.sums.set([b"k"], [7])
    table.remove([b"k"], "a")
    assert table.sums.get([b"k"]) == [7]  # b still holds it
    table.rekey([b"k"], [b"n"], "b")
    assert table.sums.get([b"k", b"n"]) == [NO_SUM, 7]
    table.check()
    table.remove([b"n"], "b")
    assert table.sums.get([b"n"]) == [NO_SUM] and not len(table.sums)
    table.check()


async def test_an_append_that_fills_a_page_seals_it() -> None:
    store = KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=16 * PAGE, codec=None)
    async with store:
        await store.add_sequence("s", list(range(6)))
        async with store.lease(["s"]) as lease:
            for layer in range(2):
                k, v = kv(6, layer)
                await lease.append("s", layer, k, v)  # one full page, one of 2 tokens
        seq = store.sequence("s")
        tiers = store.tiers
        for layer in range(2):
            full, part = (page_key(seq.block(b), layer) for b in (0, 1))
            slot = tiers.pages.device_slots([full])[0]
            assert tiers.table.sums([full, part]) == [crc32c(_device_rows(store)[slot]), NO_SUM]
        tiers.check()


def _device_rows(store: KVStore) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return store.tiers._arenas[DEVICE].array


# -- a page server's host slots, flipped after publish ---------------------------------------
@pytest.mark.parametrize("kind", ["tcp", "shm"])
async def test_pages_flipped_on_the_server_are_never_served(kind: str) -> None:
    rng = np.random.default_rng(1)
    keys, data = content_keys(1), pages(1)
    async with page_server(kind) as srv, peer(srv, kind) as writer, peer(srv, kind) as reader:
        assert await writer.publish(keys, data, list(range(N))) == N
        bad = sorted(rng.choice(N, BAD, replace=False).tolist())
        flip(srv, [keys[i] for i in bad], rng)
        out = np.zeros((N, PAGE), np.uint8)
        served = wrong = 0
        for i in range(N):  # one page per load: each is served or counted on its own
            got = await reader.load([keys[i]], out, [i])
            served += got
            wrong += got and not np.array_equal(out[i], data[i])
        assert (served, wrong, reader.corrupt) == (N - BAD, 0, BAD)
        # a whole-prefix load stops at the first corrupt page, and counts every corrupt one
        n = await reader.load(keys, out, list(range(N)))
        assert n == bad[0] and np.array_equal(out[:n], data[:n])
        assert reader.corrupt == 2 * BAD


async def test_a_second_store_never_imports_a_flipped_page() -> None:
    rng = np.random.default_rng(2)
    src = KVStore(SPEC, device_bytes=64 * PAGE, host_bytes=64 * PAGE, codec=None, timeout=TIMEOUT)
    dst = KVStore(SPEC, device_bytes=64 * PAGE, host_bytes=64 * PAGE, codec=None, timeout=TIMEOUT)
    prompt = list(range(41))  # 10 full blocks = 20 pages
    async with page_server("tcp") as srv, peer(srv, "tcp") as p, src, dst:
        await src.add_sequence("s", prompt)
        ref = {}
        async with src.lease(["s"]) as lease:
            for layer in range(2):
                ref[layer] = kv(41, layer)
                await lease.append("s", layer, *ref[layer])
        await src.release("s")
        await stage_prefix(src, prompt)
        assert await publish_prefix(src, p, prompt) == 20
        served = [k for k in srv.store.tiers.table.keys(HOST)]
        blocks = prefix_keys(prompt[:40], 4)
        keys = [page_key(b, layer) for b in blocks for layer in range(2)]
        assert set(keys) == set(served)
        flip(srv, [keys[12]], rng)  # block 6, layer 0
        cached = await import_prefix(dst, p, prompt)
        assert cached == 6 * 4  # the blocks before the flipped one
        assert dst.stats()["corrupt_pages"]["peer"] == 1
        await dst.add_sequence("s", prompt)
        async with dst.lease(["s"]) as lease:
            for layer in range(2):
                k, v = lease.kv("s", layer)
                assert torch.equal(k[:, :cached], ref[layer][0][:, :cached])
                assert torch.equal(v[:, :cached], ref[layer][1][:, :cached])
        dst.check()


# -- the bytes a reader got, after the transport's frame check --------------------------------
async def test_bytes_flipped_after_the_transport_are_caught_by_the_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys, data = content_keys(3), pages(3)
    async with page_server("tcp") as srv, peer(srv, "tcp") as writer, peer(srv, "tcp") as reader:
        assert await writer.publish(keys, data, list(range(N))) == N
        real = TcpTransport._transfer

        async def tampered(self: TcpTransport, direction: Any, ops: Any, *args: Any) -> None:
            await real(self, direction, ops, *args)  # every frame checked by its CRC
            if direction == "read":  # then the last page of each read changes
                last = ops[-1]
                last.local.view[last.local_offset + 5] ^= 0x10

        monkeypatch.setattr(TcpTransport, "_transfer", tampered)
        out = np.zeros((N, PAGE), np.uint8)
        assert await reader.load(keys[:8], out, list(range(8))) == 7
        assert np.array_equal(out[:7], data[:7]) and reader.corrupt == 1


# -- what a writer declares, checked by the server at commit --------------------------------
async def test_the_server_stores_only_pages_that_match_what_the_writer_declared() -> None:
    keys, data = content_keys(4, 8), pages(4, 8)
    async with page_server("tcp") as srv, peer(srv, "tcp") as writer:
        sums = row_sums(data, list(range(8)))
        sums[3] ^= 1  # a page whose bytes changed after its checksum was taken
        with pytest.raises(CorruptPageError) as err:
            await writer.publish(keys, data, list(range(8)), sums=sums)
        assert (err.value.pages, err.value.stored, err.value.tier) == (1, 7, "peer")
        table = srv.store.tiers.table
        assert table.lookup([keys[3]], HOST) == 0 and len(table.readable(keys, HOST)) == 7
        assert srv.stats()["corrupt_pages_total"] == 1


async def test_a_writer_that_declares_no_checksums_stores_nothing() -> None:
    keys, data = content_keys(5, 4), pages(5, 4)
    async with page_server("tcp") as srv, peer(srv, "tcp") as writer:
        ctl = Control(srv.address, secret=SECRET, timeout=TIMEOUT)
        await ctl.open()
        try:
            rep = await ctl.call("reserve", keys=keys)  # an old client: no "sums"
            await writer._transfer("write", data, list(range(4)), rep["slots"])
            done = await ctl.call("commit", lease=rep["lease"], ok=True)
        finally:
            await ctl.aclose()
        assert (done["stored"], done["corrupt"]) == (0, 4)
        assert srv.store.tiers.table.lookup(keys, HOST) == 0
        srv.store.tiers.check()


# -- the cold pool ------------------------------------------------------------------------------
def _cold_store(codec: str) -> KVStore:
    return KVStore(
        SPEC,
        device_bytes=8 * PAGE,
        host_bytes=12 * PAGE,
        codec=codec,
        cold_fraction=0.5,
        timeout=TIMEOUT,
    )


async def _cold_only(store: KVStore, prompt: list[int]) -> list[bytes]:
    """The 4 content pages of ``prompt`` (9 tokens: 2 full blocks), released and moved to
    the cold tier alone."""
    await store.add_sequence("s", prompt)
    async with store.lease(["s"]) as lease:
        for layer in range(2):
            await lease.append("s", layer, *kv(9, layer))
    await store.release("s")
    await stage_prefix(store, prompt)
    keys = [page_key(b, layer) for b in prefix_keys(prompt[:8], 4) for layer in range(2)]
    store.tiers.cold.forget_in(DEVICE, keys)
    assert await store.tiers.cold.compress_idle(keys) == 4
    return keys


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_flipped_cold_payload_is_never_decoded(codec: str) -> None:
    store = _cold_store(codec)
    async with store:
        prompt = list(range(9))
        keys = await _cold_only(store, prompt)
        tiers = store.tiers
        cold = tiers._arenas[COLD].array
        cold[tiers.table.slot(keys[2], COLD), 40] ^= 0x04
        await store.add_sequence("t", prompt)
        with pytest.raises(CorruptPageError):
            async with store.lease(["t"]):
                pass
        assert store.stats()["corrupt_pages"]["cold"] == 1
        await store.release("t")
        assert not tiers.table.held([keys[2]])  # dropped once unowned: a miss from now on
        tiers.check()


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_cold_pages_decoded_on_the_host_are_checked_first(codec: str) -> None:
    """Host attention's read of cold pages (``ColdStorage.decode_on_host``): the codec's
    decode of the cold bytes, no pin left; a flipped payload is never decoded, counted and
    dropped once unowned, like a load's."""
    store = _cold_store(codec)
    async with store:
        keys = await _cold_only(store, list(range(9)))
        tiers = store.tiers
        slots = [tiers.table.slot(k, COLD) for k in keys]
        raw = tiers._arenas[COLD].tensor[torch.tensor(slots)]
        want = tiers.cold.codec.decode(raw, SPEC)  # type: ignore[union-attr]
        got = tiers.cold.decode_on_host(keys)
        assert torch.equal(got, want.reshape(4, -1).view(torch.uint8))
        assert store.stats()["page_loads"] == 0
        tiers._arenas[COLD].array[slots[1], 40] ^= 0x04
        with pytest.raises(CorruptPageError):
            tiers.cold.decode_on_host(keys)
        assert store.stats()["corrupt_pages"]["cold"] == 1
        assert not tiers.table.held([keys[1]])  # unowned: dropped at once
        assert tiers.table.held([keys[0]])
        tiers.check()  # no pin left behind
