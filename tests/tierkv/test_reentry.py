"""A careless caller enters a lease or a step plan twice: typed errors, nothing leaked.

* A lease entered while active (or while a first entry waits) pinned every page twice, and its
  exit left one set pinned for good (6 of 6 pages here); entered again after it left, it pinned
  nothing (it lets go of its sequences at exit): now SequenceError, nothing pinned.
* A step plan entered again after it ran reused its spent layers and loads: the store's own
  check failed after it (owners differ from the live sequences' pages); now SequenceError.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv import KVSpec, SequenceError
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes


def _pins(store: KVStore) -> int:
    table = store.tiers.table
    return sum(table.pins(k, "device") for k in table.keys("device"))


async def _store_with_kv() -> KVStore:
    store = await KVStore(SPEC, device_bytes=32 * PAGE, host_bytes=32 * PAGE, codec=None).open()
    await store.add_sequence("q", list(range(10)))
    async with store.lease(["q"]) as lease:
        for layer in (0, 1):
            await lease.append("q", layer, torch.randn(2, 10, 8), torch.randn(2, 10, 8))
    await store.drain()
    return store


async def test_a_lease_entered_twice_is_refused_and_leaks_no_pin() -> None:
    store = await _store_with_kv()
    try:
        assert _pins(store) == 0
        lease = store.lease(["q"])
        async with lease:
            held = _pins(store)
            assert held > 0
            with pytest.raises(SequenceError, match="entered already"):
                await lease.__aenter__()
            assert _pins(store) == held
        await store.drain()
        assert _pins(store) == 0
        with pytest.raises(SequenceError, match="ran already"):  # it pinned nothing
            await lease.__aenter__()
        other = store.lease(["q"])
        first = asyncio.ensure_future(other.__aenter__())
        await asyncio.sleep(0)  # the first entry is under way (it yields a turn)
        with pytest.raises(SequenceError, match="entered already"):
            await other.__aenter__()
        await first
        await other.__aexit__(None, None, None)
        await store.drain()
        assert _pins(store) == 0
        store.check()
    finally:
        await store.close()


async def test_a_step_plan_runs_once() -> None:
    store = await _store_with_kv()
    try:
        plan = store.step_plan(["q"])
        async with plan as step:
            for layer in (0, 1):
                part = await step.layer(layer)
                part.append(torch.randn(2, 1, 8), torch.randn(2, 1, 8))
        store.check()
        with pytest.raises(SequenceError, match="ran already"):
            await plan.__aenter__()
        store.check()
        async with store.step_plan(["q"]):  # a new plan of the same sequence: as ever
            pass
        store.check()
    finally:
        await store.close()
