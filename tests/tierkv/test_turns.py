"""The store's cooperative turn budget (tierkv.turns): its async calls yield to the loop once a
loop turn's work passes the budget, and a pause changes nothing but the order of work."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tierkv import KVSpec
from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.store import KVStore
from tierkv.turns import TurnBudget

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=8, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, n, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


async def test_the_first_call_of_a_turn_starts_the_count_and_the_next_turn_resets_it() -> None:
    budget = TurnBudget(1e-9)
    assert not budget.spent()  # starts this turn's count: nothing charged yet
    budget.charge(1e-6)  # a store call's work
    assert budget.spent()
    await asyncio.sleep(0)  # the next turn
    assert not budget.spent()
    never = TurnBudget(None)
    assert not any(never.spent() for _ in range(10))


async def test_a_pause_yields_only_when_the_budget_is_spent() -> None:
    budget, ran = TurnBudget(3600.0), []
    asyncio.get_running_loop().call_soon(ran.append, "other")
    for _ in range(5):
        await budget.pause()
    assert ran == [] and budget.pauses == 0  # an hour's budget: nobody else ran
    await asyncio.sleep(0)
    assert ran == ["other"]
    tight, ran = TurnBudget(1e-9), []
    asyncio.get_running_loop().call_soon(ran.append, "other")
    await tight.pause()  # starts the count
    assert ran == []
    tight.charge(1e-6)
    await tight.pause()  # spent: yields, the other callback runs
    assert ran == ["other"] and tight.pauses == 1


async def test_the_first_to_pause_yields_one_turn_and_the_rest_queue_behind_it() -> None:
    budget, order = TurnBudget(1e-9), []

    async def one(name: str) -> None:
        await budget.pause()
        order.append(name)

    tasks = [asyncio.ensure_future(one(n)) for n in "abc"]
    budget.charge(1e-6)  # a count starts (reset only after the tasks' first steps), spent
    await asyncio.sleep(0)  # all three pause in the same turn
    assert budget.pauses == 3 and budget.waiting == 2  # a is out for one turn; b, c queue
    await asyncio.gather(*tasks)
    assert order == ["a", "b", "c"]  # first come, first served


async def test_callers_waiting_when_the_budget_is_turned_off_all_go_on() -> None:
    budget, done = TurnBudget(1e-9), []

    async def one(i: int) -> None:
        await budget.pause()
        done.append(i)

    tasks = [asyncio.ensure_future(one(i)) for i in range(50)]
    budget.charge(1e-6)
    await asyncio.sleep(0)  # all pause: one is out for a turn, 49 queue
    assert budget.waiting == 49
    budget.budget = None
    await asyncio.wait_for(asyncio.gather(*tasks), 5)  # none is left waiting forever
    assert sorted(done) == list(range(50)) and budget.waiting == 0


async def test_a_cancelled_waiter_is_passed_over_and_the_rest_keep_their_order() -> None:
    budget, done = TurnBudget(1e-9), []

    async def one(i: int) -> None:
        await budget.pause()
        done.append(i)

    tasks = [asyncio.ensure_future(one(i)) for i in range(6)]
    budget.charge(1e-6)
    await asyncio.sleep(0)
    tasks[2].cancel()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert isinstance(results[2], asyncio.CancelledError)
    assert done == [0, 1, 3, 4, 5]


@pytest.mark.parametrize("budget", [None, 1e-9])
async def test_appends_pause_between_layers_only_under_a_spent_budget(budget: float | None) -> None:
    async with KVStore(
        SPEC, device_bytes=64 * PAGE, host_bytes=64 * PAGE, codec=None, turn_budget=budget
    ) as store:
        await store.add_sequence("a", list(range(8)))
        async with store.lease(["a"]) as lease:
            ran: list[str] = []
            asyncio.get_running_loop().call_soon(ran.append, "other")
            for layer in range(SPEC.num_layers):
                await lease.append("a", layer, *kv(8, layer))
            assert ran == ([] if budget is None else ["other"])
        assert (store.turns.pauses == 0) == (budget is None)


async def test_the_callers_own_work_between_store_calls_is_not_charged() -> None:
    """A model's layers computed between a lease's appends (here: 150 ms of busy work per
    layer against a 50 ms budget) do not make the store pause; only the store's own work counts.
    (The budget is far above the store's own work per append, ~1 ms, so that a loaded machine
    stretching that work several times over cannot make it pause: it failed once at 10 ms
    against 20 ms of busy work on a 2-core box at load 12.)"""
    async with KVStore(
        SPEC, device_bytes=64 * PAGE, host_bytes=64 * PAGE, codec=None, turn_budget=0.05
    ) as store:
        await store.add_sequence("a", list(range(8)))
        async with store.lease(["a"]) as lease:
            before = store.turns.pauses
            for layer in range(SPEC.num_layers):
                end = time.perf_counter() + 0.15
                while time.perf_counter() < end:  # the caller's compute, on the loop's thread
                    pass
                await lease.append("a", layer, *kv(8, layer))
                lease.kv("a", layer)
            assert store.turns.pauses == before


async def test_a_release_frees_its_private_pages_before_it_pauses() -> None:
    """Regression: release paused first, and the write-behind task the lease's exit had
    started ran in the pause: it pinned (and copied down) the very pages being freed, which
    were then doomed instead of freed, their host copies leaving and coming back."""
    async with KVStore(
        SPEC, device_bytes=64 * PAGE, host_bytes=64 * PAGE, codec=None, turn_budget=1e-9
    ) as store:
        await store.add_sequence("a", list(range(6)))  # a full block and a private one
        async with store.lease(["a"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("a", layer, *kv(6, layer))
        await store.release("a")  # the lease's write-behind is due; the budget is spent
        assert not store.tiers.ownership.doomed  # freed at once, not left to a copy in flight
        await store.drain()
        store.check()


async def test_many_tasks_under_a_spent_budget_keep_their_kv_bit_exact() -> None:
    async with KVStore(
        SPEC, device_bytes=24 * PAGE, host_bytes=400 * PAGE, codec=None, turn_budget=1e-9
    ) as store:
        refs: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

        async def one(i: int) -> None:
            sid = f"s{i}"
            await store.add_sequence(sid, [i * 100 + t for t in range(6)])
            ref = {layer: kv(6, i * 10 + layer) for layer in range(SPEC.num_layers)}
            async with store.lease([sid]) as lease:
                for layer, (k, v) in ref.items():
                    await lease.append(sid, layer, k, v)
            refs[sid] = ref

        await asyncio.gather(*(one(i) for i in range(12)))
        assert store.turns.pauses > 0
        for sid, ref in refs.items():
            async with store.lease([sid]) as lease:
                for layer, (k, v) in ref.items():
                    got_k, got_v = lease.kv(sid, layer)
                    assert torch.equal(got_k, k) and torch.equal(got_v, v)
        await store.drain()
        store.check()


async def test_a_task_cancelled_while_paused_in_append_leaves_nothing_behind() -> None:
    async with KVStore(
        SPEC, device_bytes=64 * PAGE, host_bytes=64 * PAGE, codec=None, turn_budget=1e-9
    ) as store:
        await store.add_sequence("a", list(range(8)))
        lease = store.lease(["a"])
        await lease.__aenter__()
        await asyncio.sleep(0)  # a fresh turn: nothing counted in it yet
        before = store.turns.pauses
        task = asyncio.ensure_future(lease.append("a", 0, *kv(8, 0)))
        store.turns.charge(1e-3)  # spent, and reset only after the task's first step
        await asyncio.sleep(0)  # the append runs up to its pause (the budget is spent)
        assert not task.done() and store.turns.pauses == before + 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.sequence("a").kv_len_of(0) == 0  # nothing was appended
        await lease.__aexit__(None, None, None)
        await store.release("a")
        await store.drain()
        table = store.tiers.table
        assert all(table.pins(k, "device") == 0 for k in table.keys("device"))
        store.check()


@pytest.mark.parametrize(
    ("bad", "error"), [(0, InvalidInputError), (-1.0, InvalidInputError), ("2ms", InvalidTypeError)]
)
def test_a_bad_turn_budget_is_refused(bad: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="turn_budget"):
        KVStore(SPEC, device_bytes=8 * PAGE, host_bytes=8 * PAGE, turn_budget=bad)  # type: ignore[arg-type]
