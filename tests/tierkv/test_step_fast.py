"""The step path's cheap per-layer forms (issue 26, tierkv demo): the append rows built in
Python equal numpy's, the K/V gathered by whole pages equal the row gather, a group's first
layer served without an event loop run (``layer_now(enter=True)``) keeps the KV exact and
leaves nothing pinned, and the fast shape check never lets a bad tensor through."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tierkv import KVSpec, SequenceError, SpecError
from tierkv.errors import StoreClosedError
from tierkv.integrations.hf_store import LocalStore, LoopInUseError
from tierkv.step_plan import LayerRows

from .test_step import SPEC, D, H, idle, rand, read_back, store


@pytest.mark.parametrize(
    "batch,start,n", [(1, 0, 1), (1, 15, 1), (1, 16, 3), (3, 7, 5), (2, 0, 40)]
)
@pytest.mark.parametrize("by_seq", [True, False])
def test_python_rows_equal_numpy_rows(batch: int, start: int, n: int, by_seq: bool) -> None:
    spec = KVSpec(2, 3, 8, "fp32", 16)
    pages = -(-(start + n) // 16)
    slots = [[(7 * b + 3 * p) % 50 for p in range(pages)] for b in range(batch)]
    rows = LayerRows(slots, [start] * batch, [n] * batch, 2 * 3 * 16 + 2, spec, torch.device("cpu"))
    assert rows.uniform
    k_py = rows._py_k_rows(by_seq)
    k_np = rows._k_rows(by_seq).tolist()
    assert k_py == k_np


async def test_page_gather_equals_row_gather() -> None:
    # a transformers batch (equal rows): kv() gathers whole pages by slot; kv_list() and the
    # rows' own index_select read the same bytes, through loads (a small device tier)
    async with store(device_pages=20) as st:
        for s in ("a", "b"):
            await st.add_sequence(s, [])
        for n in (6, 1, 1, 9, 1):
            async with st.step_plan(["a", "b"], tokens=n, ahead=1) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    h.append(rand(2, H, n, D, seed=n + layer), rand(2, H, n, D, seed=layer))
                    assert h._rows.uniform
                    k, v = h.kv()
                    rows = step.flat.index_select(0, h._rows.read).view(2, 2, H, -1, D)
                    assert torch.equal(k, rows[:, 0]) and torch.equal(v, rows[:, 1])
                    assert all(
                        torch.equal(kb, k[b]) and torch.equal(vb, v[b])
                        for b, (kb, vb) in enumerate(h.kv_list())
                    )
            st.step()
        await idle(st)
        assert st.stats()["page_loads"] > 0


async def test_enter_now_serves_group_starts_without_a_loop_run() -> None:
    async with store(device_pages=20) as st:
        await st.add_sequence("a", [])
        want = {layer: torch.empty(H, 0, D) for layer in range(SPEC.num_layers)}
        served = 0
        for n_step in range(6):
            async with st.step_plan(["a"], tokens=1, ahead=1) as step:
                for layer in range(SPEC.num_layers):
                    h = step.layer_now(layer, enter=True)
                    if h is None:
                        h = await step.layer(layer)
                    else:
                        served += 1
                    started, step.starting = step.starting, None
                    if started is not None:  # the next group's task: a loop turn runs it
                        await asyncio.wait_for(asyncio.shield(started), 5)
                    k = rand(1, H, 1, D, seed=100 * n_step + layer)
                    h.append(k, k)
                    want[layer] = torch.cat([want[layer], k[0]], 1)
                    got, _ = h.kv()
                    assert torch.equal(got[0], want[layer])
                    assert step.layer_now(layer, enter=True) is None  # not the next layer
            st.step()
            await idle(st)
        assert served > 0
        for layer in range(SPEC.num_layers):
            k, _ = await read_back(st, "a", layer)
            assert torch.equal(k, want[layer])


async def test_enter_now_declines_a_group_not_started_or_failed() -> None:
    async with store(device_pages=40) as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=1, ahead=0) as step:  # loads start at layer()
            h = await step.layer(0)
            h.append(rand(1, H, 1, D, seed=0), rand(1, H, 1, D, seed=0))
            assert step.layer_now(1, enter=True) is None  # its group has not started
            h = await step.layer(1)
            assert step.starting is None
        async with st.step_plan(["a"], tokens=1, ahead=1) as step:
            h = await step.layer(0)
            h.append(rand(1, H, 1, D, seed=0), rand(1, H, 1, D, seed=0))
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(SequenceError("its load failed"))
            step._tasks[2] = failed  # type: ignore[assignment]
            h = await step.layer(1)
            h.append(rand(1, H, 1, D, seed=1), rand(1, H, 1, D, seed=1))
            assert step.layer_now(2, enter=True) is None  # layer() raises its error
            with pytest.raises(SequenceError, match="its load failed"):
                await step.layer(2)
        await idle(st)


async def test_fast_shape_check_never_accepts_bad_kv() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=1) as step:
            h = await step.layer(0)
            good = rand(1, H, 1, D, seed=1)
            for bad in (good.double(), good.to("meta"), rand(1, H, 2, D, seed=1), good[..., :4]):
                with pytest.raises(SpecError):
                    h.append(bad, bad)
            with pytest.raises(SpecError):  # (the inline check sees each tensor's dtype)
                h.append(good, good.double())
            with pytest.raises(SpecError):
                h.append(good.double(), good)
            assert st.sequence("a").kv_len == [0, 0, 0, 0]  # nothing written
            h.append(good, good)
            k, v = h.kv()
            assert torch.equal(k, good) and torch.equal(v, good)
        await idle(st)
        assert st.sequence("a").kv_len == [1, 0, 0, 0]


def test_local_store_turn_is_refused_after_close_and_inside_a_loop() -> None:
    local = LocalStore(SPEC, device_bytes=8 * SPEC.page_bytes, host_bytes=64 * SPEC.page_bytes)
    local.turn()  # nothing ready: returns at once

    async def inside() -> None:
        with pytest.raises(LoopInUseError):
            local.turn()

    asyncio.run(inside())
    local.close()
    with pytest.raises(StoreClosedError):
        local.turn()
