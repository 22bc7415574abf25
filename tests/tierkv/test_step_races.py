"""Renames and releases during a step's life (tierkv.step): a plan names its pages when each
group loads, and a group may wait (for room) with nothing of a block pinned. A lease of the
same sequence that ends meanwhile publishes the block (its pages renamed to content keys);
a sequence released meanwhile loses its pages. The group must load the pages by their names
now, or fail with SequenceError (released), never with UnknownPageError; and what the plan
records at its exit (recency) names the pages as they are then.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv import SequenceError
from tierkv.keys import page_key
from tierkv.step import StepPlan
from tierkv.store import KVStore

from .test_step import PAGE, SPEC, idle, rand
from .test_store_races import _flush_device, _pin_free_slots, _unpin

H, D = SPEC.num_kv_heads, SPEC.head_dim


def _store() -> KVStore:
    """No write-behind: the only device pins are the leases', the step's and the junk's."""
    return KVStore(
        SPEC,
        device_bytes=12 * PAGE,
        host_bytes=64 * PAGE,
        codec=None,
        write_behind=False,
        timeout=5,
    )


async def _block_zero_on_host(st: KVStore) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Sequence "a" (8 tokens declared) with 4 tokens of KV in layers 1-3, written back and
    evicted: its block 0 is full once layer 0 has them too. Returns the KV per layer."""
    await st.add_sequence("a", list(range(8)))
    ref = {}
    async with st.lease(["a"], [1, 2, 3]) as fill:
        for layer in (1, 2, 3):
            k, v = rand(H, 4, D, seed=layer), rand(H, 4, D, seed=layer + 10)
            await fill.append("a", layer, k, v)
            ref[layer] = (k, v)
    await _flush_device(st)
    return ref


async def _loads_waiting(plan: StepPlan) -> StepPlan:
    """Enter ``plan`` and give its first groups' loads loop turns: they wait for room (the
    device is full of pinned pages) with nothing of theirs pinned."""
    step = await plan.__aenter__()
    for _ in range(5):
        await asyncio.sleep(0)
    assert all(t is not None and not t.done() for t in step._tasks[:2])
    return step


async def test_a_group_waiting_for_room_loads_the_pages_a_lease_end_renamed() -> None:
    async with _store() as st:
        ref = await _block_zero_on_host(st)
        seq = st.sequence("a")
        private = seq.block(0)
        async with st.lease(["a"], [0]) as first:
            await first.append("a", 0, rand(H, 4, D, seed=0), rand(H, 4, D, seed=9))
            junk = await _pin_free_slots(st)
            step = await _loads_waiting(st.step_plan(["a"], [1, 2, 3], tokens=0, ahead=1))
        assert seq.block(0) != private  # first's end published block 0: every layer renamed
        _unpin(st, junk)
        try:
            for layer in (1, 2, 3):
                h = await step.layer(layer)  # unfixed: UnknownPageError, page ... in no tier
                k, v = h.kv()
                assert torch.equal(k[0], ref[layer][0]) and torch.equal(v[0], ref[layer][1])
        finally:
            await step.__aexit__(None, None, None)
        gone = [page_key(private, layer) for layer in range(SPEC.num_layers)]
        table = st.tiers.table
        assert not table.held(gone)
        # the plan's record of use names the pages as they are now (no stale private key)
        assert not [k for k in gone if k in st._last_use]
        await idle(st)


async def test_a_group_of_a_sequence_released_meanwhile_raises_sequence_error() -> None:
    async with _store() as st:
        await _block_zero_on_host(st)
        await st.add_sequence("b", list(range(4)))
        async with st.lease(["b"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("b", layer, rand(H, 4, D, seed=layer), rand(H, 4, D, seed=3))
        junk = await _pin_free_slots(st)
        step = await _loads_waiting(st.step_plan(["a", "b"], [1, 2], tokens=0, ahead=1))
        await st.release("a")
        _unpin(st, junk)
        try:
            with pytest.raises(SequenceError, match="released"):
                await step.layer(1)  # unfixed: UnknownPageError (a's private pages are gone)
        finally:
            await step.__aexit__(None, None, None)
        await idle(st)
