"""A step's write-behind (tierkv.step): the pages it filled go down at exit; its partly filled
pages (written again by the next step) stay dirty on the device where the device keeps them
with the step's window, and go down with the rest where it could not. Either way the KV reads
back bit-identical, through evictions that must write a dirty page back first."""

from __future__ import annotations

import torch

from tierkv.store import KVStore
from tierkv.tiers import DEVICE

from .test_step import PAGE, SPEC, D, H, idle, rand, read_back

T = SPEC.page_tokens


def _store(device_pages: int) -> KVStore:
    return KVStore(SPEC, device_bytes=device_pages * PAGE, host_bytes=400 * PAGE, codec=None)


async def _steps(
    st: KVStore, sid: str, n: int, ref: dict[int, tuple[torch.Tensor, torch.Tensor]], seed: int
) -> None:
    """``n`` one-token steps of ``sid`` (every layer), appended to ``ref`` too."""
    for i in range(n):
        async with st.step_plan([sid], tokens=1, ahead=1) as step:
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                k = rand(1, H, 1, D, seed=seed + 10 * i + layer)
                v = rand(1, H, 1, D, seed=seed + 10 * i + layer + 5)
                h.append(k, v)
                rk, rv = ref.get(layer, (torch.empty(H, 0, D), torch.empty(H, 0, D)))
                ref[layer] = torch.cat([rk, k[0]], 1), torch.cat([rv, v[0]], 1)
        st.step()
    await st.drain()


async def _begun(st: KVStore, n: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Sequence "a" added and ``n`` one-token steps of it run; its KV by layer."""
    await st.add_sequence("a", [])
    ref: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    await _steps(st, "a", n, ref, seed=0)
    return ref


async def _exact(st: KVStore, sid: str, ref: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Every layer of ``sid`` reads back (through a lease) what ``ref`` holds."""
    for layer in range(SPEC.num_layers):
        k, v = await read_back(st, sid, layer)
        assert torch.equal(k, ref[layer][0]) and torch.equal(v, ref[layer][1])


def _dirty(st: KVStore, sid: str) -> set[tuple[int, int]]:
    """(layer, block) of the sequence's dirty device pages."""
    seq = st.sequence(sid)
    dirty = st.tiers.pages.dirty
    return {
        (layer, b)
        for layer in range(SPEC.num_layers)
        for b, key in enumerate(seq.pages(layer))
        if key in dirty
    }


async def test_partly_filled_pages_stay_dirty_where_the_device_keeps_them() -> None:
    async with _store(device_pages=40) as st:  # room for every page: nothing is evicted
        ref = await _begun(st, T + 2)  # block 0 filled, block 1 holds 2 tokens
        assert _dirty(st, "a") == {(layer, 1) for layer in range(SPEC.num_layers)}
        before = st.stats()["bytes_d2h"]
        await _steps(st, "a", T - 2, ref, seed=500)  # block 1 fills: it goes down now
        assert _dirty(st, "a") == set()
        assert st.stats()["bytes_d2h"] - before == SPEC.num_layers * PAGE  # block 1, once
        await idle(st)
        await _exact(st, "a", ref)


async def test_partly_filled_pages_go_down_where_the_device_could_not_keep_them() -> None:
    # 4 partial pages (one a layer) + a window of two one-layer groups of 1-2 pages > 5 slots
    async with _store(device_pages=5) as st:
        ref = await _begun(st, T + 2)
        assert _dirty(st, "a") == set()  # every written page went down at its step's exit
        await idle(st)
        await _exact(st, "a", ref)


async def test_a_dirty_partial_page_evicted_by_another_sequence_reads_back_exact() -> None:
    async with _store(device_pages=12) as st:  # "a": 4 partial pages + window: kept dirty
        ref = await _begun(st, 2)
        assert _dirty(st, "a") == {(layer, 0) for layer in range(SPEC.num_layers)}
        await st.add_sequence("b", [])  # "b" fills the device: "a"'s dirty pages must leave
        other: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        await _steps(st, "b", 3 * T, other, seed=900)
        held = set(st.tiers.table.keys(DEVICE))
        assert not held >= set(st.sequence("a").pages(0) + st.sequence("a").pages(3))
        await idle(st)
        await _exact(st, "a", ref)
        await _exact(st, "b", other)
        await _steps(st, "a", T, ref, seed=1300)  # "a" goes on from its written-back pages
        await idle(st)
        await _exact(st, "a", ref)


async def test_a_step_announcing_the_order_before_it_keeps_the_order_and_its_index() -> None:
    # a decode step announces what the step before did (the same pages): the order object,
    # hence the page table's index of places (built per order), stays; another order replaces
    async with _store(device_pages=12) as st:
        ref = await _begun(st, 2)  # 2 -> 3 tokens next: the same pages
        evict = st.tiers._evict
        order = evict.soon_order
        assert order
        await _steps(st, "a", 1, ref, seed=40)
        assert evict.soon_order is order
        await _steps(st, "a", T, ref, seed=80)  # a new page: another order
        assert evict.soon_order is not order and len(evict.soon_order) > len(order)
        await idle(st)
        await _exact(st, "a", ref)
