from __future__ import annotations

import asyncio
import threading

import pytest

from tierkv.runtime import CpuBackend, EngineClosedError, TransferError, WaitTimeoutError
from tierkv.runtime.cpu_stream import CpuStream


async def test_fifo_order_and_awaitable_events(backend: CpuBackend) -> None:
    s = backend.create_stream("s")
    seen: list[int] = []
    events = [s.enqueue(lambda i=i: seen.append(i)) for i in range(20)]
    await events[-1].wait(timeout=10)
    assert seen == list(range(20))
    assert all(e.query() for e in events)


async def test_event_wait_does_not_block_the_loop(backend: CpuBackend) -> None:
    s = backend.create_stream("s")
    gate = threading.Event()
    s.enqueue(lambda: gate.wait(10))
    ev = s.record_event()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while not ev.query():
            ticks += 1
            if ticks == 5:
                gate.set()
            await asyncio.sleep(0)

    await asyncio.gather(ev.wait(timeout=10), ticker())
    assert ticks >= 5  # the loop kept running while the event was pending


def test_cross_stream_wait_orders_work(backend: CpuBackend) -> None:
    a = backend.create_stream("a")
    b = backend.create_stream("b")
    gate = threading.Event()
    order: list[str] = []
    a.enqueue(lambda: gate.wait(10))
    ev_a = a.enqueue(lambda: order.append("a"))
    b.wait_event(ev_a)
    ev_b = b.enqueue(lambda: order.append("b"))
    assert not ev_b.query()
    gate.set()
    ev_b.synchronize(timeout=10)
    assert order == ["a", "b"]


def test_failed_work_and_failed_dependency(backend: CpuBackend) -> None:
    a = backend.create_stream("a")
    b = backend.create_stream("b")

    def boom() -> None:
        raise ValueError("boom")

    ev = a.enqueue(boom)
    with pytest.raises(TransferError):
        ev.synchronize(timeout=10)
    assert isinstance(ev.exception(), TransferError)
    ran: list[int] = []
    b.wait_event(ev)
    dependent = b.enqueue(lambda: ran.append(1))
    with pytest.raises(TransferError):
        dependent.synchronize(timeout=10)
    assert ran == []  # work after a failed dependency is not run
    b.enqueue(lambda: ran.append(2)).synchronize(timeout=10)
    assert ran == [2]


async def test_timeouts_are_typed(backend: CpuBackend) -> None:
    s = backend.create_stream("s")
    gate = threading.Event()
    ev = s.enqueue(lambda: gate.wait(10))
    with pytest.raises(WaitTimeoutError):
        ev.synchronize(timeout=0.01)
    with pytest.raises(WaitTimeoutError):
        await ev.wait(timeout=0.01)
    assert not ev.query()  # the wait timed out, the work did not
    gate.set()
    await ev.wait(timeout=10)


def test_stream_wait_timeout_fails_next_item() -> None:
    s = CpuStream("s", wait_timeout=0.01)
    other = CpuStream("o")
    gate = threading.Event()
    never = other.enqueue(lambda: gate.wait(10))
    s.wait_event(never)
    ev = s.enqueue(lambda: None)
    with pytest.raises(TransferError):
        ev.synchronize(timeout=10)
    gate.set()
    s.close()
    other.close()


def test_use_after_close(backend: CpuBackend) -> None:
    s = backend.create_stream("s")
    done = s.enqueue(lambda: None)
    s.close(timeout=10)
    assert done.query()
    with pytest.raises(EngineClosedError):
        s.enqueue(lambda: None)
    s.close()  # idempotent
    backend.close()
    with pytest.raises(EngineClosedError):
        backend.create_stream("t")


async def test_each_waiter_cancels_and_times_out_alone(backend: CpuBackend) -> None:
    s = backend.create_stream("s")
    gate = threading.Event()
    ev = s.enqueue(lambda: gate.wait(10))
    waiters = [asyncio.ensure_future(ev.wait(timeout=10)) for _ in range(3)]
    await asyncio.sleep(0)
    waiters[0].cancel()
    for timeout in (0.0, 0.01) * 20:  # timed-out waits leave the other waiters be
        with pytest.raises(WaitTimeoutError):
            await ev.wait(timeout=timeout)
    assert not any(w.done() for w in waiters[1:])
    gate.set()
    await asyncio.wait_for(asyncio.gather(*waiters[1:]), 10)
    assert waiters[0].cancelled() and ev.query()
    await ev.wait(timeout=0)  # done: returns at once, even with no time left


async def test_a_failure_reaches_every_waiter_on_every_loop(backend: CpuBackend) -> None:
    s = backend.create_stream("s")
    gate = threading.Event()

    def boom() -> None:
        gate.wait(10)
        raise ValueError("boom")

    ev = s.enqueue(boom)
    from_thread: list[BaseException] = []

    async def wait_elsewhere() -> None:
        try:
            await ev.wait(timeout=10)
        except TransferError as exc:
            from_thread.append(exc)

    other = threading.Thread(target=asyncio.run, args=(wait_elsewhere(),))
    other.start()
    here = [asyncio.ensure_future(ev.wait(timeout=10)) for _ in range(2)]
    await asyncio.sleep(0.01)
    gate.set()
    for w in here:
        with pytest.raises(TransferError, match="boom"):
            await w
    other.join(10)
    assert len(from_thread) == 1 and from_thread[0] is ev.exception()


def test_jobs_without_events_keep_their_place_in_the_fifo(backend: CpuBackend) -> None:
    s = backend.create_stream("s")
    assert isinstance(s, CpuStream)
    gate = threading.Event()
    seen: list[object] = []
    s.enqueue(lambda: gate.wait(10))
    s.enqueue_job(lambda err: seen.append("job"))
    s.wait_event(s.enqueue(lambda: seen.append("work")))
    s.enqueue_job(lambda err: seen.append(err))
    last = s.record_event()
    gate.set()
    last.synchronize(timeout=10)
    assert seen == ["job", "work", None]
    s.close()
    with pytest.raises(EngineClosedError):
        s.enqueue_job(lambda err: None)
