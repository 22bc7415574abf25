"""A step with a window of one group (``step_plan(..., window=1)``, issue 26): the next group
loads once the caller is done with the group before (``StepPlan.done_with``), after that group
is let go of, so the step pins one group at a time and asks the admission for half the room;
KV stays exact through loads, nothing stays pinned, a layer let go of cannot be read, and a
caller that never says it is done still gets every layer."""

from __future__ import annotations

import pytest
import torch

from tierkv import InvalidInputError, InvalidTypeError, SequenceError
from tierkv.keys import page_key
from tierkv.store import KVStore
from tierkv.tiers import DEVICE

from .test_step import SPEC, D, H, idle, rand

PAGE = SPEC.page_bytes


def _store(device_pages: int = 10) -> KVStore:
    return KVStore(SPEC, device_bytes=device_pages * PAGE, host_bytes=200 * PAGE, codec=None)


def _pinned(st: KVStore) -> int:
    table = st.tiers.table
    return sum(1 for k in table.keys(DEVICE) if table.pins(k, DEVICE))


@pytest.mark.parametrize("done", [True, False])
async def test_one_group_at_a_time_keeps_the_kv_exact(done: bool) -> None:
    async with _store(device_pages=10) as st:
        await st.add_sequence("a", [])
        ref = {layer: torch.empty(H, 0, D) for layer in range(SPEC.num_layers)}
        for n_step, n in enumerate((10, 1, 1, 3, 1)):  # 3-4 pages a layer: loads every step
            async with st.step_plan(["a"], tokens=n, ahead=2, window=1) as step:
                assert step.window == 1
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    k = rand(1, H, n, D, seed=10 * n_step + layer)
                    h.append(k, k + 1)
                    ref[layer] = torch.cat([ref[layer], k[0]], 1)
                    got_k, got_v = h.kv()
                    assert torch.equal(got_k[0], ref[layer])
                    assert torch.equal(got_v[0], ref[layer] + 1)
                    if done:
                        step.done_with(h)
                        if layer % 2 == 1 and layer + 1 < SPEC.num_layers:
                            with pytest.raises(SequenceError):  # let go of: no longer readable
                                h.kv()
                        else:
                            h.kv()  # (not a group's last layer: still current)
                    # one group of two layers pinned at a time (4 pages a layer at most)
                    assert _pinned(st) <= 2 * 4
            st.step()
            await st.drain()  # (the write-behind's pins gone before the next step)
        got = st.stats()
        assert got["page_loads"] > 0
        # told it is done, the next group landed before its first layer asked; else that
        # layer loaded it on demand: compute waited (late)
        assert (got["late_fetches"] == 0) is done
        await idle(st)


async def test_one_group_window_asks_for_half_the_room() -> None:
    async with _store(device_pages=40) as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=12, ahead=2) as step:  # 3 pages a layer
            assert st.admission.committed == 2 * 2 * 3  # two groups of two layers
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(rand(1, H, 12, D, seed=layer), rand(1, H, 12, D, seed=layer))
        async with st.step_plan(["a"], tokens=1, ahead=2, window=1) as step:
            assert st.admission.committed == 2 * 4  # one group of two layers, 4 pages each
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(rand(1, H, 1, D, seed=layer), rand(1, H, 1, D, seed=layer))
                h.kv()
                step.done_with(h)
        await idle(st)


@pytest.mark.parametrize(
    ("window", "error"), [(0, InvalidInputError), (3, InvalidInputError), ("1", InvalidTypeError)]
)
async def test_a_bad_window_raises_before_anything_changes(window: object, error: type) -> None:
    async with _store() as st:
        await st.add_sequence("a", [])
        with pytest.raises(error, match="window"):
            st.step_plan(["a"], window=window)  # type: ignore[arg-type]
        assert st.sequence("a").num_blocks == 0
        await idle(st)


async def test_filled_pages_are_sealed_once_a_group_at_its_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierkv.lease_pages import LeasePages
    from tierkv.page_sums import enabled, row_sums

    if not enabled():
        pytest.skip("page checksums are off here")
    calls: list[int] = []
    real = LeasePages.seal

    def counted(self: LeasePages, keys: list[bytes]) -> None:
        calls.append(len(keys))
        real(self, keys)

    monkeypatch.setattr(LeasePages, "seal", counted)
    async with _store(device_pages=40) as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=3, ahead=2) as step:
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(rand(1, H, 3, D, seed=layer), rand(1, H, 3, D, seed=layer))
        assert calls == []  # no page filled
        async with st.step_plan(["a"], tokens=6, ahead=2) as step:  # fills page 0 and 1
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(rand(1, H, 6, D, seed=layer), rand(1, H, 6, D, seed=layer))
        assert calls == [4, 4]  # one call a group of two layers, two full pages each
        seq = st.sequence("a")
        full = [page_key(seq.block(b), layer) for layer in range(SPEC.num_layers) for b in (0, 1)]
        rows = st.tiers.pages.all_pages.view(torch.uint8).reshape(len(st.tiers.pages.all_pages), -1)
        sums = row_sums(rows.numpy(), st.tiers.pages.device_slots(full))
        assert st.tiers.table.sums(full) == sums  # the CRC-32C of their final bytes
        await idle(st)


async def test_written_pages_are_dirty_before_their_group_is_unpinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group's written pages are marked dirty at its release, once for its layers: before
    the unpin that lets an eviction (or a write-behind's clean) see them."""
    from tierkv.lease_pages import LeasePages
    from tierkv.tiers import TierSet

    events: list[tuple[str, frozenset[bytes]]] = []
    real_dirty, real_unpin = LeasePages.mark_dirty, TierSet.unpin_device

    def dirty(self: LeasePages, keys: list[bytes]) -> None:
        events.append(("dirty", frozenset(keys)))
        real_dirty(self, keys)

    def unpin(self: TierSet, keys: list[bytes]) -> None:
        events.append(("unpin", frozenset(keys)))
        real_unpin(self, keys)

    monkeypatch.setattr(LeasePages, "mark_dirty", dirty)
    monkeypatch.setattr(TierSet, "unpin_device", unpin)
    async with _store(device_pages=10) as st:
        await st.add_sequence("a", [])
        for n in (5, 1):  # the second step writes page 1 of each layer (tokens 4-7)
            events.clear()
            async with st.step_plan(["a"], tokens=n, ahead=2, window=1) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    h.append(rand(1, H, n, D, seed=layer), rand(1, H, n, D, seed=layer))
                    h.kv()
                    step.done_with(h)
            st.step()
            await st.drain()
        seq = st.sequence("a")
        wrote = {page_key(seq.block(1), layer) for layer in range(SPEC.num_layers)}
        marked: set[bytes] = set()
        unpinned: set[bytes] = set()
        for what, keys in events:
            if what == "dirty":
                marked |= keys
            else:  # each page the step wrote was marked before the unpin of its group
                assert keys & wrote <= marked
                unpinned |= keys & wrote
        assert unpinned == wrote == marked
        assert [w for w, _ in events].count("dirty") == 2  # one call a group of two layers
        await idle(st)
