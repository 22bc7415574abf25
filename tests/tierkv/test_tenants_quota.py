"""Tenants and quotas (issue 29, tierkv/tenants.py): pages are charged to the tenant whose
sequence made them, evictions take pages of tenants over their limit first and never a page of
a tenant at its reservation, an admission that cannot keep both rules is refused with
QuotaExceededError; bad configuration and unknown tenants are typed errors with nothing
changed; the counts always equal the pages each tier holds (a state machine on the page table,
derandomized in CI)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tierkv import KVStore, Quota, QuotaConfigError, QuotaExceededError, TierFullError
from tierkv import tenants as tenants_module
from tierkv.errors import InvalidTypeError, TenantError, UnknownTenantError
from tierkv.page_table import PageState, PageTable
from tierkv.serving import http_status
from tierkv.tenant_counts import PyTierCounts, TierCounts
from tierkv.tenants import Tenants

sys.path.insert(0, str(Path(__file__).parent))
import store_kv
from store_kv import PAGE, SPEC, N, kv, tokens


async def fill(s: KVStore, sid: str, seed: int, tenant: str | None) -> None:
    await store_kv.fill(s, sid, seed, tenant=tenant)
    await s.drain()


def small(**tenants: Quota) -> KVStore:
    return KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=16 * PAGE, codec=None, tenants=tenants)


# -- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("quota", "err"),
    [
        (lambda: Quota(host_reserve=-1), QuotaConfigError),
        (lambda: Quota(host_reserve="1G"), InvalidTypeError),
        (lambda: Quota(device_limit=True), InvalidTypeError),
        (lambda: Quota(host_reserve=8, host_limit=4), QuotaConfigError),
        (lambda: Quota(host_limit=float("nan")), InvalidTypeError),
        (lambda: Quota(host_limit=float("inf")), InvalidTypeError),
        (lambda: Quota(device_reserve=1.0), InvalidTypeError),
        (lambda: Quota(cold_reserve=False), InvalidTypeError),
        (lambda: Quota(host_reserve=None), InvalidTypeError),  # (only a limit may be None)
        (lambda: Quota(host_limit=-(1 << 70)), QuotaConfigError),
    ],
)
def test_bad_quotas_are_typed(quota: object, err: type[Exception]) -> None:
    with pytest.raises(err):
        quota()  # type: ignore[operator]


def test_numpy_integers_are_quotas_as_they_are_tier_budgets() -> None:
    """A quota computed with numpy (np.int64) is taken as the int it is, as the tiers' byte
    budgets take it (it was refused); numpy's bool and floats stay type errors."""
    import numpy as np

    q = Quota(host_reserve=np.int64(3 * PAGE), host_limit=np.uint32(8 * PAGE))
    assert (q.host_reserve, q.host_limit) == (3 * PAGE, 8 * PAGE)
    assert type(q.host_reserve) is int and type(q.host_limit) is int
    for bad in (np.bool_(True), np.float64(1.0)):
        with pytest.raises(InvalidTypeError):
            Quota(host_reserve=bad)


def test_quotas_that_do_not_add_up_are_refused_before_anything_is_allocated() -> None:
    with pytest.raises(QuotaConfigError, match="reservations add up to 17 pages"):
        small(a=Quota(host_reserve=9 * PAGE), b=Quota(host_reserve=8 * PAGE))
    with pytest.raises(QuotaConfigError, match="cold"):  # no cold pool in this store
        small(a=Quota(cold_limit=PAGE))
    with pytest.raises(TenantError):
        small(**{"bad name!": Quota()})
    with pytest.raises(InvalidTypeError):
        KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=16 * PAGE, tenants={"a": 5})  # type: ignore[dict-item]
    small(a=Quota(host_reserve=8 * PAGE), b=Quota(host_reserve=8 * PAGE))  # exactly the tier


def test_reservations_round_up_and_limits_down_to_pages() -> None:
    q = Quota(host_reserve=PAGE + 1, host_limit=3 * PAGE - 1)
    t = Tenants({"a": q}, {"host": PAGE}, {"host": 8})
    tier = t.stats()["a"]["tiers"]["host"]
    assert (tier["reserve_pages"], tier["limit_pages"]) == (2, 2)


async def test_unknown_and_bad_tenants_change_nothing() -> None:
    async with small(a=Quota()) as s:
        for bad, err in (("nobody", UnknownTenantError), ("", TenantError), (3, InvalidTypeError)):
            with pytest.raises(err):
                await s.add_sequence("x", tokens(1), tenant=bad)  # type: ignore[arg-type]
        assert s.sequence_ids() == [] and s.stats()["tenants"]["a"]["sequences"] == 0
        s.check()
    async with small(acme=Quota()) as s:  # names match exactly: no other spelling is acme
        for bad in ("Acme", "ACME", " acme", "acme ", "acme\x00", "acme:x", "t:acme", "acme\n"):
            with pytest.raises(TenantError):  # (UnknownTenantError for the well-formed ones)
                await s.add_sequence("x", tokens(1), tenant=bad)
        assert s.sequence_ids() == [] and s.stats()["tenants"]["acme"]["sequences"] == 0
        s.check()
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=16 * PAGE) as plain:
        with pytest.raises(UnknownTenantError, match="no tenants"):
            await plain.add_sequence("x", tokens(1), tenant="a")
        assert plain.sequence_ids() == []


# -- the rules ------------------------------------------------------------------------------
async def test_a_flood_never_evicts_a_tenant_at_its_reservation() -> None:
    async with small(quiet=Quota(host_reserve=8 * PAGE), flood=Quota(host_limit=4 * PAGE)) as s:
        await fill(s, "q1", 1, "quiet")
        await fill(s, "q2", 2, "quiet")
        for i in range(3, 40):  # 10x the flooder's limit and more
            await fill(s, f"f{i}", i, "flood")
            s.check()  # (the tenants' counts equal the pages each tier holds)
        st_ = s.stats()["tenants"]
        assert st_["quiet"]["tiers"]["host"]["evicted"] == 0
        assert st_["quiet"]["tiers"]["host"]["pages"] == 8
        assert st_["flood"]["tiers"]["host"]["evicted"] > 0
        assert st_["flood"]["evictions_caused"] > 0
        assert s.lookup(tokens(1)) == 8 and s.lookup(tokens(2)) == 8


async def test_a_tenant_over_its_limit_evicts_its_own_pages_first() -> None:
    async with small(calm=Quota(), greedy=Quota(host_limit=2 * PAGE)) as s:
        await fill(s, "c1", 1, "calm")  # 4 pages, no reservation: only rule 1 keeps them
        for i in range(3, 30):
            await fill(s, f"g{i}", i, "greedy")
        st_ = s.stats()["tenants"]
        assert st_["calm"]["tiers"]["host"]["evicted"] == 0 and s.lookup(tokens(1)) == 8
        assert st_["greedy"]["tiers"]["host"]["evicted"] > 0


async def test_shared_prefix_pages_stay_charged_to_their_maker() -> None:
    async with small(a=Quota(), b=Quota()) as s:
        await fill(s, "a1", 1, "a")
        assert await s.add_sequence("b1", tokens(1), tenant="b") == 8  # same prompt, no salt
        await s.release("b1")
        st_ = s.stats()["tenants"]
        pages = {t: st_[n]["tiers"]["device"]["pages"] for n in ("a", "b") for t in [n]}
        assert pages == {"a": 4, "b": 0}
        assert st_["b"]["prefix_tokens_reused"] == 8 and st_["a"]["prefix_tokens_reused"] == 0


async def test_no_room_within_the_quotas_is_a_quota_error_and_429() -> None:
    store = KVStore(
        SPEC,
        device_bytes=6 * PAGE,
        host_bytes=16 * PAGE,
        codec=None,
        tenants={"owner": Quota(device_reserve=6 * PAGE), "other": Quota()},
    )
    async with store as s:
        await fill(s, "o1", 1, "owner")  # 4 cached pages on the device, all reserved
        assert s.stats()["tenants"]["owner"]["tiers"]["device"]["pages"] == 4
        await s.add_sequence("x", tokens(2), tenant="other")
        with pytest.raises(QuotaExceededError) as info:
            async with s.lease(["x"]) as lease:
                await lease.append("x", 0, *kv(N, 20))
        assert isinstance(info.value, TierFullError) and http_status(info.value) == 429
        assert s.stats()["tenants"]["other"]["refusals"] >= 1
        assert s.sequence("x").kv_len == [0, 0]  # nothing appended
        assert s.stats()["tenants"]["owner"]["tiers"]["device"]["pages"] == 4
        s.check()
        await s.release("x")
        await fill(s, "o2", 2, "owner")  # the owner's own pages may go for its own


# -- the page table's accounting, as a state machine -----------------------------------------
NAMES = ["a", "b", "c"]


class TenantTableMachine(RuleBasedStateMachine):
    """Random stores, evictions and put-backs on a two-tier page table with three tenants:
    the counts equal the pages held (not MOVING), and no eviction takes a tenant below its
    reservation (an eviction that would takes nothing)."""

    counts_class: type = TierCounts  # the counts' class (the C one where it was built)

    @initialize(
        reserve=st.lists(st.integers(0, 4), min_size=3, max_size=3),
        limit=st.lists(st.one_of(st.none(), st.integers(4, 12)), min_size=3, max_size=3),
    )
    def setup(self, reserve: list[int], limit: list[int | None]) -> None:
        quotas = {
            n: Quota(host_reserve=r, host_limit=None if lim is None else max(lim, r))
            for n, r, lim in zip(NAMES, reserve, limit)
        }
        self.cap = 12
        with patch.object(tenants_module, "TierCounts", self.counts_class):
            self.tenants = Tenants(quotas, {"host": 1}, {"host": self.cap})
        self.table = PageTable({"host": self.cap}, "lru", tenants=self.tenants)
        self.reserve = dict(zip(NAMES, reserve))
        self.next = 0
        self.moving: list[bytes] = []

    def _used(self) -> dict[str, int]:
        return {n: v["tiers"]["host"]["pages"] for n, v in self.tenants.stats().items()}

    def _charged(self, whos: list[str | None]) -> list[bytes]:
        keys = []
        for who in whos:
            key = f"p{self.next}".encode()
            self.next += 1
            self.tenants.charge([key], None if who is None else self.tenants.index[who])
            keys.append(key)
        return keys

    def _check_evictions(
        self,
        before: dict[str, int],
        lost: set[str],
        arriving: list[bytes] = (),  # type: ignore[assignment]
    ) -> None:
        """Each tenant that lost pages holds at least as many as before or its reservation,
        counting the pages of ``arriving`` (pages the room was made for) as its own."""
        after = self._used()
        if arriving and self.table.keys("host") and arriving[0] not in self.table.keys("host"):
            for k in arriving:  # (room made for them: they have not arrived yet)
                who = self.tenants.charged(k)
                if who is not None:
                    after[who] += 1
        for n in lost:
            assert after[n] >= min(before[n], self.reserve[n]), (n, before, after)

    @rule(who=st.sampled_from([*NAMES, None]), n=st.integers(1, 5))
    def store(self, who: str | None, n: int) -> None:
        keys = [f"p{self.next + i}".encode() for i in range(n)]
        self.next += n
        self.tenants.charge(keys, None if who is None else self.tenants.index[who])
        before = self._used()
        alloc = self.table.prepare_store(keys, "host")
        if alloc is None:
            return
        lost = {self.tenants.charged(k) for k in alloc.evicted} - {None}
        self._check_evictions(before, lost)  # type: ignore[arg-type]
        self.table.complete_store(alloc.keys, "host")

    @rule(whos=st.lists(st.sampled_from([*NAMES, None]), min_size=2, max_size=6))
    def store_mixed(self, whos: list[str | None]) -> None:
        """A batch of several tenants' pages (a write-back of a batched step's victims): each
        tenant's pages may replace only its own below its reservation."""
        keys = self._charged(whos)
        before = self._used()
        alloc = self.table.prepare_store(keys, "host")
        if alloc is None:
            return
        lost = {self.tenants.charged(k) for k in alloc.evicted} - {None}
        self._check_evictions(before, lost, keys)  # type: ignore[arg-type]
        self.table.complete_store(alloc.keys, "host")

    @rule(n=st.integers(1, 6), whos=st.lists(st.sampled_from([*NAMES, None]), max_size=6))
    def evict_for(self, n: int, whos: list[str | None]) -> None:
        """Room made for pages of several tenants about to arrive (a batched step's loads):
        with them counted as arrived, nobody is below its reservation by another's pages."""
        keys = self._charged(whos)
        before = self._used()
        got = self.table.prepare_evict("host", n, exact=True, for_keys=keys)
        lost = {self.tenants.charged(k) for k, _ in got} - {None}
        self._check_evictions(before, lost, keys if got else [])  # type: ignore[arg-type]
        self.moving += [k for k, _ in got]

    @rule(n=st.integers(1, 6), exact=st.booleans())
    def evict(self, n: int, exact: bool) -> None:
        before = self._used()
        got = self.table.prepare_evict("host", n, exact=exact)
        self._check_evictions(before, {self.tenants.charged(k) for k, _ in got} - {None})  # type: ignore[misc]
        self.moving += [k for k, _ in got]

    @rule(ok=st.booleans())
    def finish(self, ok: bool) -> None:
        if self.moving:
            self.table.complete_evict(self.moving, "host", ok=ok)
            self.moving = []

    @invariant()
    def causes(self) -> None:
        """Evictions caused never go negative (a put-back takes back only what was counted
        for the tenant its victims were chosen for)."""
        if hasattr(self, "table"):
            caused = [v["evictions_caused"] for v in self.tenants.stats().values()]
            assert min(caused) >= 0, caused

    @invariant()
    def counts(self) -> None:
        if hasattr(self, "table"):
            self.table.check()
            self.tenants.check(
                lambda t: [
                    k for k in self.table.keys(t) if self.table.state(k, t) != PageState.MOVING
                ]  # type: ignore[misc]
            )


TenantTableMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None
)
TestTenantTable = TenantTableMachine.TestCase


class PyTenantTableMachine(TenantTableMachine):
    """The same on the counts' Python reference (what runs where tierkv._tally is not built)."""

    counts_class = PyTierCounts


PyTenantTableMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
TestPyTenantTable = PyTenantTableMachine.TestCase


def test_tenant_indices_are_stable() -> None:
    t = Tenants({"x": Quota(), "y": Quota()}, {"host": 1}, {"host": 4})
    assert t.tenant("y") == 1 and t.tenant(None) is None
    asyncio.run(asyncio.sleep(0))


async def test_the_tenant_metrics_equal_the_stats() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    from tierkv import metrics

    async with small(quiet=Quota(host_reserve=8 * PAGE), flood=Quota(host_limit=4 * PAGE)) as s:
        await fill(s, "q1", 1, "quiet")
        for i in range(3, 12):
            await fill(s, f"f{i}", i, "flood")
        await s.add_sequence("again", tokens(1), tenant="quiet")
        await s.release("again")
        got = {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(metrics.render(s).decode())
            for x in fam.samples
            if x.name.startswith("tierkv_tenant_")
        }
        want: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for name, fig in s.stats()["tenants"].items():
            for key in ("sequences", "prompt_tokens", "prefix_tokens_reused", "refusals"):
                want[(f"tierkv_tenant_{key}_total", (("tenant", name),))] = fig[key]
            want[("tierkv_tenant_evictions_caused_total", (("tenant", name),))] = fig[
                "evictions_caused"
            ]
            for tier, t in fig["tiers"].items():
                labels = (("tenant", name), ("tier", tier))
                want[("tierkv_tenant_bytes", labels)] = t["bytes"]
                want[("tierkv_tenant_evicted_total", labels)] = t["evicted"]
        assert got == want
        assert want[("tierkv_tenant_prefix_tokens_reused_total", (("tenant", "quiet"),))] == 8
        assert want[("tierkv_tenant_evicted_total", (("tenant", "flood"), ("tier", "host")))] > 0


def test_charges_of_pages_no_tier_holds_are_pruned_and_imports_replace_them() -> None:
    t = Tenants({"x": Quota(), "y": Quota()}, {"host": 1}, {"host": 8})
    held = {b"k1"}
    t.bind(lambda keys: [k for k in keys if k in held])
    t.charge([b"k1", b"k2"], 0)
    t.charge([b"k1", b"k2"], 1)  # the first maker pays
    assert (t.charged(b"k1"), t.charged(b"k2")) == ("x", "x")
    t.charge([b"k1", b"k2"], 1, fresh=True)  # an import: k2 is held nowhere, its charge stale
    assert (t.charged(b"k1"), t.charged(b"k2")) == ("x", "y")
    t.prune()
    assert (t.charged(b"k1"), t.charged(b"k2")) == ("x", None)
    t.rename([b"k1"], [b"c1"])
    assert (t.charged(b"k1"), t.charged(b"c1")) == (None, "x")


def _table_of(quotas: dict[str, Quota], cap: int) -> tuple[Tenants, PageTable]:
    tenants = Tenants(quotas, {"host": 1}, {"host": cap})
    return tenants, PageTable({"host": cap}, "lru", tenants=tenants)


def _put(tenants: Tenants, table: PageTable, who: str, *keys: bytes) -> None:
    tenants.charge(list(keys), tenants.index[who])
    alloc = table.prepare_store(list(keys), "host")
    assert alloc is not None
    table.complete_store(alloc.keys, "host")


def _held(tenants: Tenants) -> dict[str, int]:
    return {n: v["tiers"]["host"]["pages"] for n, v in tenants.stats().items()}


def test_a_batch_of_several_tenants_pages_keeps_each_tenants_reservation() -> None:
    """A write-back of a batched step's victims stores pages of several tenants at once: the
    evictions that make room are each tenant's own share. Before, the whole batch counted as
    its first page's tenant's, whose own reserved pages rule 2 then let go for the others'
    pages (x ended with 1 page of its 2 reserved)."""
    tenants, table = _table_of({"x": Quota(host_reserve=2), "y": Quota()}, 4)
    _put(tenants, table, "x", b"x1", b"x2")  # the oldest: the policy's first victims
    _put(tenants, table, "y", b"y1", b"y2")
    tenants.charge([b"x3"], tenants.index["x"])
    tenants.charge([b"y3", b"y4"], tenants.index["y"])
    alloc = table.prepare_store([b"x3", b"y3", b"y4"], "host")  # x's page first
    assert alloc is not None
    table.complete_store(alloc.keys, "host")
    assert _held(tenants) == {"x": 2, "y": 2}  # x's page replaced one of x's; y's two, y's
    assert sorted(alloc.evicted) == [b"x1", b"y1", b"y2"]
    assert tenants.stats()["x"]["evictions_caused"] == 1  # (each share counted as its own)


def test_room_made_for_a_tenants_pages_takes_no_more_of_its_reserved_pages_than_arrive() -> None:
    """Rule 2 lets a tenant's pages go below its reservation only for its own new pages: room
    for more pages than arrive takes the rest from pages that rule 2 allows."""
    tenants, table = _table_of({"x": Quota(host_reserve=2), "y": Quota()}, 4)
    _put(tenants, table, "x", b"x1", b"x2")
    _put(tenants, table, "y", b"y1", b"y2")
    tenants.charge([b"x3"], tenants.index["x"])
    got = table.prepare_evict("host", 3, exact=True, for_keys=[b"x3"])
    assert sorted(k for k, _ in got) == [b"x1", b"y1", b"y2"]  # x keeps 1 (+ x3 arriving)
    table.complete_evict([k for k, _ in got], "host")
    assert _held(tenants) == {"x": 1, "y": 0}


def test_a_put_back_eviction_is_no_longer_counted_as_caused_by_the_tenant_it_was_for() -> None:
    """A write-back that does not happen (the lower tier refused, a cancelled task) puts its
    MOVING victims back: the evictions it counted as caused by the tenant the room was for
    are taken back too. Before, a put-back outside prepare_evict kept them counted."""
    tenants, table = _table_of({"x": Quota(), "y": Quota()}, 4)
    _put(tenants, table, "y", b"y1", b"y2", b"y3", b"y4")
    tenants.charge([b"x1", b"x2"], tenants.index["x"])
    got = table.prepare_evict("host", 2, for_keys=[b"x1", b"x2"])
    assert tenants.stats()["x"]["evictions_caused"] == 2
    table.complete_evict([k for k, _ in got], "host", ok=False)  # (eviction.py's put-back)
    assert tenants.stats()["x"]["evictions_caused"] == 0
    assert _held(tenants) == {"x": 0, "y": 4}
    assert tenants.stats()["y"]["tiers"]["host"]["evicted"] == 0
    got = table.prepare_evict("host", 1, for_keys=[b"x1"])
    table.complete_evict([k for k, _ in got], "host")  # this one happened
    assert tenants.stats()["x"]["evictions_caused"] == 1
    assert tenants.stats()["y"]["tiers"]["host"]["evicted"] == 1


def test_room_for_several_tenants_takes_the_policys_pick_when_it_keeps_every_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Room for several tenants' pages that the quotas must check (too many victims for the
    fast check) first takes each tenant's share by policy and keeps it when no tenant goes
    below its reservation: the same victims as without quotas, and no rule passes. Before,
    a batch of several tenants always went to the passes (the decode loop of
    benchmarks/tenants.py spent ~10 ms in 688 of them over 400 steps)."""
    import tierkv.page_table as page_table_module

    tenants, table = _table_of({"x": Quota(host_reserve=2), "y": Quota()}, 8)
    _put(tenants, table, "y", b"y1", b"y2", b"y3", b"y4")  # the oldest: the policy's victims
    _put(tenants, table, "x", b"x1", b"x2", b"x3", b"x4")
    tenants.charge([b"x5"], tenants.index["x"])
    tenants.charge([b"y5", b"y6"], tenants.index["y"])

    def no_passes(*a: object, **k: object) -> int:
        raise AssertionError("the rules' passes ran")

    monkeypatch.setattr(page_table_module, "_by_rules", no_passes)
    got = table.prepare_evict("host", 3, for_keys=[b"x5", b"y5", b"y6"])
    assert sorted(k for k, _ in got) == [b"y1", b"y2", b"y3"]
    table.complete_evict([k for k, _ in got], "host")
    assert tenants.stats()["x"]["evictions_caused"] == 1
    assert tenants.stats()["y"]["evictions_caused"] == 2
    # a pick that would take x below its reservation still goes to the passes
    monkeypatch.undo()
    got = table.prepare_evict("host", 4, for_keys=[b"x5", b"x6", b"y5", b"y6"])
    assert _held(tenants)["x"] >= 2
    table.complete_evict([k for k, _ in got], "host")


def test_room_for_several_tenants_is_one_pick_counted_per_tenant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Room for several tenants' pages with no quota to check is one pick by policy (the
    victims each tenant's share picked in turn would take), each victim counted as caused
    by the tenant of the page it makes room for, and a put-back takes each back. Before,
    each tenant's share was a pick of its own: twice the policy's scans in a batched decode
    step of two tenants (benchmarks/tenants.py's decode loop: 2,454 picks against 1,076
    without tenants)."""
    from tierkv.page_table import PageTable

    tenants, table = _table_of({"x": Quota(), "y": Quota()}, 8)
    _put(tenants, table, "y", b"y1", b"y2", b"y3", b"y4")  # the oldest: the policy's victims
    _put(tenants, table, "x", b"x1", b"x2", b"x3", b"x4")
    tenants.charge([b"x5"], tenants.index["x"])
    tenants.charge([b"y5", b"y6"], tenants.index["y"])
    picks: list[int] = []
    pick = PageTable._pick

    def counted(self: PageTable, t: object, n: int, *a: object, **k: object) -> object:
        picks.append(n)
        return pick(self, t, n, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(PageTable, "_pick", counted)
    got = table.prepare_evict("host", 3, for_keys=[b"x5", b"y5", b"y6"])
    assert picks == [3]
    assert [k for k, _ in got] == [b"y1", b"y2", b"y3"]
    assert tenants.stats()["x"]["evictions_caused"] == 1
    assert tenants.stats()["y"]["evictions_caused"] == 2
    assert _held(tenants) == {"x": 4, "y": 1}  # (MOVING: no tenant's)
    table.complete_evict([k for k, _ in got], "host", ok=False)  # put back: none caused
    assert tenants.stats()["x"]["evictions_caused"] == 0
    assert tenants.stats()["y"]["evictions_caused"] == 0
    assert _held(tenants) == {"x": 4, "y": 4}
    got = table.prepare_evict("host", 4, for_keys=[b"y5", b"x5"])  # room beyond the pages
    table.complete_evict([k for k, _ in got], "host")
    assert tenants.stats()["y"]["evictions_caused"] == 1  # (the free room: none here; the
    assert tenants.stats()["x"]["evictions_caused"] == 1  # two evictions past them: nobody's)
