"""Issue 26: the victims of an announced order found in numpy (tierkv.evict_order), and pins
of many slots changed at once (tierkv.slot_pins), choose and change exactly what the Python
walks they replaced did.

The walk over the order from its end, once per eviction, was most of a batch-32 step's store
time (benchmarks/step.py); each slot now holds its page's place in the order, kept as pages
come and go. A random run of every page-table call that takes, frees or renames a slot checks
after each call that those places are exact (``PageTable.check``) and that each eviction takes
the pages the old walk took.
"""

from __future__ import annotations

import random
from array import array

import pytest

from tierkv import PageTable
from tierkv.errors import PinError
from tierkv.page_table import PageState
from tierkv.slot_pins import SMALL, add_pins, drop_pins

READABLE = int(PageState.READABLE)


def _walk(table: PageTable, order: tuple[bytes, ...], n: int) -> set[bytes]:
    """The old walk: from the end of the order, the first ``n`` readable unpinned pages."""
    t = table._tiers["d"]
    out: list[bytes] = []
    for k in reversed(order):
        s = t.slot_of.get(k)
        if s is not None and not t.pins[s] and t.state[s] == READABLE and k not in out:
            out.append(k)
            if len(out) >= n:
                break
    return set(out)


@pytest.mark.parametrize("policy", ["kvaware", "lru", "arc"])
@pytest.mark.parametrize("seed", range(4))
def test_order_victims_match_the_walk_through_every_slot_change(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    table = PageTable({"d": 40, "h": 400}, policy)
    universe = [bytes([seed, i]) * 5 for i in range(120)]
    pinned: list[bytes] = []
    order: tuple[bytes, ...] = ()
    for _ in range(400):
        here = table.present(universe, "d")
        op = rng.random()
        if op < 0.3:  # pages arrive (evicting by policy when full)
            keys = rng.sample([k for k in universe if k not in here], rng.randint(1, 8))
            alloc = table.prepare_store(keys, "d")
            if alloc is not None:
                table.complete_store(alloc.keys, "d", ok=rng.random() < 0.9)
        elif op < 0.4:  # a new order (a new step), some keys named twice, some not resident
            order = tuple(rng.choices(universe, k=rng.randint(10, 150)))
        elif op < 0.55 and here:  # pins come and go
            if pinned and rng.random() < 0.5:
                table.complete_load(pinned, "d")
                pinned = []
            else:
                asked = rng.sample(universe, 70)  # some absent, some moving or writing
                ks = table.readable(asked, "d")
                got, rest = table.pin_readable(asked, "d")  # (the pins of prepare_load)
                assert got == ks and rest == [k for k in asked if k not in set(ks)]
                pinned += ks
        elif op < 0.85 and order:  # an eviction by the order: the walk's pages, no others
            kept = frozenset(order)
            free = table.idle(here, "d")
            unkept = {k for k in free if k not in kept}  # these go first, by policy
            n = rng.randint(1, max(1, len(free)))
            walked = _walk(table, order, n - len(unkept))
            got = table.prepare_evict("d", n, keep=kept, keep_order=order)
            keys = set(k for k, _ in got)
            assert len(keys) == min(n, len(free))
            if n <= len(unkept):
                assert keys <= unkept
            else:  # then the order's, latest first: the walk's pages
                assert keys == unkept | walked
            table.complete_evict(list(keys), "d", ok=rng.random() < 0.8)
        elif op < 0.93 and here:  # pages dropped
            idle = table.idle(here, "d")
            if idle:
                table.remove(rng.sample(idle, min(3, len(idle))), "d")
        elif here:  # a rename (a publish): the page keeps its slot under a new key
            idle = table.idle(here, "d")
            free = [k for k in universe if k not in here]
            if idle and free:
                table.rekey([idle[0]], [free[0]], "d")
        table.check()  # (the slots' places in the order included)


@pytest.mark.parametrize("n", [SMALL - 1, SMALL, 700])
def test_pins_of_many_slots_change_as_the_loop_did(n: int) -> None:
    rng = random.Random(n)
    for _ in range(30):
        cap = 300
        state = bytearray(rng.choice([READABLE, 2]) for _ in range(cap))
        pins = array("l", [rng.choice([0, 0, 1, 2]) for _ in range(cap)])
        slots = [rng.randrange(cap) for _ in range(n)]  # repeats included
        ref = array("l", pins)
        newly = len({s for s in slots if ref[s] == 0})
        for s in slots:
            ref[s] += 1
        assert add_pins(pins, slots) == newly and pins == ref
        # unpinning: as often as pinned (fine), or once more for one slot (nothing changes)
        after = array("l", pins)
        extra = slots + [slots[0]] * (pins[slots[0]] - slots.count(slots[0]) + 1)
        bad, freed = drop_pins(pins, extra, state, READABLE)
        assert bad is not None and extra[bad] == slots[0] and freed == 0
        assert pins == after
        bad, freed = drop_pins(pins, slots, state, READABLE)
        assert bad is None
        for s in slots:
            after[s] -= 1
        assert pins == after
        assert freed == len({s for s in slots if after[s] == 0 and state[s] == READABLE})


def test_a_page_unpinned_too_often_raises_pin_error_and_changes_nothing() -> None:
    table = PageTable({"d": 200})
    keys = [bytes([7, i]) * 5 for i in range(150)]
    table.complete_store(table.prepare_store(keys, "d").keys, "d")  # type: ignore[union-attr]
    table.prepare_load(keys, "d")
    with pytest.raises(PinError):
        table.complete_load(keys + keys[:1], "d")
    table.complete_load(keys, "d")  # each still pinned once: nothing changed above
    table.check()


@pytest.mark.parametrize("n", [SMALL - 1, SMALL, 600])
def test_pin_readable_pins_what_readable_names(n: int) -> None:
    rng = random.Random(n)
    table = PageTable({"d": 1000})
    keys = [bytes([9, i % 256, i // 256]) * 4 for i in range(900)]
    table.complete_store(table.prepare_store(keys[:500], "d").keys, "d")  # type: ignore[union-attr]
    table.prepare_store(keys[500:600], "d")  # WRITING: not readable
    table.prepare_evict("d", 50)  # MOVING: not readable
    asked = rng.sample(keys, n)  # some absent (the last 300 were never stored)
    want = table.readable(asked, "d")
    got, rest = table.pin_readable(asked, "d")
    assert got == want and rest == [k for k in asked if k not in set(want)]
    t = table._tiers["d"]
    assert all(t.pins[t.slot_of[k]] == 1 for k in got)
    table.complete_load(got, "d")
    table.check()


@pytest.mark.parametrize("seed", range(6))
def test_small_tier_python_pass_picks_what_numpy_picks(seed: int) -> None:
    # issue 26 (tierkv demo): tiers of a few hundred slots take a Python pass; both agree
    from tierkv.evict_order import SMALL, OrderIndex

    rng = random.Random(seed)
    cap = rng.choice([8, 67, SMALL, SMALL + 40])
    universe = [bytes([seed, i % 256, i // 256]) for i in range(3 * cap)]
    order = rng.sample(universe, rng.randint(1, 2 * cap))
    used = rng.sample(range(cap), rng.randint(0, cap))
    key_of = dict(zip(used, rng.sample(universe, len(used))))
    index = OrderIndex(order, cap, key_of)
    state = bytearray(rng.choice([READABLE, READABLE, 0]) for _ in range(cap))
    pins = array("i", (rng.choice([0, 0, 0, 2]) for _ in range(cap)))
    for n in (1, 3, cap // 2, cap, 2 * cap):
        want = index.latest_np(n, state, pins, READABLE)
        assert index.latest_py(n, state, pins, READABLE) == want
        assert index.latest(n, state, pins, READABLE) == want
    assert index.held() == sum(1 for k in key_of.values() if k in set(order))


@pytest.mark.parametrize("policy", ["kvaware", "lru", "lfu", "arc", "s3fifo"])
def test_a_put_back_victim_keeps_its_place_and_a_chosen_one_moves_no_other(policy: str) -> None:
    """Victims whose write-back failed (``complete_evict(ok=False)``) go back where they were,
    so the ranking is the one before the eviction: for victims the policy chose (its next
    ones) and for victims an announced order chose from the middle of the ranking. Before,
    the chosen ones went back to the cold end (the next victims, whatever their recency), and
    choosing them moved every page ranked ahead of them to the recent end in LRU, LFU, ARC
    and S3-FIFO (a scan that passed them over as if pinned): cold pages outranked hot ones."""
    table = PageTable({"d": 8}, policy)
    keys = [bytes([i]) * 16 for i in range(8)]
    for k in keys:
        alloc = table.prepare_store([k], "d")
        assert alloc is not None
        table.complete_store(alloc.keys, "d")
    table.touch([keys[2], keys[5]], "d")
    ranked = table.candidates("d", 8)
    assert set(ranked) == set(keys) and ranked[-2:] == [keys[2], keys[5]]

    natural = table.prepare_evict("d", 3)  # the policy's own next victims
    assert [k for k, _ in natural] == ranked[:3]
    table.complete_evict([k for k, _ in natural], "d", False)
    assert table.candidates("d", 8) == ranked

    chosen = [ranked[3], ranked[4]]  # from the middle: the order reads them last
    order = [k for k in ranked if k not in chosen] + chosen
    got = table.prepare_evict("d", 2, keep=set(order), keep_order=order)
    assert {k for k, _ in got} == set(chosen)
    assert table.candidates("d", 8) == [k for k in ranked if k not in chosen]  # none moved
    table.complete_evict([k for k, _ in got], "d", False)
    assert table.candidates("d", 8) == ranked
    table.check()

    got = table.prepare_evict("d", 2, keep=set(order), keep_order=order)  # now written back
    table.complete_evict([k for k, _ in got], "d", True)
    assert table.candidates("d", 8) == [k for k in ranked if k not in chosen]
    table.check()
