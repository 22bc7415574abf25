"""``KVStore.drain`` is bounded as a whole: a background copy that hangs ends the wait with a
typed StoreTimeoutError naming what is still running, at the deadline, changing nothing; the
serving engine's drains before a release go on past such a copy."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tierkv.errors import InvalidInputError, InvalidTypeError, StoreTimeoutError
from tierkv.store import KVStore
from tierkv.tiers import DEVICE

from .held_copies import hold_copies
from .test_store import PAGE, SPEC, check, fill, no_pins_left


def hold_write_behind(monkeypatch: pytest.MonkeyPatch, store: KVStore) -> threading.Event:
    """Device -> host copies (the write-behind) hang until the returned gate opens."""
    return hold_copies(monkeypatch, store, DEVICE)


@pytest.fixture(autouse=True)
def _copies_on_a_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # a copy that hangs is modelled on a stream thread (small cpu copies run inline otherwise)
    monkeypatch.setenv("TIERKV_INLINE_COPIES", "0")


async def test_a_hung_write_behind_ends_drain_at_the_store_timeout_typed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fails on the old code: drain looped on asyncio.wait(timeout=store.timeout) for ever."""
    async with KVStore(
        SPEC, device_bytes=16 * PAGE, host_bytes=40 * PAGE, codec=None, timeout=0.3
    ) as store:
        gate = hold_write_behind(monkeypatch, store)
        ref = await fill(store, "a", 1, n=8)  # the lease's end starts a write-behind: it hangs
        try:
            with pytest.raises(StoreTimeoutError) as got:
                await asyncio.wait_for(store.drain(), 10)  # (the old code: the outer bound)
            msg = str(got.value)
            assert "write-behind" in msg and "1 background task" in msg, msg
            assert "0.3 s" in msg, msg
            store.check()  # nothing half-changed: the copy goes on
        finally:
            gate.set()
        await store.drain()
        await check(store, "a", ref)
        await no_pins_left(store)


async def test_drain_takes_its_own_timeout_and_checks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    async with KVStore(
        SPEC, device_bytes=16 * PAGE, host_bytes=40 * PAGE, codec=None, timeout=30
    ) as store:
        for bad in (0, -1, float("nan"), float("inf")):
            with pytest.raises(InvalidInputError):
                await store.drain(timeout=bad)
        for wrong in ("1", None, True):
            if wrong is None:
                continue  # None: the store's timeout
            with pytest.raises(InvalidTypeError):
                await store.drain(timeout=wrong)  # type: ignore[arg-type]
        await store.drain(timeout=0.1)  # nothing running: returns at once
        gate = hold_write_behind(monkeypatch, store)
        await fill(store, "a", 1, n=8)
        try:
            with pytest.raises(StoreTimeoutError, match="write-behind"):
                await asyncio.wait_for(store.drain(timeout=0.2), 10)
        finally:
            gate.set()
        await store.drain(timeout=10)
        await no_pins_left(store)


async def test_the_engine_releases_past_a_hung_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving engine drains before releasing a request whose full block is not published
    yet (a write-back in flight: modelled by publishing nothing): a drain that times out (a
    write-behind hangs) is logged, and the release still happens. On the old code the drain
    hung for ever (and, with the new bound, the release was skipped: the sequence leaked)."""
    from tierkv.demo.model import ModelConfig
    from tierkv.serving import Engine, EngineConfig, SamplingParams, TinyModel

    cfg = ModelConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=3)
    model = TinyModel(cfg)
    spec = model.kv_spec(8)
    store = KVStore(
        spec, device_bytes=64 * spec.page_bytes, host_bytes=256 * spec.page_bytes, codec=None,
        timeout=0.3,
    )  # fmt: skip
    async with store:
        engine = Engine(model, EngineConfig(page_tokens=8, max_context=64), store=store)
        async with engine:
            gate = hold_write_behind(monkeypatch, store)
            monkeypatch.setattr(store, "publish", lambda seq: None)
            try:
                out, reason = await asyncio.wait_for(
                    engine.complete(list(range(1, 20)), SamplingParams(max_tokens=2)), 20
                )
                assert reason == "length" and len(out) == 2
                await asyncio.wait_for(engine.wait_idle(10), 15)
                assert store.sequence_ids() == []  # released although the drain ran out
                assert "drain: 1 background task" in engine.counters.last_error
                assert engine.counters.failed == 0
            finally:
                gate.set()
        await store.drain(timeout=10)
        store.check()
