"""The add_sequence and release calls of one sequence id take turns (tierkv/seq_flight.py): a
release begun while an add of its id is in flight waits for the add and releases what it
added; an add begun while a release of its id is in flight waits for the release; the same
call twice at once is refused at once; every wait is event-woken and bounded by the store's
timeout, and a sequence is registered whole or not at all."""

from __future__ import annotations

import asyncio

import pytest

from tierkv import prompt
from tierkv.errors import SequenceError, SpecError, StoreTimeoutError
from tierkv.seq_flight import ADD, RELEASE, InFlight
from tierkv.store import KVStore

from .test_store import PAGE, SPEC, fill, no_pins_left


def store_of(**kw: object) -> KVStore:
    return KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=64 * PAGE, codec=None, **kw)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt, "SLICE_TOKENS", 64)  # a 1,000-token prompt hashes in 16 turns


async def test_a_release_of_an_id_being_added_waits_and_releases_it() -> None:
    """Was: the release raised "unknown sequence 'x'" and the add then returned success,
    leaving 'x' live although it was released. Fails on the old code."""
    async with store_of() as store:
        adding = asyncio.create_task(store.add_sequence("x", list(range(1000))))
        await asyncio.sleep(0)
        assert not adding.done() and not store.has_sequence("x")  # hashing: in flight
        await store.release("x")  # waits for the add, then releases what it added
        assert adding.done() and adding.result() == 0
        assert not store.has_sequence("x")
        store.check()
        assert await store.add_sequence("x", list(range(1000))) == 0  # the id is free again
        await no_pins_left(store)


async def test_a_release_of_an_add_that_fails_is_an_unknown_sequence() -> None:
    async with store_of() as store:
        bad = list(range(1000))
        bad[900] = -1  # refused by the slice that holds it: after the add began
        adding = asyncio.create_task(store.add_sequence("x", bad))
        await asyncio.sleep(0)
        with pytest.raises(SequenceError, match="unknown sequence 'x'"):
            await store.release("x")
        with pytest.raises(SpecError):
            await adding
        assert store.sequence_ids() == []
        store.check()


async def test_an_add_of_an_id_being_released_waits_for_the_release() -> None:
    async with store_of(turn_budget=1e-9) as store:  # every call pauses for a loop turn
        await fill(store, "x", 1)
        order: list[str] = []

        async def release() -> None:
            await store.release("x")
            order.append("released")

        async def add() -> None:
            await store.add_sequence("x", [7, 8, 9])
            order.append("added")

        releasing = asyncio.create_task(release())
        await asyncio.sleep(0)  # the release's work is done; it pauses for its turn
        assert not store.has_sequence("x") and not releasing.done()
        await asyncio.gather(add(), releasing)
        assert order == ["released", "added"]
        assert store.sequence("x").tokens == [7, 8, 9]
        await no_pins_left(store)
        store.check()


async def test_the_same_call_twice_at_once_is_refused_at_once() -> None:
    async with store_of(turn_budget=1e-9) as store:
        await store.add_sequence("x", [1, 2, 3])
        releasing = asyncio.create_task(store.release("x"))
        await asyncio.sleep(0)
        with pytest.raises(SequenceError, match="'x'"):
            await store.release("x")  # gone, or being released: either way refused
        await releasing
        adding = asyncio.create_task(store.add_sequence("y", list(range(1000))))
        await asyncio.sleep(0)
        with pytest.raises(SequenceError, match="'y' is being added already"):
            await store.add_sequence("y", [1])
        await adding
        assert store.sequence("y").tokens == list(range(1000))
        store.check()


async def test_a_wait_for_a_call_that_never_returns_is_bounded_and_changes_nothing() -> None:
    flight = InFlight()
    await flight.turn("x", RELEASE, 1.0)  # a release of 'x' that never returns
    with pytest.raises(StoreTimeoutError, match=r"add_sequence\('x'\) waited 0.05 s"):
        await flight.turn("x", ADD, 0.05)
    assert "x" in flight
    flight.end("x")
    assert "x" not in flight
    await flight.turn("x", ADD, 0.05)  # free again: no wait
    waiter = asyncio.create_task(flight.turn("x", RELEASE, 5.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    flight.end("x")  # woken by the end, not by polling
    await waiter
    flight.end("x")
