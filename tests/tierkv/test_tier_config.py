"""A chain as configuration (issue 25, point 2): ``KVStore(spec, tiers=[...])``.

Every subset of device, host, cold, disk and remote is tried: the ones the core runs open and
round-trip KV bit-exact under eviction, the others are refused with TierOrderError. Every bad
configuration gets its typed error at construction, with nothing created; the old keywords
build the same chain as the tiers they stand for. Host-first stores (no device tier) are
tested through every API: leases, eviction to disk / cold / remote, restarts on disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import tierkv
from tierkv import Cold, Device, Disk, Host, Remote
from tierkv import errors as e
from tierkv.chain_config import build_chain
from tierkv.chain_plugins import PluginEntry, unregister_tier
from tierkv.codecs import UnknownCodecError, create_codec
from tierkv.store import KVStore
from tierkv.tier_names import COLD, DEVICE, HOST

sys.path.insert(0, str(Path(__file__).parent))
from dict_source import DictSource
from store_kv import PAGE, SLOT, SPEC, N, cached_kv, fill, kv, tokens

NONE_PAGE = PAGE + 128  # a page encoded by the "none" codec (bit-exact, a header more)
KINDS = ("device", "host", "cold", "disk", "remote")


def entry(kind: str, tmp: Path, source: DictSource) -> Any:
    return {
        "device": Device(bytes=6 * PAGE),
        "host": Host(bytes=8 * PAGE),
        "cold": Cold(codec="none", bytes=12 * NONE_PAGE),
        "disk": Disk(path=tmp, bytes=64 * SLOT),
        "remote": Remote(sources=[source]),
    }[kind]


def runnable(kinds: tuple[str, ...]) -> bool:
    """The chains the core runs: leases on the first tier (device or host), and a host tier
    under a device whenever anything else follows."""
    if kinds[0] == "host":
        return True
    return kinds[0] == "device" and (len(kinds) == 1 or kinds[1] == "host")


SUBSETS = [c for r in range(1, 6) for c in itertools.combinations(KINDS, r)]


@pytest.mark.parametrize("kinds", SUBSETS, ids=["+".join(c) for c in SUBSETS])
async def test_every_subset_runs_bit_exact_or_is_refused(
    kinds: tuple[str, ...], tmp_path: Path
) -> None:
    source = DictSource()
    tiers = [entry(k, tmp_path, source) for k in kinds]
    if not runnable(kinds):
        with pytest.raises(e.TierOrderError):
            KVStore(SPEC, tiers=tiers)
        assert not any(tmp_path.iterdir())  # nothing created  # noqa: ASYNC240
        return
    async with KVStore(SPEC, tiers=tiers, timeout=5.0) as s:
        assert s.stats()["chain"] == list(kinds)
        for i in range(6):  # 6 x 2 blocks x 2 layers of cached pages: more than the top holds
            await fill(s, f"s{i}", i)
        await s.drain()
        s.check()
        reused = [await cached_kv(s, i) for i in range(6)]
        assert reused[-1] == 8  # the last one is still in the top tier
        if len(kinds) > 1 + (kinds[0] == "device"):  # a tier below the top: more come back
            assert sum(reused) > 8 * 2, reused
        stats = s.stats()
        assert stats["background_errors"] == 0
        s.check()
    if "remote" in kinds:
        assert source.pages  # pages left to the remote


async def test_the_keywords_build_the_chain_they_stand_for(tmp_path: Path) -> None:
    """``device_bytes`` / ``host_bytes`` / ``codec`` / ``cold_fraction`` / ``disk_*`` / ``remote``
    are a shorthand: the same pages per tier as the tiers they stand for."""
    source = DictSource()
    keywords: dict[str, Any] = {
        "device_bytes": 6 * PAGE,
        "host_bytes": 40 * PAGE,
        "codec": "int8",
        "cold_fraction": 0.25,
        "disk_path": tmp_path,
        "disk_bytes": 64 * SLOT,
        "remote": source,
    }
    old = KVStore(SPEC, **keywords)
    new = KVStore(
        SPEC,
        tiers=[
            Device(bytes=6 * PAGE),
            Host(bytes=30 * PAGE),
            Cold(codec="int8", bytes=10 * PAGE),
            Disk(path=tmp_path, bytes=64 * SLOT),
            Remote(sources=[source]),
        ],
    )
    assert old.chain == new.chain  # (its codec objects compare by value)
    assert old.chain.names == ("device", "host", "cold", "disk", "remote")
    default = KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE)  # today's defaults
    assert default.chain.names == ("device", "host", "cold")
    assert default.chain.host_pages == 8 - int(8 * 0.25)
    tiny = KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, cold_fraction=0.01)
    assert tiny.chain.names == ("device", "host")  # a cold pool of no page: none, as before
    async with new as s:
        info = s.stats()["tiers"]
        assert info[DEVICE]["capacity"] == 6 and info[HOST]["capacity"] == 30
        assert info[COLD]["capacity"] == new.chain.cold_pages


async def test_dicts_are_entries_too(tmp_path: Path) -> None:
    tiers = [
        {"tier": "host", "bytes": 8 * PAGE},
        {"tier": "disk", "path": str(tmp_path), "bytes": 64 * SLOT},
    ]
    async with KVStore(SPEC, tiers=tiers) as s:
        assert s.stats()["chain"] == ["host", "disk"]
        for i in range(4):
            await fill(s, f"s{i}", i)
        await s.drain()
        assert [await cached_kv(s, i) for i in range(4)] == [8] * 4


def bad(**kw: Any) -> dict[str, Any]:
    return kw


BAD: list[tuple[str, object, type[e.TierKVError]]] = [
    ("not a list", Host(bytes=8 * PAGE), e.TierTypeError),
    ("a str", "host", e.TierTypeError),
    ("a dict as the chain", {"tier": "host", "bytes": 8 * PAGE}, e.TierTypeError),
    ("empty", [], e.TierConfigError),
    ("a str entry", ["host"], e.TierTypeError),
    ("an int entry", [8 * PAGE], e.TierTypeError),
    ("unknown kind", [{"tier": "ssd", "bytes": 1 << 20}], e.UnknownTierError),
    ("no kind", [{"bytes": 8 * PAGE}], e.TierTypeError),
    ("unknown field", [{"tier": "host", "bytes": 8 * PAGE, "pinned": True}], e.TierConfigError),
    ("missing field", [{"tier": "host"}], e.TierKVError),
    ("twice", [Host(bytes=8 * PAGE), Host(bytes=8 * PAGE)], e.TierOrderError),
    ("out of order", [Host(bytes=8 * PAGE), Device(bytes=6 * PAGE)], e.TierOrderError),
    ("disk before cold", [Host(bytes=8 * PAGE), "disk", "cold"], e.TierOrderError),
    ("cold first", [Cold(codec="none", bytes=12 * NONE_PAGE)], e.TierOrderError),
    ("device then cold", [Device(bytes=6 * PAGE), Cold(bytes=8 * PAGE)], e.TierOrderError),
    ("device below one page", [Device(bytes=PAGE - 1), Host(bytes=8 * PAGE)], e.TierSizeError),
    ("host below one page", [Host(bytes=PAGE - 1)], e.TierSizeError),
    ("cold below one encoded page", [Host(bytes=8 * PAGE), "small cold"], e.TierSizeError),
    ("disk below one slot", [Host(bytes=8 * PAGE), "small disk"], e.TierSizeError),
    # a budget in the wrong unit: 2**31 pages' bookkeeping was minutes of opening, then OOM
    ("device past MAX_PAGES", [Device(bytes=PAGE << 31), Host(bytes=8 * PAGE)], e.TierSizeError),
    ("host past MAX_PAGES", [Host(bytes=PAGE << 31)], e.TierSizeError),
]


def _resolve(tiers: object, tmp: Path) -> object:
    if not isinstance(tiers, list):
        return tiers
    named = {
        "disk": Disk(path=tmp, bytes=64 * SLOT),
        "cold": Cold(codec="none", bytes=12 * NONE_PAGE),
        "small cold": Cold(codec="none", bytes=NONE_PAGE - 1),
        "small disk": Disk(path=tmp, bytes=SLOT - 1),
    }
    return [named[t] if isinstance(t, str) and t in named else t for t in tiers]


@pytest.mark.parametrize(
    ("tiers", "error"), [(t, e) for _, t, e in BAD], ids=[n for n, _, _ in BAD]
)
def test_a_bad_chain_gets_its_typed_error_and_creates_nothing(
    tiers: object, error: type[e.TierKVError], tmp_path: Path
) -> None:
    with pytest.raises(error):
        KVStore(SPEC, tiers=_resolve(tiers, tmp_path))  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: Host(bytes="1G"), e.TierTypeError),  # type: ignore[arg-type]
        (lambda: Host(bytes=1.5), e.TierTypeError),  # type: ignore[arg-type]
        (lambda: Host(bytes=True), e.TierTypeError),
        (lambda: Device(bytes=-1), e.TierSizeError),
        (lambda: Cold(codec="nope", bytes=1 << 20), UnknownCodecError),
        (lambda: Cold(codec=8, bytes=1 << 20), e.TierTypeError),  # type: ignore[arg-type]
        (lambda: Disk(path=42, bytes=1 << 20), e.TierTypeError),  # type: ignore[arg-type]
        (lambda: Remote(sources=[]), e.TierConfigError),
        (lambda: Remote(sources=[object()]), e.TierTypeError),
        (lambda: Remote(sources="peer"), e.TierTypeError),  # type: ignore[arg-type]
    ],
)
def test_a_bad_entry_is_refused_when_made(make: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        make()


@pytest.mark.parametrize(
    "old",
    [
        bad(device_bytes=6 * PAGE),
        bad(host_bytes=8 * PAGE),
        bad(codec="int8"),
        bad(codec=None),
        bad(cold_fraction=0.25),
        bad(disk_path="/tmp"),
        bad(disk_bytes=64 * SLOT),
        bad(remote=DictSource()),
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_tiers_and_an_old_tier_keyword_conflict(old: dict[str, Any]) -> None:
    with pytest.raises(e.TierConflictError, match=next(iter(old))):
        KVStore(SPEC, tiers=[Host(bytes=8 * PAGE)], **old)


def test_no_chain_at_all_is_refused() -> None:
    with pytest.raises(e.TierConfigError, match="tiers="):
        KVStore(SPEC)
    with pytest.raises(e.TierConfigError):
        KVStore(SPEC, device_bytes=6 * PAGE)


async def test_a_cold_entry_takes_a_codec_built_with_options() -> None:
    """A Codec instance (head-sparse with its ranking, or any codec made by hand) stands in a
    Cold entry and in the codec= keyword alike."""
    codec = create_codec("fp16")
    chain = [Device(bytes=4 * PAGE), Host(bytes=8 * PAGE), Cold(codec=codec, bytes=8 * PAGE)]
    async with KVStore(SPEC, tiers=chain) as s:
        assert s.chain.codec is codec and s.chain.codec_name == "fp16"
        assert s.stats()["tiers"][COLD]["capacity"] > 0
    s2 = KVStore(SPEC, device_bytes=4 * PAGE, host_bytes=8 * PAGE, codec=codec)
    assert s2.chain.codec is codec


def test_the_errors_are_the_families_callers_catch() -> None:
    assert issubclass(e.TierConfigError, e.InvalidInputError)
    assert issubclass(e.TierTypeError, e.InvalidTypeError) and issubclass(
        e.TierTypeError, TypeError
    )
    assert issubclass(e.TierSizeError, e.SpecError)  # as the keyword budgets' errors
    assert issubclass(e.UnknownTierError, e.UnknownNameError)
    assert tierkv.TierConfigError is e.TierConfigError
    with pytest.raises(e.SpecError, match="holds no page"):  # the keywords: today's error
        KVStore(SPEC, device_bytes=PAGE - 1, host_bytes=8 * PAGE)
    with pytest.raises(e.InvalidTypeError):
        KVStore(SPEC, device_bytes="1G", host_bytes=8 * PAGE)  # type: ignore[arg-type]


# -- host-first ------------------------------------------------------------------------------
def host_first(tmp: Path, *below: Any, host: int = 8, **kw: Any) -> KVStore:
    return KVStore(
        SPEC, tiers=[Host(bytes=host * PAGE), *below], timeout=kw.pop("timeout", 5.0), **kw
    )


async def test_host_first_evicts_to_disk_and_restarts_on_it(tmp_path: Path) -> None:
    disk = Disk(path=tmp_path, bytes=64 * SLOT)
    async with host_first(tmp_path, disk) as s:
        assert s.chain.host_first and s.tiers.top == DEVICE  # the leased tier is the host's
        assert HOST not in s.tiers.table.tier_names  # no second host tier under it
        for i in range(8):  # 8 x 4 cached pages, the host holds 8
            await fill(s, f"s{i}", i)
        await s.drain()
        d = s.stats()["disk"]
        assert d["stored"] >= 24 and d["write_failed"] == 0
        assert s.lookup(tokens(0)) == 8  # the lookup sees the disk
        assert await cached_kv(s, 0) == 8
        assert s.stats()["disk"]["imported"] > 0
        assert s.stats()["tiers"][HOST]["capacity"] == 8  # reported as the host tier
    async with host_first(tmp_path, disk) as s:  # a new store on the same path
        assert [await cached_kv(s, i) for i in range(8)] == [8] * 8
        assert s.stats()["disk"]["corrupt_pages"] == 0


async def test_host_first_compresses_to_cold_and_loads_back(tmp_path: Path) -> None:
    cold = Cold(codec="none", bytes=40 * NONE_PAGE)  # bit-exact
    async with host_first(tmp_path, cold, compress_after=1) as s:
        for i in range(6):
            await fill(s, f"s{i}", i)
            s.step()
            s.step()
        await s.drain()
        assert s.stats()["compressed"] > 0
        assert [await cached_kv(s, i) for i in range(6)] == [8] * 6
        assert s.stats()["hits"]["cold"] > 0  # leases decoded pages from cold
        s.check()


async def test_host_first_pushes_to_a_remote_and_a_new_store_imports_them(tmp_path: Path) -> None:
    source = DictSource()
    async with host_first(tmp_path, Remote(sources=[source])) as s:
        for i in range(6):
            await fill(s, f"s{i}", i)
        await s.drain()
    assert len(source.pages) >= 4 * 4  # cached prefixes left for the remote (the host keeps 8)
    async with host_first(tmp_path, Remote(sources=[source])) as s:
        assert await s.fetch_prefix(tokens(0)) == 8
        assert await cached_kv(s, 0) == 8
        assert await cached_kv(s, 1) == 8  # add_sequence imports too
        assert s.stats()["remote"]["hits"] > 0


async def test_host_first_keeps_live_sequences_pages_and_waits_for_room(tmp_path: Path) -> None:
    """A live sequence's pages have one exact copy, in the leased tier: they never leave it
    (the owners pin them); a lease needing room that only a release can free waits for it,
    bounded by the timeout."""
    async with host_first(tmp_path, Disk(path=tmp_path, bytes=64 * SLOT), host=7, timeout=0.3) as s:
        for seed in (1, 2):  # 2 x 3 blocks x 2 layers: 12 pages, but only 7 fit
            await s.add_sequence(f"live{seed}", tokens(seed))
        async with s.lease(["live1"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("live1", layer, *kv(N, 10 + layer))
        table = s.tiers.table
        assert all(table.pins(k, DEVICE) == 1 for k in s.tiers.ownership.owners)  # the owners' pins
        with pytest.raises(e.TierFullError):
            async with s.lease(["live2"]) as lease:
                await lease.append("live2", 0, *kv(N, 20))
        s.check()
        async with s.lease(["live1"]) as lease:  # live1's KV is intact
            for layer in range(SPEC.num_layers):
                k, v = kv(N, 10 + layer)
                got_k, got_v = lease.kv("live1", layer)
                assert torch.equal(got_k, k) and torch.equal(got_v, v)
        await s.release("live1")
        async with s.lease(["live2"]) as lease:  # room now: live1's cached blocks went to disk
            for layer in range(SPEC.num_layers):
                await lease.append("live2", layer, *kv(N, 20 + layer))
        await s.release("live2")
        await s.drain()
        assert await cached_kv(s, 1) == 8  # from the disk, bit-exact
        s.check()


async def test_host_first_every_api_works_or_refuses_typed(tmp_path: Path) -> None:
    async with host_first(tmp_path, Disk(path=tmp_path, bytes=64 * SLOT), host=12) as s:
        assert s.write_behind is False  # nothing under the leased tier to write behind to
        assert s.tiers.pages.device.type == "cpu"
        await fill(s, f"s{0}", 0)
        await s.add_sequence("a", [*tokens(0), 7, 7])
        s.add_tokens("a", [8])
        s.schedule([["a"]])
        assert await s.prefetch(["a"], wait=True) == 0  # resident already
        async with s.lease(["a"], layers=[1]) as lease:
            k, _ = lease.kv("a", 1)
            assert torch.equal(k[:, :8], kv(N, 1)[0][:, :8])
        s.step()
        await s.drain()
        assert s.engine_stats().pages >= 0
        assert s.stats()["dropped"] == 0
        with pytest.raises(e.PageStateError):  # the page server's shared host arena
            s.tiers.glue.replace_host_arena(s.tiers.glue.host_arena)
        await s.release("a")
        s.check()


def test_host_first_refuses_compress_live(tmp_path: Path) -> None:
    """compress_live would move a live sequence's one exact copy out of the host tier."""
    with pytest.raises(e.TierConfigError, match="compress_live"):
        host_first(tmp_path, Cold(codec="int8", bytes=8 * PAGE), compress_live=True)


async def test_host_first_names_its_leased_tier_in_errors(tmp_path: Path) -> None:
    async with host_first(tmp_path, host=2) as s:
        await s.add_sequence("a", tokens(0))  # 3 blocks: never resident at once
        with pytest.raises(e.TierFullError, match="host tier: 3 pages can never be resident"):
            async with s.lease(["a"]) as lease:
                await lease.append("a", 0, *kv(N, 0))
        s.check()


@pytest.mark.parametrize("HOST_PAGES", [8, 9, 10])
async def test_a_prefix_split_between_the_host_and_the_disk_is_reused_whole(
    tmp_path: Path, HOST_PAGES: int
) -> None:
    """An import from the disk makes room sparing the prefix's pages still in the host (it
    evicted one of them, and the prefix came back a block short), and a block whose pages lie
    partly in the host, partly on disk, counts as held (issue 25 regression)."""
    async with KVStore(
        SPEC,
        device_bytes=6 * PAGE,
        host_bytes=HOST_PAGES * PAGE,
        codec=None,
        disk_path=tmp_path,
        disk_bytes=64 * SLOT,
        write_behind=False,
    ) as s:
        for i in range(4):
            await fill(s, f"s{i}", i)
        await s.drain()
        assert [await cached_kv(s, i) for i in range(4)] == [8] * 4


def test_a_sync_store_takes_a_chain(tmp_path: Path) -> None:
    with tierkv.SyncKVStore(SPEC, tiers=[{"tier": "host", "bytes": 8 * PAGE}]) as s:
        assert s.add_sequence("a", tokens(0)) == 0
        assert s.stats()["chain"] == ["host"]
    with pytest.raises(e.TierConflictError):
        tierkv.SyncKVStore(SPEC, tiers=[Host(bytes=8 * PAGE)], host_bytes=8 * PAGE)


async def test_host_first_publishes_and_imports_prefixes_by_hand(tmp_path: Path) -> None:
    """The remote glue's verbs (stage, publish, import) work on the leased tier."""
    from tierkv.remote.store_io import import_prefix, publish_prefix, stage_prefix

    peer = DictSource()
    async with host_first(tmp_path, host=12) as s:
        await fill(s, "s0", 0)
        assert await stage_prefix(s, tokens(0)) == 0  # already in host memory
        assert await publish_prefix(s, peer, tokens(0)) == 4
    async with host_first(tmp_path, host=12) as s:
        assert await import_prefix(s, peer, tokens(0)) == 8
        assert await cached_kv(s, 0) == 8


async def test_a_page_server_refuses_a_host_first_store_typed(tmp_path: Path) -> None:
    from tierkv.remote import PageServer
    from tierkv.remote.errors import RemoteError

    async with host_first(tmp_path) as s:
        with pytest.raises(RemoteError, match="host-first"):
            async with PageServer(s, secret=b"host-first-test", timeout=3.0):
                pass
        await fill(s, "s0", 0)  # the store goes on
        assert await cached_kv(s, 0) == 8


async def test_a_page_owned_while_its_host_eviction_fails_keeps_its_owners_pin() -> None:
    """A host victim (MOVING, so a new owner cannot pin it) whose eviction is cancelled comes
    back readable: it gets the owners' pin then, or the page's one exact copy could later be
    evicted from under its owner (found while making eviction serve host-first chains)."""
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, codec=None) as s:
        await fill(s, "s0", 0)
        await fill(s, "s1", 1)
        await s.drain()
        tiers = s.tiers
        assert tiers.table.used(HOST) == 8  # full: an import makes room
        entered, never = asyncio.Event(), asyncio.Event()
        leaving: list[bytes] = []

        async def spill(victims: list[tuple[bytes, int]]) -> None:
            leaving.extend(k for k, _ in victims)
            entered.set()
            await never.wait()  # the eviction hangs here until cancelled

        async def load(keys: list[bytes], array: Any, slots: list[int]) -> int:
            return 0

        tiers.glue.set_spill(spill)
        task = asyncio.ensure_future(tiers.glue.import_host([bytes(18)], load))
        await entered.wait()
        victim = leaving[0]
        tiers.ownership.own([victim])  # its host copy is MOVING: not pinned now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        tiers.glue.set_spill(None)
        assert tiers.table.lookup([victim], HOST) == 1
        assert tiers.table.pins(victim, HOST) == 1  # the owners' pin, taken when it came back
        tiers.ownership.disown([victim])
        assert tiers.table.pins(victim, HOST) == 0
        s.check()


async def test_host_first_has_no_host_only_pages(tmp_path: Path) -> None:
    """Host attention's host-only pages (tierkv.attention.host): none in a host-first store,
    whose leased pages are in host memory already (not an UnknownPageError for the missing
    host column)."""
    from tierkv.attention.host import host_only

    async with host_first(tmp_path, host=12) as s:
        await fill(s, "s0", 0)  # released: its pages stay cached in the leased tier
        pages = list(s.tiers.table.keys(DEVICE))
        assert pages and host_only(s.tiers, pages) == set()


# -- plug-in tiers: the registration path (tierkv.chain_plugins) -----------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Plug:
    """A plug-in entry for the registration checks (opened by no store here)."""

    kind: ClassVar[str] = "plug"
    pages: int

    def check(self, spec: tierkv.KVSpec) -> None:
        if self.pages < 1:
            raise e.TierSizeError("plug budget holds no page")

    def open(self, spec: tierkv.KVSpec) -> Any:
        raise AssertionError("not opened here")

    def register_moves(self, moves: Any) -> None:
        raise AssertionError("not registered here")


@pytest.fixture
def plug() -> Any:
    tierkv.register_tier(_Plug)
    yield _Plug
    unregister_tier("plug")


def test_a_registered_tier_is_a_kind_of_the_chain(plug: Any) -> None:
    chain = build_chain(SPEC, [Host(bytes=8 * PAGE), {"tier": "plug", "pages": 3}])
    assert chain.names == (HOST, "plug") and chain.plugins == (_Plug(pages=3),)
    assert isinstance(chain.plugins[0], PluginEntry)
    # with the disk, in the order listed; below cold, above remote
    below = [Host(bytes=8 * PAGE), Disk(path="/x", bytes=64 * SLOT), _Plug(pages=1)]
    assert build_chain(SPEC, below).names == (HOST, "disk", "plug")
    assert build_chain(SPEC, [below[0], below[2], below[1]]).names == (HOST, "plug", "disk")
    with pytest.raises(e.TierOrderError):
        build_chain(SPEC, [Host(bytes=8 * PAGE), _Plug(pages=1), Cold(bytes=12 * NONE_PAGE)])
    with pytest.raises(e.TierOrderError):  # a lower tier under a device needs a host between
        build_chain(SPEC, [Device(bytes=6 * PAGE), _Plug(pages=1)])
    with pytest.raises(e.TierSizeError):  # the entry's own check, before anything is opened
        build_chain(SPEC, [Host(bytes=8 * PAGE), _Plug(pages=0)])
    with pytest.raises(e.TierConfigError, match="unknown field"):
        build_chain(SPEC, [Host(bytes=8 * PAGE), {"tier": "plug", "pages": 1, "x": 2}])


def test_bad_registrations_are_typed_errors(plug: Any) -> None:
    with pytest.raises(e.TierConfigError, match="registered already"):
        tierkv.register_tier(_Plug)

    @dataclasses.dataclass(frozen=True)
    class Disk2(_Plug):
        kind: ClassVar[str] = "disk"

    with pytest.raises(e.TierConfigError, match="registered already"):
        tierkv.register_tier(Disk2)  # a built-in kind

    class NotData:
        kind = "nd"

    with pytest.raises(e.TierTypeError):
        tierkv.register_tier(NotData)

    @dataclasses.dataclass
    class NoOpen:
        kind: ClassVar[str] = "no-open"

        def check(self, spec: object) -> None: ...

    with pytest.raises(e.TierTypeError, match="open, register_moves"):
        tierkv.register_tier(NoOpen)
    unregister_tier("plug")
    with pytest.raises(e.UnknownTierError):
        build_chain(SPEC, [Host(bytes=8 * PAGE), {"tier": "plug", "pages": 1}])
