"""The step path (tierkv.step): KV bit-identical to what was appended, through loads and
evictions; bad input raises the typed error before anything changes; nothing stays pinned,
admitted or opened after an exit, whatever ended the step."""

from __future__ import annotations

import pytest
import torch

from tierkv import KVSpec, SequenceError, SpecError
from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.store import KVStore
from tierkv.tiers import DEVICE

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=8, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
H, D = SPEC.num_kv_heads, SPEC.head_dim


def store(device_pages: int = 12) -> KVStore:
    return KVStore(SPEC, device_bytes=device_pages * PAGE, host_bytes=400 * PAGE, codec=None)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


async def idle(st: KVStore) -> None:
    """Nothing pinned on the device, nothing admitted, the store's invariants hold."""
    await st.drain()
    table = st.tiers.table
    for k in table.keys(DEVICE):
        assert table.pins(k, DEVICE) == 0, "a device page is still pinned"
    assert st.admission.committed == 0 and st.admission.active == 0
    st.check()


async def read_back(st: KVStore, sid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    async with st.lease([sid], [layer]) as lease:
        k, v = lease.kv(sid, layer)
        return k.clone(), v.clone()


async def test_batch_kv_is_exact_through_loads_and_evictions() -> None:
    # the device holds a fraction of the KV: every step loads and evicts
    ids = ["a", "b", "c"]
    ref = {
        (s, layer): (torch.empty(H, 0, D), torch.empty(H, 0, D)) for s in ids for layer in range(4)
    }
    async with store(device_pages=24) as st:
        for s in ids:
            await st.add_sequence(s, [])
        for n_step in range(14):
            n = 5 if n_step == 0 else 1
            async with st.step_plan(ids, tokens=n, ahead=2) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    k = rand(3, H, n, D, seed=100 * n_step + layer)
                    v = rand(3, H, n, D, seed=100 * n_step + layer + 50)
                    h.append(k, v)
                    got_k, got_v = h.kv()
                    for b, s in enumerate(ids):
                        rk, rv = ref[(s, layer)]
                        ref[(s, layer)] = torch.cat([rk, k[b]], 1), torch.cat([rv, v[b]], 1)
                        assert torch.equal(got_k[b], ref[(s, layer)][0])
                        assert torch.equal(got_v[b], ref[(s, layer)][1])
            st.step()
            await idle(st)
        assert st.stats()["page_loads"] > 0  # the pages did leave the device and come back
        for s in ids:  # the lease path reads the same bytes
            for layer in range(SPEC.num_layers):
                k, v = await read_back(st, s, layer)
                assert torch.equal(k, ref[(s, layer)][0]) and torch.equal(v, ref[(s, layer)][1])


@pytest.mark.parametrize("ahead", [0, 1, 3])
async def test_ragged_sequences_and_token_major_kv(ahead: int) -> None:
    # different lengths and counts per sequence; new KV as [H, N, D]; read with kv_list
    ids = ["x", "y"]
    async with store(device_pages=40) as st:
        await st.add_sequence("x", [])
        await st.add_sequence("y", [])
        ref: dict[tuple[str, int], torch.Tensor] = {}
        for n_step, counts in enumerate([[3, 6], [1, 2], [0, 5], [4, 1]]):
            async with st.step_plan(ids, tokens=counts, ahead=ahead) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    k = rand(H, sum(counts), D, seed=10 * n_step + layer)
                    h.append(k, k + 1)
                    parts = k.split(counts, dim=1)
                    for (s, part), (got_k, got_v) in zip(zip(ids, parts), h.kv_list()):
                        have = ref.get((s, layer), torch.empty(H, 0, D))
                        ref[(s, layer)] = torch.cat([have, part], 1)
                        assert torch.equal(got_k, ref[(s, layer)])
                        assert torch.equal(got_v, ref[(s, layer)] + 1)
                    if len({st.sequence(s).kv_len_of(layer) for s in ids}) > 1:
                        with pytest.raises(SequenceError, match="kv_list"):
                            h.kv()
            await idle(st)


async def test_bad_plans_raise_before_anything_changes() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        before = st.sequence("a").num_blocks
        with pytest.raises(SequenceError):
            st.step_plan(["a", "nope"])
        with pytest.raises(SequenceError):
            st.step_plan(["a", "a"])
        with pytest.raises(SpecError):
            st.step_plan(["a"], [0, 9])
        with pytest.raises(SpecError):
            st.step_plan(["a"], [1, 1])
        with pytest.raises(SpecError):
            st.step_plan(["a"], tokens=[1, 2])
        with pytest.raises(InvalidInputError):
            st.step_plan(["a"], tokens=-1)
        with pytest.raises(InvalidTypeError):
            st.step_plan(["a"], tokens="3")
        with pytest.raises(InvalidTypeError):
            st.step_plan("a")
        assert st.sequence("a").num_blocks == before
        await idle(st)


async def test_bad_appends_and_layers_raise_before_anything_changes() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        await st.add_sequence("b", [])
        async with st.step_plan(["a", "b"], tokens=2) as step:
            with pytest.raises(SpecError, match="in order"):
                await step.layer(1)
            with pytest.raises(SpecError):
                await step.layer(7)
            h = await step.layer(0)
            with pytest.raises(SequenceError, match="append"):
                h.kv()  # nothing appended yet
            good = rand(2, H, 2, D, seed=1)
            for bad in (
                rand(2, H, 3, D, seed=1),  # wrong token count
                rand(1, H, 2, D, seed=1),  # wrong batch
                good.double(),  # wrong dtype
                good.to("meta"),
            ):
                with pytest.raises(SpecError):
                    h.append(bad, bad)
            with pytest.raises(SpecError):
                h.append(good, good[:, :, :1])
            with pytest.raises(InvalidTypeError):
                h.append("k", good)  # type: ignore[arg-type]
            assert [st.sequence(s).kv_len_of(0) for s in "ab"] == [0, 0]
            h.append(good, good)
            with pytest.raises(SequenceError, match="already"):
                h.append(good, good)
            h1 = await step.layer(1)
            with pytest.raises(SequenceError, match="no longer current"):
                h.kv()
            await st.release("b")  # released inside the step: its append is refused, whole
            with pytest.raises(SequenceError, match="released"):
                h1.append(good, good)
            assert st.sequence("a").kv_len_of(1) == 0
        await idle(st)
        assert st.sequence("a").kv_len == [2, 0, 0, 0]


async def test_an_error_mid_step_leaves_nothing_behind() -> None:
    async with store(device_pages=20) as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=6) as step:  # two pages per layer, in full
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                k = rand(1, H, 6, D, seed=layer)
                h.append(k, k)
        with pytest.raises(RuntimeError, match="model failed"):
            async with st.step_plan(["a"], tokens=3) as step:  # opens a page in every layer
                h = await step.layer(0)
                k = rand(1, H, 3, D, seed=9)
                h.append(k, k)
                await step.layer(1)  # loaded, pinned, its new page opened: never appended to
                raise RuntimeError("model failed")
        await idle(st)  # the unused layers' new pages went with the step (owners agree)
        assert st.sequence("a").kv_len == [9, 6, 6, 6]
        k0, _ = await read_back(st, "a", 0)
        assert torch.equal(k0[:, 6:], rand(1, H, 3, D, seed=9)[0])
        async with st.step_plan(["a"], [1, 2, 3], tokens=3) as step:  # the others catch up
            for layer in (1, 2, 3):
                h = await step.layer(layer)
                k = rand(1, H, 3, D, seed=20 + layer)
                h.append(k, k)
        await idle(st)
        assert st.sequence("a").kv_len == [9, 9, 9, 9]


async def test_window_shrinks_to_fit_and_late_fetches_are_counted() -> None:
    # 3 pages per layer, 8 device pages: two groups of two layers never fit, one layer does
    async with store(device_pages=8) as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=12, ahead=2) as step:
            assert step.ahead == 1
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                k = rand(1, H, 12, D, seed=layer)
                h.append(k, k)
        await idle(st)
        for layer in range(SPEC.num_layers):
            k, _ = await read_back(st, "a", layer)
            assert torch.equal(k, rand(1, H, 12, D, seed=layer)[0])
        st.add_tokens("a", [1])
        async with st.step_plan(["a"], tokens=1) as step:
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(rand(1, H, 1, D, seed=0), rand(1, H, 1, D, seed=0))
        stats = st.stats()
        assert stats["page_loads"] > 0
        assert 0 <= stats["late_fetches"] <= stats["page_loads"]
        await idle(st)


async def test_layer_now_only_inside_a_landed_group() -> None:
    async with store(device_pages=40) as st:
        await st.add_sequence("a", [])
        async with st.step_plan(["a"], tokens=1, ahead=2) as step:
            assert step.layer_now(0) is None  # a group's first layer goes through layer()
            h = await step.layer(0)
            h.append(rand(1, H, 1, D, seed=0), rand(1, H, 1, D, seed=0))
            assert step.layer_now(2) is None  # not the next layer
            h1 = step.layer_now(1)
            assert h1 is not None and h1.layer == 1
            h1.append(rand(1, H, 1, D, seed=1), rand(1, H, 1, D, seed=1))
            assert step.layer_now(2) is None  # the next group's first layer
            for layer in (2, 3):
                h = await step.layer(layer)
                h.append(rand(1, H, 1, D, seed=layer), rand(1, H, 1, D, seed=layer))
        await idle(st)
        assert st.sequence("a").kv_len == [1, 1, 1, 1]


async def test_kv_that_requires_grad_is_stored_as_values() -> None:
    async with store(device_pages=40) as st:
        await st.add_sequence("a", [])
        k = rand(1, H, 2, D, seed=3).requires_grad_()
        async with st.step_plan(["a"], tokens=2) as step:
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                h.append(k, k * 2)
                got_k, got_v = h.kv()
                assert not got_k.requires_grad
                assert torch.equal(got_v, (k * 2).detach())
        assert not step.flat.requires_grad and k.grad is None
        await idle(st)
