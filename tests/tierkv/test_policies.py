"""Eviction policies: scripted victims, pinned pages, properties, the registry.

The scripted tests drive each policy by keys through ``slot_harness.Bound`` (a slot map of its
own, as a page table's tier would give it). The file stays whole (over 400 lines): the scripted,
property and differential tests share its strategies, the request helpers and the reference
runner, and kvaware's differential tests read best next to its scripted ones."""

from __future__ import annotations

import gc
import itertools
import random
import sys
import types
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import PageTable
from tierkv.errors import PageTableError, TierKVError
from tierkv.policies import (
    DEFAULT_POLICY,
    POLICIES,
    ARCPolicy,
    ChainHint,
    EvictionPolicy,
    KVAwarePolicy,
    LFUPolicy,
    LRUPolicy,
    PageHint,
    S3FIFOPolicy,
    create_policy,
)
from tierkv.policies import history as history_module
from tierkv.policies.base import ChainPart
from tierkv.policies.history import History
from tierkv.policies.kvaware_loops import NATIVE, PYTHON, Loops
from tierkv.policies.links import Links
from tierkv.traces import KINDS, synthetic_trace

sys.path.insert(0, str(Path(__file__).parent))
from kvaware_ref import RefKVAware
from policy_refs import KeyPolicy
from slot_harness import Bound


def always(key: object) -> bool:
    return True


def but(*pinned: object):  # type: ignore[no-untyped-def]
    return lambda key: key not in pinned


# -- scripted sequences (victims computed by hand) ---------------------------------------------


def test_lru_victims_and_pinned_skip() -> None:
    p = Bound(LRUPolicy())
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert p.evict(always) == "b"
    assert p.evict(but("c")) == "a"
    assert p.evict(always) == "c"
    assert p.evict(always) is None


def test_lfu_fewest_uses_then_oldest() -> None:
    p = Bound(LFUPolicy())
    for k in "abc":
        p.insert(k)
    p.touch_many(["a", "a", "b"])  # a:3 b:2 c:1
    assert p.evict(always) == "c"
    p.insert("d")  # d:1
    p.insert("e")  # e:1, newer than d
    assert p.evict(but("d")) == "e"
    assert p.evict(always) == "d"
    assert p.evict(always) == "b"
    p.insert("b")  # resumes from its remembered count: 3
    p.insert("f")
    assert p.evict(always) == "f"
    assert p.evict(always) == "a"  # a:3 is older than b:3
    assert p.evict(always) == "b"


def test_arc_ghost_hit_moves_the_target() -> None:
    p = Bound(ARCPolicy(capacity=2))
    p.insert("a")
    p.insert("b")  # T1 = [a, b]
    p.touch("a")  # T1 = [b], T2 = [a]
    assert p.evict(always) == "b"  # |T1| = 1 > p = 0: from T1; B1 = [b]
    p.insert("c")  # T1 = [c]
    assert p.admit("b")  # ghost hit in B1: p = 1
    assert p.target == 1.0
    assert p.evict(always) == "a"  # |T1| = 1 is not > p: from T2; B2 = [a]
    p.insert("b")  # from B1 straight to T2
    assert set("bc") == {k for k in "abc" if k in p} and len(p) == 2
    assert p.evict(always) == "b"  # |T1| = 1 is still not > p = 1: from T2
    assert p.evict(always) == "c"  # T2 is empty: T1


def test_s3fifo_small_queue_promotes_used_pages() -> None:
    p = Bound(S3FIFOPolicy(capacity=10))
    for k in "abcdefghij":
        p.insert(k)
    p.touch("a")
    assert p.evict(always) == "b"  # a was used: moved to main
    assert p.evict(but("c")) == "d"  # c pinned: back to the head of S
    p.insert("b")  # remembered in the ghost: straight to main
    assert "b" in p and "d" not in p
    assert p.evict(always) == "e"


def test_kvaware_orphans_go_first() -> None:
    p = Bound(KVAwarePolicy(capacity=4))
    p.insert("r")
    p.insert("x1", PageHint(depth=1, parent="r"))
    p.insert("x2", PageHint(depth=2, parent="x1"))
    p.insert("y", PageHint(depth=1, parent="r"))
    p.touch("r")  # r: 2 uses, priority 3; the others 1 use, priority 2
    assert p.evict(always) == "x1"  # oldest of the lowest priority; x2 is now stranded
    assert p.evict(always) == "x2"  # orphans first
    assert p.evict(but("y")) == "r"
    assert p.evict(always) == "y"
    assert p.evict(always) is None


def test_kvaware_orphan_restored_when_parent_returns() -> None:
    p = Bound(KVAwarePolicy(capacity=4))
    p.insert("a")
    p.insert("b", PageHint(depth=1, parent="a"))
    p.touch("b")
    assert p.evict(but("b")) == "a"  # b becomes an orphan
    p.insert("a")
    p.insert("c")
    assert p.evict(always) == "c"  # b is no longer first in line
    assert p.evict(always) == "a"
    assert p.evict(always) == "b"


def test_kvaware_admission() -> None:
    p = Bound(KVAwarePolicy(capacity=4))
    p.insert("root")
    assert not p.admit("tail", PageHint(depth=1, last=True, parent="root"))
    assert p.admit("r2")  # no parent known: admitted
    assert p.admit("c1", PageHint(depth=1, parent="root", blocks=40))  # extends the chain
    assert not p.admit("c2", PageHint(depth=1, parent="root", blocks=40))  # root is shared
    assert p.admit("c3", PageHint(depth=1, parent="root", blocks=5))  # short request
    assert not p.admit("o", PageHint(depth=3, parent="missing", blocks=40))
    assert p.admit("c2", PageHint(depth=1, parent="root", blocks=40))  # seen before
    assert len(p) == 1


def test_kvaware_admits_the_head_of_a_first_turn() -> None:
    p = Bound(KVAwarePolicy(capacity=4, head_blocks=2))
    p.insert("root")
    first = [
        PageHint(depth=d, prefix_hits=1, parent=f"b{d - 1}" if d > 1 else "root", blocks=40)
        for d in range(1, 5)
    ]
    assert [p.admit(f"b{d}", h) for d, h in enumerate(first, 1)] == [True, True, False, False]
    # a later turn hit past the root: the fan-out rule decides again, and declined pages that
    # come back (the second turn) are stored
    assert p.admit("b3", PageHint(depth=3, prefix_hits=3, parent="b2", blocks=44))
    assert p.admit("x", PageHint(depth=5, prefix_hits=3, parent="b4", blocks=44)) is False
    # short first turns are admitted whole, last blocks never; head_blocks=0 turns it off
    short = [PageHint(depth=d, prefix_hits=1, parent=f"s{d - 1}", blocks=6) for d in (2, 3)]
    assert p.admit("s1", PageHint(depth=1, prefix_hits=1, parent="root", blocks=6))
    assert all(p.admit(f"s{h.depth}", h) for h in short)
    assert not p.admit("z1", PageHint(depth=1, last=True, prefix_hits=1, parent="root"))
    off = Bound(KVAwarePolicy(capacity=4, head_blocks=0))
    off.insert("root")
    assert off.admit("c1", PageHint(depth=1, prefix_hits=1, parent="root", blocks=40))
    assert not off.admit("d1", PageHint(depth=1, prefix_hits=1, parent="root", blocks=40))


def test_kvaware_head_blocks_scale_with_capacity() -> None:
    from tierkv.policies.kvaware import HEAD_PER_PAGES

    p = Bound(KVAwarePolicy(capacity=8 * HEAD_PER_PAGES))
    p.insert("root")
    hints = [
        PageHint(depth=d, prefix_hits=1, parent=d - 1 if d > 1 else "root", blocks=40)
        for d in range(1, 12)
    ]
    assert sum(p.admit(d, h) for d, h in enumerate(hints, 1)) == 8


def test_kvaware_declines_a_large_step_and_favours_a_small_one() -> None:
    p = Bound(KVAwarePolicy(capacity=8, head_blocks=0, step_blocks=3))
    for d, k in enumerate("rab"):  # a conversation's earlier turns: root, a, b (5 uses each)
        p.insert(k, PageHint(depth=d, parent="rab"[d - 1] if d else None))
    for _ in range(4):
        p.touch_many("rab")

    def later(key: str, depth: int, parent: str, blocks: int) -> PageHint:
        return PageHint(depth=depth, prefix_hits=3, parent=parent, blocks=blocks)

    # a later turn brings 4 never-seen blocks in a row (depths 3-6): declined from the first
    assert not p.admit("d3", later("d3", 3, "b", 7))
    assert not p.admit("d4", later("d4", 4, "d3", 7))
    p.insert("root2")  # the batch ends
    assert p.admit("d3", later("d3", 3, "b", 8))  # remembered: the next turn stores it
    p.insert("d3", later("d3", 3, "b", 8))
    # a small step (2 new blocks: 3 and the last): admitted, and starts at two uses
    assert p.admit("s3", later("s3", 3, "b", 5))
    p.insert("s3", later("s3", 3, "b", 5))
    p.insert("n")  # a new page with one use
    # one use (priority 2) goes before two (5): d3 came back from the history, s3 is a small step
    assert [p.evict(always) for _ in range(4)] == ["root2", "n", "d3", "s3"]
    stats = p.stats()
    assert (stats["declined_step"], stats["readmitted"], stats["admitted"]) == (2, 1, 1)
    assert stats["step_blocks"] == 3 and stats["head_blocks"] == 0
    # step_blocks=0 turns the rule off: large steps are admitted, small ones start at one use
    off = Bound(KVAwarePolicy(capacity=8, head_blocks=0, step_blocks=0))
    off.insert("r")
    off.insert("a", PageHint(depth=1, parent="r"))
    assert off.admit("x", PageHint(depth=2, prefix_hits=2, parent="a", blocks=40))


def test_kvaware_step_blocks_scale_with_capacity() -> None:
    from tierkv.policies.kvaware import STEP_BLOCKS, STEP_PER_PAGES

    for capacity, step in ((100, STEP_BLOCKS), (10 * STEP_PER_PAGES, 10)):
        p = Bound(KVAwarePolicy(capacity=capacity, head_blocks=0))
        p.insert("r")
        p.insert("a", PageHint(depth=1, parent="r"))
        big = PageHint(depth=2, prefix_hits=2, parent="a", blocks=2 + step)
        small = PageHint(depth=2, prefix_hits=2, parent="a", blocks=1 + step)
        assert not p.admit("x", big)
        p.insert("y")
        assert p.admit("z", small)


def test_kvaware_scan_gate_closes_on_a_loop_and_opens_again() -> None:
    p = Bound(KVAwarePolicy(capacity=4, head_blocks=0, step_blocks=0))
    hint = PageHint(blocks=1)  # any hint: the history's rules apply

    def round_trip(key: int, used: bool) -> None:
        """``key`` comes in (back from the history after its first time) and leaves."""
        p.insert(key, hint)
        if used:
            p.touch(key)
        assert p.evict(always) == key

    with mock.patch("tierkv.policies.kvaware_admission.SCAN_WARMUP", 16):
        for k in range(4):
            round_trip(k, used=False)  # first time: not from the history, no sample
        for _ in range(4):  # a loop: each page comes back and leaves unused, 16 samples
            for k in range(4):
                assert p.admit(k, hint)
                round_trip(k, used=False)
        # the history is a scan's now: 7 of 8 returning pages are declined, 1 is a probe
        assert [p.admit(k % 4, hint) for k in range(16)].count(True) == 2
        assert p.stats()["scan_gate_closed"] == 1 and p.stats()["returning_used"] == 0.0
        assert p.stats()["declined_history_scan"] == 14
        assert p.admit(99, hint)  # a never-seen page is not the history's
        round_trip(0, used=True)  # returning pages are used again: the gate opens
        assert all(p.admit(k, hint) for k in range(4))


def test_kvaware_never_seen_last_block_goes_first() -> None:
    p = Bound(KVAwarePolicy(capacity=4))
    p.insert("a")
    p.insert("z", PageHint(depth=1, last=True, parent="a"))
    p.insert("b")
    assert p.evict(always) == "z"


def test_kvaware_once_used_page_is_worth_less_than_count_plus_one() -> None:
    # values in half units: one use 2, two uses 5 (with count + 1 for both, "a" would go)
    p = Bound(KVAwarePolicy(capacity=3))
    p.insert("a")
    p.insert("b")
    p.touch("a")  # two uses, priority 0 + 5
    assert p.evict(always) == "b"  # priority 2; L becomes 2
    p.insert("c")  # one use, priority 2 + 2 = 4 < 5
    assert p.evict(always) == "c"
    assert p.evict(always) == "a"


# -- properties --------------------------------------------------------------------------------

KEYS = st.integers(0, 11)
OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "touch", "remove", "evict", "admit"]),
        KEYS,
        st.frozensets(KEYS, max_size=6),
        st.booleans(),
    ),
    max_size=80,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_policy_matches_a_set(name: str, ops: list[tuple[str, int, frozenset[int], bool]]) -> None:
    p = Bound(create_policy(name), 16)
    model: set[int] = set()
    for op, key, pinned, last in ops:
        hint = PageHint(depth=key % 4, last=last, parent=key - 1 if key % 4 else None)
        if op == "insert" and key not in model:
            p.insert(key, hint)
            model.add(key)
        elif op == "touch" and key in model:
            p.touch(key)
        elif op == "remove" and key in model:
            p.remove(key)
            model.discard(key)
        elif op == "admit" and key not in model:
            p.admit(key, hint)
        elif op == "evict":
            victim = p.evict(lambda k, pinned=pinned: k not in pinned)  # type: ignore[misc]
            if model - pinned:
                assert victim in model and victim not in pinned
                model.discard(victim)
            else:
                assert victim is None
        assert len(p) == len(model)
        assert all((k in p) == (k in model) for k in range(12))


# -- kvaware: the slot implementation decides exactly as the key-based reference ----------------


def _request(chain: int, n: int, blocks: int, hits: int = 0) -> tuple[list[int], list[PageHint]]:
    """The first ``n`` blocks of conversation ``chain`` (ids 6c..6c+5, each extending the one
    before), hinted as the replay hints them (``hits``: the request's resident prefix)."""
    keys = [6 * chain + i for i in range(n)]
    hints = [PageHint(i, i == n - 1, hits, keys[i - 1] if i else None, blocks) for i in range(n)]
    return keys, hints


PT_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "store",
                "store",
                "store",
                "store",
                "done",
                "done",
                "load",
                "unload",
                "touch",
                "remove",
                "evict",
                "moved",
                "rekey",
                "chain",
                "chain",
                "fork",
            ]
        ),
        st.integers(0, 4),  # a conversation (or, for touch, the number of uses)
        st.integers(0, 6),  # blocks, or how many pages
        st.integers(0, 16),  # the request's block count (hint.blocks)
        st.booleans(),
    ),
    max_size=80,
)


CONFIGS = [{}, {"step_blocks": 2, "head_blocks": 1}]  # defaults; small steps and heads (taken)
# kvaware's inner loops: the Python reference, and the C extension where it was built
LOOPS = [
    pytest.param(PYTHON, id="python"),
    pytest.param(NATIVE, id="c", marks=pytest.mark.skipif(NATIVE is None, reason="not built")),
]


@pytest.mark.parametrize("loops", LOOPS)
@pytest.mark.parametrize("config", CONFIGS, ids=["defaults", "small-steps"])
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(2, 8), ops=PT_OPS)
def test_kvaware_matches_its_key_reference(
    loops: Loops, config: dict[str, int], capacity: int, ops: list[tuple[str, int, int, int, bool]]
) -> None:
    """Every call, victim and residency of kvaware equals the key-based reference's; stores
    hinted per page and by one ChainHint (the table derives the page hints) alike. With small
    ``step_blocks`` the step rule declines (it never does at the defaults on these tiers).
    Both inner loops (Python and C) are held to it."""
    policies = {
        "kvaware-slots": lambda: KVAwarePolicy(**config, loops=loops),
        "kvaware-keys": lambda: KeyPolicy(RefKVAware(**config)),
    }
    with (
        mock.patch.dict(POLICIES, policies),
        mock.patch("tierkv.policies.kvaware_admission.SCAN_WARMUP", 3),  # opens and closes
    ):
        _match_the_reference(capacity, ops, policies)


def test_kvaware_declines_a_large_step_under_a_chain_hint_as_the_reference() -> None:
    """The batch admission of a ChainHint (readmissions and step declines judged in the loop)
    against the reference, on a run the step rule declines."""
    config = CONFIGS[1]
    policies = {
        "kvaware-slots": lambda: KVAwarePolicy(**config),
        "kvaware-keys": lambda: KeyPolicy(RefKVAware(**config)),
    }
    ops = [  # fill a 4-page tier with two chains, then a later turn adds 3 blocks to chain 0
        ("store", 0, 2, 2, False),
        ("done", 1, 0, 0, True),
        ("store", 1, 2, 2, False),
        ("done", 1, 0, 0, True),
        ("chain", 0, 5, 5, False),
        ("chain", 0, 5, 5, False),  # the declined blocks come back: readmitted
    ]
    with mock.patch.dict(POLICIES, policies):
        tables = _match_the_reference(4, ops, policies)
    stats = tables[0].policy("t").stats()
    assert stats["declined_step"] == 2 and stats["declined_last"] >= 1
    assert stats["readmitted"] >= 2
    assert stats == tables[1].policy("t").stats()


@pytest.mark.parametrize("touch", [0, 1, 2])
def test_kvaware_strands_every_sibling_as_the_reference(touch: int) -> None:
    """A page with two resident children (a fork off conversation 0's first block) is evicted:
    both children are orphans, in the reference's order."""
    policies = {
        "kvaware-slots": KVAwarePolicy,
        "kvaware-keys": lambda: KeyPolicy(RefKVAware()),
    }
    ops = [
        ("store", 0, 3, 3, False),  # 0 -> 1 -> 2
        ("done", 1, 0, 0, True),
        ("fork", 0, 2, 0, True),  # 0 -> 1000 -> 1001
        ("done", 1, 0, 0, True),
        ("touch", touch, 0, 0, False),  # uses of the most recent pages: other rankings
        ("evict", 0, 1, 0, False),
        ("evict", 0, 1, 0, False),
        ("evict", 0, 3, 0, False),
        ("evict", 0, 3, 0, False),
    ]
    with mock.patch.dict(POLICIES, policies):
        tables = _match_the_reference(5, ops, policies)
    assert tables[0].used("t") <= 5


@pytest.mark.parametrize("loops", LOOPS)
def test_kvaware_matches_its_key_reference_on_an_op_stream(loops: Loops) -> None:
    """The op stream of ``benchmarks/op_stream.py`` on a 64-page tier (conversations that grow
    turn by turn off a shared system prompt, one ChainHint per request, the hits pinned while
    the misses are stored): long orphan cascades, cut short where the victims asked for run
    out, the history trimmed as they run, runs kept in part. Every lookup, victim, refusal and
    admission counter is the key-based reference's (with the Python and the C loops)."""
    policies = {
        "kvaware-slots": lambda: KVAwarePolicy(loops=loops),
        "kvaware-keys": lambda: KeyPolicy(RefKVAware()),
    }
    with mock.patch.dict(POLICIES, policies):
        tables = [PageTable({"t": 64}, name) for name in policies]
    rng = random.Random(7)
    length, base, fresh = [0] * 24, [0] * 24, 1 << 20
    cascades = 0  # victims evicted right after their parent (an orphan cascade)
    for _ in range(1500):
        c = min(int(rng.paretovariate(1.0)) - 1, 23)
        grow = rng.randint(2, 12)
        if not length[c] or length[c] + grow > 40:  # a new conversation in this place
            base[c], fresh, length[c] = fresh, fresh + 40, 0
        length[c] += grow
        ids = list(range(4)) + [base[c] + j for j in range(length[c])]
        seen = []
        for t in tables:
            h = t.lookup(ids, "t")
            hit = ids[:h]
            if h:
                t.touch(hit, "t")
                t.prepare_load(hit, "t")
            hint = ChainHint(h, ids[h - 1] if h else None, h, len(ids))
            alloc = t.prepare_store(ids[h:], "t", hint)
            if alloc is not None:
                t.complete_store(alloc.keys, "t")
            if h:
                t.complete_load(hit, "t")
            seen.append((h, alloc))
        assert seen[0] == seen[1]
        alloc = seen[0][1]
        if alloc is not None:
            cascades += sum(b == a + 1 for a, b in itertools.pairwise(alloc.evicted))
    assert sorted(tables[0].keys("t")) == sorted(tables[1].keys("t"))
    stats = tables[0].policy("t").stats()
    assert stats == tables[1].policy("t").stats()
    assert cascades > 500 and stats["declined_step"] > 0 and stats["readmitted"] > 0


@pytest.mark.skipif(NATIVE is None, reason="the C extension was not built")
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), capacity=st.integers(8, 48))
def test_kvaware_c_loops_equal_the_python_loops(seed: int, capacity: int) -> None:
    """The C loops (policies/_kvaware.c) against their Python reference (kvaware_loops.py) on
    a random op stream: conversations off a shared prompt, hits pinned while misses are
    stored, evictions whose write-back fails (victims restored), evictions an announced order
    chooses (``evict_chosen``: the loop without a scan), rekeys and removes. After
    every request both tables hold the same pages, rank every page the same as the next
    victims and keep the same history and counters."""
    policies = {
        "kvaware-c": lambda: KVAwarePolicy(loops=NATIVE),
        "kvaware-py": lambda: KVAwarePolicy(loops=PYTHON),
    }
    with mock.patch.dict(POLICIES, policies):
        tables = [PageTable({"t": capacity}, name) for name in policies]
    rng = random.Random(seed)
    length, base, fresh = [0] * 12, [0] * 12, 1 << 20
    for _ in range(150):
        c = min(int(rng.paretovariate(1.0)) - 1, 11)
        grow = rng.randint(1, 8)
        if not length[c] or length[c] + grow > 30:
            base[c], fresh, length[c] = fresh, fresh + 30, 0
        length[c] += grow
        ids = list(range(3)) + [base[c] + j for j in range(length[c])]
        roll, evict, written = rng.random(), rng.randint(1, 4), rng.random() < 0.5
        shuffle, share = rng.random(), rng.random()
        fresh += 2
        out = []
        for t in tables:
            if roll < 0.1:  # an eviction whose write-back may fail (restored)
                victims = t.prepare_evict("t", evict)
                t.complete_evict([k for k, _ in victims], "t", written)
            elif 0.2 <= roll < 0.3:  # victims an announced order chose (evict_chosen)
                order = sorted(t.keys("t"))
                random.Random(shuffle).shuffle(order)
                order = order[: max(1, int(share * 1.5 * len(order)))]  # all of them, or some
                victims = t.prepare_evict("t", evict, keep=set(order), keep_order=order)
                t.complete_evict([k for k, _ in victims], "t", written)
            elif roll < 0.15:
                old = t.present(ids, "t")[:2]
                t.rekey(old, [fresh - 2 + i for i in range(len(old))], "t")
            elif roll < 0.2:
                t.remove(t.present(ids, "t")[-2:], "t")
            h = t.lookup(ids, "t")
            if h:
                t.touch(ids[:h], "t")
                t.prepare_load(ids[:h], "t")
            hint = ChainHint(h, ids[h - 1] if h else None, h, len(ids) if roll < 0.9 else 0)
            alloc = t.prepare_store(ids[h:], "t", hint)
            if alloc is not None:
                t.complete_store(alloc.keys, "t", roll > 0.03)
            if h:
                t.complete_load(ids[:h], "t")
            t.check()
            out.append((h, alloc, t.candidates("t", capacity), t.take_events()))
        assert out[0] == out[1]
        assert tables[0].policy("t").stats() == tables[1].policy("t").stats()
    histories = [
        [list(v) for v in vars(t.policy("t")).values() if isinstance(v, History)] for t in tables
    ]
    assert histories[0] == histories[1] and histories[0][0]


@pytest.mark.parametrize("loops", LOOPS)
def test_kvaware_history_stays_whole_when_can_evict_raises(loops: Loops) -> None:
    """A predicate that raises mid-scan leaves the history's stamps in step with its keys (the
    loop writes its stamp counter back on the way out): later victims are remembered, none
    overwrites another's stamp."""
    with mock.patch.dict(POLICIES, {"kv": lambda: KVAwarePolicy(loops=loops)}):
        table = PageTable({"t": 8}, "kv")
    for c in range(4):
        keys = [100 * c + j for j in range(4)]
        alloc = table.prepare_store(keys, "t", ChainHint(0, None, 0, 4))
        assert alloc is not None
        table.complete_store(alloc.keys, "t")
    policy = table.policy("t")
    calls = itertools.count()

    def flaky(s: int) -> bool:
        if next(calls) == 2:
            raise RuntimeError("predicate failed")
        return True

    with pytest.raises(RuntimeError, match="predicate failed"):
        policy.evict_slots(4, flaky)
    (hist,) = [v for v in vars(policy).values() if isinstance(v, History)]
    assert len(hist) >= 2 and max(hist.order) < hist.stamp
    policy.evict_slots(1, None)
    assert len(hist.order) == len(hist.value)


def test_kvaware_a_returning_page_keeps_its_stranded_children_when_its_batch_extends_it() -> None:
    """A page comes back in a run whose next block extends it while children its eviction
    stranded are still resident: the new block joins them (evicting the page again strands all
    three), as in the reference. The insert's fast path for a block extending the one just
    queued must not take this case for a first child."""
    outs = []
    for policy in (KVAwarePolicy(), KeyPolicy(RefKVAware())):
        p = Bound(policy, 8)
        p.insert_many([0, 1, 2], ChainHint(0, None, 0, 0))  # 0 -> 1 -> 2
        p.insert_many([10], [PageHint(2, False, 0, 1, 0)])  # 1 -> 10, a fork
        assert p.evict_many(1, lambda k: k == 1) == [1]  # 2 and 10 are orphans now
        p.insert_many([1, 3], ChainHint(1, 0, 0, 0))  # 1 is back, with a new child 3
        p.touch_many([2, 3, 10])  # worth more than 0 and 1: only orphans go before them
        outs.append(p.evict_many(4, lambda k: k != 0))
    assert outs[0] == outs[1]
    assert outs[0][0] == 1 and sorted(outs[0][1:]) == [2, 3, 10]


def test_kvaware_a_small_step_counts_in_its_parents_fanout_as_the_reference() -> None:
    """A later turn's small step of two blocks: the second extends the first, admitted in the
    same batch, and counts as its child (its fan-out is 1 once inserted), so a never-seen block
    forking off it later is declined, as in the reference (the short-request rule is off)."""
    outs = []
    for policy in (KVAwarePolicy(short_request=0), KeyPolicy(RefKVAware(short_request=0))):
        p = Bound(policy, 16)
        p.insert_many([0, 1, 2], ChainHint(0, None, 0, 0))  # 0 -> 1 -> 2
        step = ChainHint(3, 2, 3, 6)  # blocks 3..5 of a 6-block request: 5 is its last
        kept = policy.admit_many([100, 101, 102], step)
        assert kept == [True, True, False]
        p.insert_many([100, 101], ChainPart(step, [100, 101, 102], kept))
        fork = policy.admit_many([200], ChainHint(5, 100, 5, 8))  # another child of 100
        outs.append((kept, fork, policy.stats()))
    assert outs[0] == outs[1]
    assert outs[0][1] == [False] and outs[0][2]["declined_fanout"] == 1


def _match_the_reference(
    capacity: int, ops: list[tuple[str, int, int, int, bool]], policies: dict[str, Any]
) -> list[PageTable]:
    tables = [PageTable({"t": capacity}, name) for name in policies]
    assert isinstance(tables[0].policy("t"), KVAwarePolicy)
    assert isinstance(tables[1].policy("t"), KeyPolicy)
    writing: list[list[int]] = []  # outstanding prepare_store / prepare_load / prepare_evict
    loaded: list[list[int]] = []
    moving: list[list[int]] = []
    fresh = itertools.count(100)

    def run(method: str, *args: Any) -> list[Any]:
        out: list[Any] = []
        for t in tables:
            try:
                out.append(getattr(t, method)(*args))
            except PageTableError as exc:
                out.append(type(exc))
        assert out[0] == out[1], (method, args, out)
        for t in tables:
            t.check()
        return out

    for op, chain, num, blocks, flag in ops:
        ref = tables[1]
        keys, hints = _request(chain, max(num, 1), blocks)
        if op == "store":
            if flag:  # a page with no parent
                keys, hints = keys[-1:], [PageHint(blocks=blocks)]
            else:  # hinted with the resident prefix, as the replay does (later turns, steps)
                keys, hints = _request(chain, max(num, 1), blocks, ref.lookup(keys, "t"))
            alloc = run("prepare_store", keys, "t", hints)[0]
            if alloc is not None and alloc.keys:
                writing.append(alloc.keys)
        elif op == "chain":  # a request's misses with one ChainHint, or all of it (flag)
            keys = _request(chain, max(num, 1), blocks)[0]
            h = ref.lookup(keys, "t")
            store = keys if flag else keys[h:]
            at = len(keys) - len(store)
            hint = ChainHint(at, keys[at - 1] if at else None, h, len(keys) if blocks else 0)
            alloc = run("prepare_store", store, "t", hint)[0]
            if alloc is not None and alloc.keys:
                writing.append(alloc.keys)
        elif op == "fork":  # a branch off conversation 0's block ``blocks % 6``: siblings
            at = blocks % 6 + 1
            keys = [1000 + 10 * chain + i for i in range(max(num, 1))]
            if flag:
                hint: Any = ChainHint(at, at - 1, ref.lookup(list(range(at)), "t"), at + num)
            else:
                parents = [at - 1, *keys[:-1]]
                hint = [PageHint(at + i, False, 2, parents[i], 40) for i in range(len(keys))]
            alloc = run("prepare_store", keys, "t", hint)[0]
            if alloc is not None and alloc.keys:
                writing.append(alloc.keys)
        elif op == "done" and writing:
            run("complete_store", writing.pop(0), "t", flag or chain > 0)
        elif op == "load":
            prefix = keys[: ref.lookup(keys, "t")]
            if prefix:
                run("prepare_load", prefix, "t")
                loaded.append(prefix)
        elif op == "unload" and loaded:
            run("complete_load", loaded.pop(0), "t")
        elif op == "touch":  # ``chain`` + 1 uses of every resident page, most recent first
            for _ in range(chain + 1):
                run("touch", ref.keys("t")[::-1][: blocks + 1], "t")
        elif op == "remove":
            run("remove", ref.present(keys, "t"), "t")
        elif op == "evict":
            victims = run("prepare_evict", "t", num % 4)[0]
            if victims:
                moving.append([k for k, _ in victims])
        elif op == "moved" and moving:
            run("complete_evict", moving.pop(0), "t", flag)
        elif op == "rekey":
            old = ref.present(keys, "t")[:2]
            run("rekey", old, [next(fresh) for _ in old], "t")
        assert tables[0].take_events() == tables[1].take_events()
        assert sorted(tables[0].keys("t")) == sorted(tables[1].keys("t"))
    return tables


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_bound_policy_refuses_a_second_binding(name: str) -> None:
    table = PageTable({"t": 4}, name)
    with pytest.raises(TierKVError, match="bound to a tier already"):
        table.policy("t").bind_slots(4, {})


def test_chain_hint_derives_the_page_hints() -> None:
    chain = ChainHint(depth=2, parent="b", prefix_hits=2, blocks=5)
    assert chain.hints(["c", "d", "e"]) == [
        PageHint(2, False, 2, "b", 5),
        PageHint(3, False, 2, "c", 5),
        PageHint(4, True, 2, "d", 5),
    ]
    assert chain.hints(["c", "d", "e"], [True, False, True]) == [
        PageHint(2, False, 2, "b", 5),
        PageHint(4, True, 2, "d", 5),
    ]
    assert ChainHint().hints(["x"]) == [PageHint()]  # blocks unknown: no last block


# -- the ghost history ------------------------------------------------------------------------

HISTORY_OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "many", "pop", "touch", "oldest", "trim"]), KEYS, st.integers(0, 15)
    ),
    max_size=120,
)


@pytest.mark.parametrize("native", [False, True], ids=["python", "c"])
@settings(max_examples=300, deadline=None)
@given(ops=HISTORY_OPS)
def test_history_keeps_an_ordered_dicts_order(
    native: bool, ops: list[tuple[str, int, int]]
) -> None:
    """History is the OrderedDict it replaced: put (to the newest end), pop, move_to_end,
    popitem(last=False), trimming; same keys, counts and order after every step (its batch
    operations in Python and, where built, in C)."""
    if native and history_module._TRIM is None:
        pytest.skip("the C extension was not built")
    with (
        mock.patch.object(history_module, "_TRIM", history_module._TRIM if native else None),
        mock.patch.object(
            history_module, "_PUT_MANY", history_module._PUT_MANY if native else None
        ),
    ):
        _history_against_a_model(ops)


def _history_against_a_model(ops: list[tuple[str, int, int]]) -> None:
    h, model = History(), OrderedDict[int, int]()
    for op, k, c in ops:
        if op == "put":
            h.put(k, c)
            model[k] = c
            model.move_to_end(k)
        elif op == "many":  # k, k + 1, k again: the last put wins
            h.put_many([k, k + 1, k], c)
            for key in (k, k + 1, k):
                model[key] = c
                model.move_to_end(key)
        elif op == "pop":
            assert h.pop(k, -1) == model.pop(k, -1)
        elif op == "touch" and k in model:
            h.touch(k)
            model.move_to_end(k)
        elif op == "oldest" and model:
            assert h.pop_oldest() == model.popitem(last=False)[0]
        elif op == "trim":  # limits below 0 (ARC's arithmetic can give them) empty it
            h.trim(c / 2 - 2)
            while model and len(model) > c / 2 - 2:
                model.popitem(last=False)
        assert list(h) == list(model)
        assert [h.get(key) for key in h] == list(model.values())
        assert len(h) == len(model) and (k in h) == (k in model)
    h.clear()
    assert not h and h.get(0, 7) == 7
    with pytest.raises(KeyError, match="empty"):
        h.pop_oldest()


def test_a_stale_or_disabled_extension_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extension built from another source (no ABI, or another one) or turned off with
    TIERKV_NATIVE_POLICY=0 leaves kvaware on its Python loops and the history on its Python
    trim, instead of calling C functions with the wrong arguments."""
    from tierkv.policies import kvaware_loops

    stale = types.ModuleType("tierkv.policies._kvaware")
    stale.DECAY = 0.999  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tierkv.policies._kvaware", stale)
    assert kvaware_loops._native() is None and history_module._native() is None
    stale.ABI = kvaware_loops.ABI + 1  # type: ignore[attr-defined]
    assert kvaware_loops._native() is None and history_module._native() is None
    monkeypatch.delitem(sys.modules, "tierkv.policies._kvaware")
    monkeypatch.setenv("TIERKV_NATIVE_POLICY", "0")
    assert kvaware_loops._native() is None and history_module._native() is None


@pytest.mark.skipif(NATIVE is None, reason="the C extension was not built")
def test_kvaware_per_slot_int_tables_are_not_walked_by_the_collector() -> None:
    """With its C loops, kvaware's per-slot ints (priorities, use codes, fan-outs, links: nine
    per page) live in array('q')s: a collector pass visits each as one object (its type), not
    entry by entry as it walks a list."""
    table = PageTable({"t": 16}, "kvaware")
    policy = table.policy("t")
    tables = [v for v in vars(policy).values() if isinstance(v, array)]
    (links,) = [v for v in vars(policy).values() if isinstance(v, Links)]
    tables += [links.prev, links.next, links.size, links.queue]
    assert len(tables) == 9
    assert all(isinstance(t, array) and gc.get_referents(t) == [array] for t in tables)


@pytest.mark.parametrize("name", ["kvaware", "lfu", "arc", "s3fifo"])
def test_ghost_histories_are_not_tracked_by_the_collector(name: str) -> None:
    """Issue 17: a policy's ghosts (120,000 keys with 10,000 idle sequences) are dicts of
    bytes and ints the collector does not track, so a full pass does not walk them."""
    table = PageTable({"t": 32}, name)
    for turn in range(40):  # conversations that come back: ghosts made and hit
        keys = [b"sys"] + [b"c%d-%d" % (turn % 7, j) for j in range(turn % 9 + 2)]
        h = table.lookup(keys, "t")
        table.touch(keys[:h], "t")
        alloc = table.prepare_store(keys[h:], "t", ChainHint(h, keys[h - 1] if h else None, h))
        if alloc is not None:
            table.complete_store(alloc.keys, "t")
    histories = [v for v in vars(table.policy("t")).values() if isinstance(v, History)]
    assert histories and sum(map(len, histories)) > 0
    for hist in histories:
        assert not gc.is_tracked(hist.value) and not gc.is_tracked(hist.order)


# -- registry ----------------------------------------------------------------------------------


def test_registry() -> None:
    assert {"lru", "lfu", "arc", "s3fifo", "kvaware"} <= set(POLICIES)
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        p = create_policy(name)
        assert isinstance(p, EvictionPolicy) and p.name == name and len(p) == 0
    with pytest.raises(ValueError, match="unknown eviction policy"):
        create_policy("nope")


# -- synthetic traces --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_traces_are_chained_and_deterministic(kind: str) -> None:
    trace = synthetic_trace(kind, 300, seed=3)
    assert trace == synthetic_trace(kind, 300, seed=3)
    assert len(trace) == 300
    parent: dict[int, int] = {}
    for req in trace:
        assert req[0] == 0
        for a, b in itertools.pairwise(req):
            assert parent.setdefault(b, a) == a


def test_synthetic_trace_errors() -> None:
    with pytest.raises(ValueError, match="unknown trace kind"):
        synthetic_trace("nope", 1)
    with pytest.raises(ValueError):
        synthetic_trace("loop", -1)
