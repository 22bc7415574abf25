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


# -- one writer of a sequence's layer at a time: a plan and a lease, two leases -------------
async def test_a_lease_over_a_sequence_in_a_plan_raises_at_entry_and_changes_nothing() -> None:
    """Was: the lease entered and its appends interleaved with the plan's in one layer (the
    probe's finding; nothing leaked, check() passed). Now the lease's entry raises, nothing
    changed, and the plan goes on as if nothing happened. Fails on the old code."""
    async with store() as st:
        await st.add_sequence("a", [])
        await st.add_sequence("b", [])
        async with st.step_plan(["a"]) as p1:
            h = await p1.layer(0)
            before = _state(st, ["a", "b"])
            for ids, layers in ((["a"], None), (["b", "a"], [1])):
                with pytest.raises(SequenceError, match="'a' is in an entered step plan"):
                    async with st.lease(ids, layers):
                        pytest.fail("entered a lease over 'a' while a plan appends to it")
                assert _state(st, ["a", "b"]) == before
            async with st.lease(["b"]) as lb:  # another sequence: leased at once
                await lb.append("b", 0, rand(H, 1, D, seed=3), rand(H, 1, D, seed=4))
            new = rand(1, H, 1, D, seed=1)
            h.append(new, new)
            for layer in range(1, SPEC.num_layers):
                h = await p1.layer(layer)
                h.append(new, new)
        assert st.sequence("a").kv_len == [1] * SPEC.num_layers  # the plan's token, alone
        async with st.lease(["a"]) as la:  # the plan exited: 'a' leases again
            assert torch.equal(la.kv("a", 0)[0][:, :1], new[0])
        await idle(st)


async def test_a_plan_over_a_leased_sequence_raises_at_entry_and_changes_nothing() -> None:
    """The lease entered first (reading, or appending) keeps the sequence: the plan's entry
    raises, nothing held; a lease over other layers does not stop it. Fails on the old code
    (the plan entered and both appended to layer 0)."""
    async with store() as st:
        await st.add_sequence("a", [])
        k = rand(H, 1, D, seed=5)
        async with st.lease(["a"], [0]) as la:
            await la.append("a", 0, k, k)
            before = _state(st, ["a"])
            for layers in (None, [0, 1]):
                with pytest.raises(
                    SequenceError, match=r"'a' is in an entered lease \(layers \[0\]"
                ):
                    async with st.step_plan(["a"], layers):
                        pytest.fail("entered a plan over a leased sequence")
                assert _state(st, ["a"]) == before
            loop = asyncio.get_running_loop()
            with pytest.raises(SequenceError, match="entered lease"):
                st.step_plan(["a"]).enter_now(loop)
            assert len(st.steps) == 0
            async with st.step_plan(["a"], [0], tokens=0) as p:  # a plan that only reads
                assert torch.equal((await p.layer(0)).kv()[0][0], k)
            async with st.step_plan(["a"], [1, 2, 3]) as p:  # other layers: one writer each
                for layer in (1, 2, 3):
                    h = await p.layer(layer)
                    h.append(k.unsqueeze(0), k.unsqueeze(0))
            await la.append("a", 0, k, k)  # the lease goes on as if nothing happened
        assert st.sequence("a").kv_len == [2, 1, 1, 1]
        async with st.step_plan(["a"], [0]) as p:  # the lease exited: layer 0 is free
            h = await p.layer(0)
            h.append(k.unsqueeze(0), k.unsqueeze(0))
        await idle(st)


async def test_two_leases_take_a_layer_at_their_first_append() -> None:
    """Two leases of one sequence may read at once; the first to append to a layer holds it
    until it exits, the other's append to that layer raises (nothing appended), to another
    layer is its own. Fails on the old code (both appended to layer 0, interleaved)."""
    async with store() as st:
        await st.add_sequence("a", [])
        k1, k2 = rand(H, 1, D, seed=6), rand(H, 1, D, seed=7)
        async with st.lease(["a"]) as first, st.lease(["a"]) as second:
            await first.append("a", 0, k1, k1)
            before = _state(st, ["a"])
            with pytest.raises(SequenceError, match="'a' layer 0: another entered lease"):
                await second.append("a", 0, k2, k2)
            assert _state(st, ["a"]) == before
            await second.append("a", 1, k2, k2)  # another layer: this lease's
            with pytest.raises(SequenceError, match="layer 1: another entered lease"):
                await first.append("a", 1, k1, k1)
            await first.append("a", 0, k1, k1)  # the first goes on
            assert torch.equal(second.kv("a", 0)[0], torch.cat([k1, k1], 1))  # reads are fine
        async with st.lease(["a"]) as third:  # both exited: layer 0 and 1 are free again
            await third.append("a", 0, k2, k2)
            await third.append("a", 1, k2, k2)
        assert st.sequence("a").kv_len[:2] == [3, 2]
        await idle(st)


async def test_a_lease_that_failed_to_enter_or_exited_leaves_no_writer() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        st.timeout = 0.2
        admission = st.admission
        held = admission.enter_now(admission.capacity)  # no room: the lease's entry fails
        assert held is not None
        with pytest.raises(TierFullError):
            async with st.lease(["a"]):
                pass
        admission.leave(held)
        async with st.step_plan(["a"]) as p:  # nothing left of the failed lease
            await _decode(p, seed=60)
        lease = st.lease(["a"])
        await lease.__aexit__(None, None, None)  # an exit without entry records nothing
        async with st.step_plan(["a"]) as p:
            await _decode(p, seed=70)
        await idle(st)
