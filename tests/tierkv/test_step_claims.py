"""A sequence runs in one step plan at a time (tierkv.step_claims; a probe's careless caller:
two plans over one sequence at once). The second plan's entry raises SequenceError at once,
nothing held or changed; a plan that has exited, or whose entry failed, frees its sequences."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv import KVStore, SequenceError, TierFullError

from .test_step import SPEC, D, H, idle, rand, store


def _state(st: KVStore, ids: list[str]) -> tuple[object, ...]:
    """What an entry could change: the sequences' blocks and lengths, the admission, the
    device tier's pages and pins."""
    table = st.tiers.table
    return (
        [(st.sequence(s).num_blocks, st.sequence(s).kv_len) for s in ids],
        (st.admission.committed, st.admission.active),
        sorted((k, table.pins(k, "device")) for k in table.keys("device")),
    )


async def _decode(plan: object, seed: int) -> None:
    for layer in range(SPEC.num_layers):
        h = await plan.layer(layer)  # type: ignore[attr-defined]
        new = rand(1, H, 1, D, seed=seed + layer)
        h.append(new, new)


async def test_a_second_plan_over_a_sequence_raises_at_entry_and_changes_nothing() -> None:
    """Was: the second entry went through and its first layer raised PageStateError ("2 new
    pages: some are already on the device"), or it waited out the store's timeout for room
    and raised TierFullError. Now SequenceError at once, naming the sequence."""
    st = store()
    st.timeout = 0.5  # (the old code's wait, bounded: the test fails rather than hangs)
    async with st:
        await st.add_sequence("a", [])
        await st.add_sequence("b", [])
        async with st.step_plan(["a"]) as p1:
            h = await p1.layer(0)
            before = _state(st, ["a", "b"])
            for ids in (["a"], ["b", "a"]):
                with pytest.raises(SequenceError, match="sequence 'a' is in another step plan"):
                    async with st.step_plan(ids):
                        pytest.fail("entered a second plan over 'a'")
                assert _state(st, ["a", "b"]) == before
            loop = asyncio.get_running_loop()
            with pytest.raises(SequenceError, match="'a' is in another step plan"):
                st.step_plan(["a"]).enter_now(loop)
            assert _state(st, ["a", "b"]) == before
            async with st.step_plan(["b"]) as pb:  # another sequence: its own plan, at once
                await _decode(pb, seed=40)  # ('b' was not left claimed by ["b", "a"])
            new = rand(1, H, 1, D, seed=1)
            h.append(new, new)  # the first plan goes on as if nothing happened
            for layer in range(1, SPEC.num_layers):
                h = await p1.layer(layer)
                h.append(new, new)
        assert st.sequence("a").kv_len == [1] * SPEC.num_layers
        async with st.step_plan(["a"]) as p3:  # exited: 'a' is free for the next plan
            await _decode(p3, seed=10)
        assert st.sequence("a").kv_len == [2] * SPEC.num_layers
        async with st.lease(["a"], [0]) as lease:
            got, _ = lease.kv("a", 0)
            assert torch.equal(got[:, :1], new[0])
        await idle(st)


async def test_a_plan_that_failed_or_did_not_enter_frees_its_sequences() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        with pytest.raises(RuntimeError):  # a plan that exits by an error
            async with st.step_plan(["a"]) as p:
                await p.layer(0)
                raise RuntimeError("the caller's own failure")
        loop = asyncio.get_running_loop()
        admission = st.admission
        held = admission.enter_now(admission.capacity)  # another step holds every page
        assert held is not None
        plan = st.step_plan(["a"])
        assert not plan.enter_now(loop)  # would wait: nothing held, 'a' not left claimed
        st.timeout = 0.2
        with pytest.raises(TierFullError):  # an entry that fails: 'a' freed again
            async with st.step_plan(["a"]):
                pass
        admission.leave(held)
        assert plan.enter_now(loop)
        with pytest.raises(SequenceError, match="entered already"):
            plan.enter_now(loop)
        try:
            await _decode(plan, seed=20)
        finally:
            await plan.__aexit__(None, None, None)
        async with st.step_plan(["a"]) as p:
            await _decode(p, seed=30)
        assert len(st.steps) == 0
        await idle(st)


async def test_a_plan_cancelled_while_waiting_for_room_frees_its_sequences() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        admission = st.admission
        held = admission.enter_now(admission.capacity)
        assert held is not None

        async def enter() -> None:
            async with st.step_plan(["a"]):
                pass

        task = asyncio.ensure_future(enter())
        await asyncio.sleep(0.01)  # (waiting for the admission's room now)
        assert st.sequence("a") in st.steps
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(st.steps) == 0
        admission.leave(held)
        async with st.step_plan(["a"]) as p:
            await _decode(p, seed=50)
        await idle(st)
