"""Which thread runs a TieredCache's store (tierkv.integrations.hf_store): a store the cache
opens runs in the caller's thread, a shared SyncKVStore on its own; both return the same K/V,
and a private store used where an event loop runs raises a typed error and changes nothing."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")

import torch
from transformers import LlamaConfig

import tierkv
from tierkv.integrations.hf import TieredCache, kv_spec_for
from tierkv.integrations.hf_store import LoopInUseError

CFG = LlamaConfig(
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=64,
    head_dim=16,
    vocab_size=32,
)
SPEC = kv_spec_for(CFG, torch.float32, 4)


def _own(device_pages: int = 4) -> TieredCache:
    return TieredCache(
        CFG,
        dtype=torch.float32,
        page_tokens=4,
        device_bytes=device_pages * SPEC.page_bytes,
        host_bytes=1 << 20,
    )


def _steps(cache: TieredCache, n_prompt: int = 6, n_new: int = 5) -> list[torch.Tensor]:
    """Prompt then ``n_new`` single tokens through every layer; each layer's last K against
    the concatenation of what went in."""
    g = torch.Generator().manual_seed(0)
    sent: list[list[torch.Tensor]] = [[] for _ in range(3)]
    last: list[torch.Tensor] = []
    for n in [n_prompt] + [1] * n_new:
        for layer in range(3):
            k = torch.randn(1, 2, n, 16, generator=g)
            sent[layer].append(k)
            got_k, _ = cache.layers[layer].update(k, k + 1)
            assert torch.equal(got_k, torch.cat(sent[layer], dim=2))
            if layer == 2:
                last.append(got_k)
    return last


def test_own_store_and_shared_store_return_the_same_kv_under_pressure() -> None:
    with _own(device_pages=4) as mine:  # 4 pages: each layer's pages move every step
        a = _steps(mine)
        assert mine.stats()["page_loads"] > 0
    with (
        tierkv.SyncKVStore(SPEC, device_bytes=4 * SPEC.page_bytes, host_bytes=1 << 20) as store,
        TieredCache(store=store) as shared,
    ):
        b = _steps(shared)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_own_store_used_inside_a_running_loop_raises_and_changes_nothing() -> None:
    cache = _own()
    k = torch.zeros(1, 2, 3, 16)

    async def inside() -> None:
        cache.layers[0].update(k, k)

    with cache:
        with pytest.raises(LoopInUseError, match=r"asyncio\.to_thread") as info:
            asyncio.run(inside())
        assert isinstance(info.value, tierkv.TierKVError)
        assert cache.get_seq_length() == 0  # nothing was appended
        got, _ = cache.layers[0].update(k, k)  # still usable outside the loop
        assert got.shape == (1, 2, 3, 16)


def test_cache_opened_inside_a_running_loop_runs_its_store_on_a_thread() -> None:
    async def inside() -> list[torch.Tensor]:
        with _own() as cache:
            return _steps(cache, n_new=2)

    with _own() as cache:
        expect = _steps(cache, n_new=2)
    got = asyncio.run(inside())
    assert all(torch.equal(x, y) for x, y in zip(expect, got, strict=True))


def test_closed_cache_raises_store_closed() -> None:
    cache = _own()
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(tierkv.StoreClosedError):
        cache.layers[0].update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_prefetch_windows_return_the_same_kv_and_prefetch(
    window: int, inline: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not inline:
        monkeypatch.setenv("TIERKV_INLINE_COPIES", "0")  # every copy on the copy thread
    with TieredCache(
        CFG,
        dtype=torch.float32,
        page_tokens=4,
        device_bytes=8 * SPEC.page_bytes,
        host_bytes=1 << 20,
        prefetch=False,
    ) as plain:
        expect = _steps(plain)
        assert plain.stats()["prefetched"] == 0
    with TieredCache(
        CFG,
        dtype=torch.float32,
        page_tokens=4,
        device_bytes=8 * SPEC.page_bytes,
        host_bytes=1 << 20,
        prefetch_layers=window,
    ) as ahead:
        got = _steps(ahead)
        # a step's end prefetches the next step's first layers where their copy runs on a
        # copy thread; an inline copy (cpu) runs on this thread either way: at the next entry
        assert ahead.stats()["page_loads"] > 0
        assert (ahead.stats()["prefetched"] > 0) is not inline
        # inline copies (no overlap to gain): one group of twice the layers at a time
        plan = ahead._step_plan(1)
        assert (plan.window, plan.ahead) == ((1, 2 * window) if inline else (2, window))
    assert all(torch.equal(x, y) for x, y in zip(expect, got, strict=True))


@pytest.mark.parametrize(
    ("value", "error"), [(0, tierkv.InvalidInputError), ("2", tierkv.InvalidTypeError)]
)
def test_bad_prefetch_layers_raise_before_a_store_opens(value: object, error: type) -> None:
    with pytest.raises(error, match="prefetch_layers"):
        TieredCache(CFG, device_bytes=1 << 20, host_bytes=1 << 20, prefetch_layers=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["async KVStore", "str"])
def test_a_store_that_is_not_a_sync_store_is_a_type_error(kind: str) -> None:
    """A new user passes the async KVStore they made: an AttributeError ('KVStore' object has
    no attribute 'store') from deep inside; now InvalidTypeError naming SyncKVStore."""
    store = tierkv.KVStore(SPEC, device_bytes=8 * SPEC.page_bytes, host_bytes=1 << 20)
    wrong = store if kind == "async KVStore" else "store"
    with pytest.raises(tierkv.InvalidTypeError, match="SyncKVStore"):
        TieredCache(store=wrong)  # type: ignore[arg-type]
