"""The step path against a careless caller (a probe): buffers torch would refuse deep inside
a gather, a step of no new tokens, cancellation at any point of a plan, a plan used after its
exit. Each is a typed error before anything changes, or works; nothing stays pinned."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv import SequenceError, SpecError

from .test_step import SPEC, D, H, idle, rand, store


async def test_a_gather_buffer_torch_would_refuse_is_a_spec_error() -> None:
    """``kv_padded(out=)`` of a tensor that requires grad, or of an inference tensor outside
    inference mode: torch's RuntimeError from inside ``index_select`` (untyped) before; a
    SpecError at entry now, the buffer untouched. Inside inference mode it gathers."""
    async with store() as st:
        await st.add_sequence("a", [])
        await st.add_sequence("b", [])
        async with st.step_plan(["a", "b"], tokens=[2, 3]) as step:
            h = await step.layer(0)
            h.append(rand(H, 5, D, seed=1), rand(H, 5, D, seed=2))
            need = 2 * 2 * H * 3 * D
            grad = torch.zeros(need, requires_grad=True)
            with torch.inference_mode():
                frozen = torch.zeros(need)
            for bad in (grad, grad[:], frozen):
                with pytest.raises(SpecError, match="grad"):
                    h.kv_padded(out=bad)
            assert not grad.detach().any() and not frozen.any()
            want, _ = h.kv_padded()
            with torch.inference_mode():
                got, _ = h.kv_padded(out=frozen)
                assert torch.equal(got, want)
        await idle(st)


async def test_a_step_of_no_new_tokens_takes_its_empty_append() -> None:
    """A decode loop that appends whatever it computed: with no new tokens that is KV of
    ``n = 0``, which was refused as 'appended to it already'. Now a no-op; KV reads as before."""
    async with store() as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=3) as step:
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(rand(1, H, 3, D, seed=layer), rand(1, H, 3, D, seed=layer))
        async with st.step_plan(["a"], tokens=0) as step:
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(torch.empty(1, H, 0, D), torch.empty(1, H, 0, D))
                h.append(torch.empty(H, 0, D), torch.empty(H, 0, D))
                k, _ = h.kv()
                assert torch.equal(k[0], rand(1, H, 3, D, seed=layer)[0])
                with pytest.raises(SpecError):  # a token where none was planned
                    h.append(rand(1, H, 1, D, seed=0), rand(1, H, 1, D, seed=0))
        assert st.sequence("a").kv_len == [3] * SPEC.num_layers
        await idle(st)


@pytest.mark.parametrize("turns", [0, 1, 2, 3, 5, 8, 13])
async def test_a_step_cancelled_at_any_point_leaves_nothing_pinned(turns: int) -> None:
    """Cancelled after ``turns`` loop turns (waiting for a group's loads, between layers, in
    the exit): nothing pinned or admitted, the page table consistent, and every layer's
    length is either the old or the new one (an append is whole)."""
    async with store(device_pages=16) as st:
        for s in "abc":
            await st.add_sequence(s, [])
            async with st.step_plan([s], tokens=9) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    h.append(rand(1, H, 9, D, seed=layer), rand(1, H, 9, D, seed=layer))
        await st.drain()

        async def run() -> None:
            async with st.step_plan(["a", "b", "c"], tokens=1, ahead=2) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    h.append(rand(3, H, 1, D, seed=layer), rand(3, H, 1, D, seed=layer))
                    h.kv()

        task = asyncio.ensure_future(run())
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # (cancelled, or done first)
        await idle(st)
        for s in "abc":
            assert set(st.sequence(s).kv_len) <= {9, 10}
        async with st.step_plan(["a"], tokens=0) as step:  # the store still steps
            h = await step.layer(0)
            assert h.kv()[0].shape[2] == st.sequence("a").kv_len_of(0)
        await idle(st)


async def test_a_plan_after_its_exit_refuses_everything() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=1) as step:
            h = await step.layer(0)
            h.append(rand(1, H, 1, D, seed=0), rand(1, H, 1, D, seed=0))
        for call in (
            lambda: h.kv(),
            lambda: h.kv_padded(),
            lambda: h.append(rand(1, H, 1, D, seed=0), rand(1, H, 1, D, seed=0)),
        ):
            with pytest.raises(SequenceError):
                call()
        with pytest.raises(SequenceError, match="not active"):
            await step.layer(1)
        assert st.sequence("a").kv_len == [1, 0, 0, 0]
        await idle(st)
