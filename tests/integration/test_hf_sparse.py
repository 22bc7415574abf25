"""TieredCache's sparse and host-side attention on a small random Llama (transformers):
exact when top-k covers every page, host-attended pages never cross to the device, fewer
pages read with a small k, typed errors at entry, and a model not routed to "tierkv"."""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tierkv.attention.hf import AttentionNotRoutedError, route
from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.integrations.hf import TieredCache, kv_spec_for

NEW = 10
# two layers, 4 query heads sharing 2 KV heads of 16 channels
TINY = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY, **HEADS)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 101, (1, 90))
    with torch.inference_mode():
        logits = model(ids).logits
        greedy = model.generate(
            ids,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            cache=DynamicCache(config=cfg),
        )
    return model, ids, logits, greedy


def _cache(model: Any, pages: int, **kw: Any) -> TieredCache:
    spec = kv_spec_for(model.config, model.dtype)
    kw.setdefault("host_bytes", 8 << 20)
    return TieredCache(model.config, device_bytes=pages * spec.page_bytes, **kw)


def _run(model: Any, ids: torch.Tensor, cache: TieredCache) -> torch.Tensor:
    route(model)
    try:
        with torch.inference_mode():
            return model.generate(
                ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, cache=cache
            )
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("weight", [0.0, 0.5])  # Quest's bound; halfway to the mean key
def test_topk_covering_every_page_is_full_attention(tiny: Any, weight: float) -> None:
    model, ids, logits, greedy = tiny
    route(model)
    try:
        with (
            _cache(model, 16, sparse_topk=64, sparse_mean_weight=weight) as c,
            torch.inference_mode(),
        ):
            got = model(ids, cache=c).logits
            assert float((got - logits).abs().max() / logits.abs().max()) < 1e-5
    finally:
        model.set_attn_implementation("sdpa")
    with _cache(model, 16, sparse_topk=64, sparse_mean_weight=weight) as c:
        assert torch.equal(_run(model, ids, c), greedy)
        sp = c.stats()["sparse"]
    assert sp["decode_page_share"] == 1.0 and sp["decode_attends"] == 2 * (NEW - 1)


@pytest.mark.parametrize("codec", ["int8", None])  # None: no cold tier (its size unknown)
def test_host_attention_moves_no_page_to_the_device(tiny: Any, codec: str | None) -> None:
    model, ids, _, greedy = tiny
    with _cache(model, 8, host_attention=True, codec=codec) as c:  # history overflows the device
        assert torch.equal(_run(model, ids, c), greedy)
        st = c.stats()
    assert st["sparse"]["host_pages"] > 0 and st["sparse"]["host_bytes"] > 0
    assert st["page_loads"] == 0 and st["bytes_h2d"] == 0
    with _cache(model, 8) as c:  # the same run without it loads those pages
        _run(model, ids, c)
        assert c.stats()["page_loads"] > 0


def test_host_attention_decodes_cold_pages_on_the_host(tiny: Any) -> None:
    """Pages only the cold tier holds are decoded in host memory and attended there: none is
    loaded to the device, and the tokens are those of the same store loading them."""
    model, ids, _, _ = tiny
    page = kv_spec_for(model.config, model.dtype).page_bytes
    small = {"host_bytes": 40 * page, "codec": "int8", "cold_fraction": 0.5}
    small.update(compress_after=1, compress_live=True)  # idle live pages go cold
    with _cache(model, 8, host_attention=True, **small) as c:
        got = _run(model, ids, c)
        st = c.stats()
    sp = st["sparse"]
    assert sp["cold_pages"] > 0 and sp["cold_bytes"] > 0 and sp["host_pages"] > sp["cold_pages"]
    assert st["page_loads"] == 0 and st["bytes_h2d"] == 0
    with _cache(model, 8, **small) as c:  # the same store decoding them onto the device
        want = _run(model, ids, c)
        assert c.stats()["page_loads"] > 0
    assert torch.equal(got, want)


def test_dense_first_layers_attend_every_page(tiny: Any) -> None:
    model, ids, _, greedy = tiny
    with _cache(model, 16, sparse_topk=1, sparse_recent=1, sparse_dense_layers=2) as c:
        assert torch.equal(_run(model, ids, c), greedy)  # both layers dense: full attention
        assert c.stats()["sparse"]["decode_page_share"] == 1.0
    with _cache(model, 16, sparse_topk=1, sparse_recent=1, sparse_dense_layers=1) as c:
        _run(model, ids, c)
        share = c.stats()["sparse"]["decode_page_share"]
    assert 0.5 < share < 1.0  # layer 0 every page, layer 1 three of 6-7
    with pytest.raises(InvalidInputError):
        _cache(model, 16, sparse_topk=1, sparse_dense_layers=-1)


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_small_topk_reads_fewer_pages(tiny: Any, weight: float) -> None:
    model, ids, _, _ = tiny
    with _cache(model, 8) as c:
        _run(model, ids, c)
        full = c.stats()["bytes_h2d"]
    with _cache(model, 8, sparse_topk=1, sparse_recent=1, sparse_mean_weight=weight) as c:
        out = _run(model, ids, c)
        st = c.stats()
    assert out.shape[1] == ids.shape[1] + NEW
    share = st["sparse"]["decode_page_share"]
    assert share < 0.6 and st["bytes_h2d"] < full


def test_bad_options_are_typed_errors_at_entry(tiny: Any) -> None:
    model = tiny[0]
    for bad in (0, -2):
        with pytest.raises(InvalidInputError):
            _cache(model, 8, sparse_topk=bad)
    with pytest.raises(InvalidTypeError):
        _cache(model, 8, sparse_topk=2.5)
    with pytest.raises(InvalidInputError):
        _cache(model, 8, sparse_recent=-1, sparse_topk=2)
    with pytest.raises(InvalidInputError, match="above"):
        _cache(model, 8, sparse_topk=10**6)  # more pages than the store holds
    for weight in (-0.1, 1.0):
        with pytest.raises(InvalidInputError, match="sparse_mean_weight"):
            _cache(model, 8, sparse_topk=2, sparse_mean_weight=weight)
    with pytest.raises(InvalidTypeError):
        _cache(model, 8, sparse_topk=2, sparse_mean_weight="half")


def test_a_model_not_routed_to_tierkv_attention_is_an_error(tiny: Any) -> None:
    model, ids, _, _ = tiny
    model.set_attn_implementation("sdpa")
    with (
        _cache(model, 16, sparse_topk=4) as c,
        pytest.raises(AttentionNotRoutedError),
        torch.inference_mode(),
    ):
        model(ids, cache=c)


def test_a_padded_batch_of_two(tiny: Any) -> None:
    model = tiny[0]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 101, (2, 70), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 0, 0  # the second row left-padded
    with torch.inference_mode():
        ref = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            do_sample=False,
            cache=DynamicCache(config=model.config),
        )
    route(model)
    try:
        for kw in ({"sparse_topk": 64}, {"host_attention": True}):
            with _cache(model, 16, **kw) as c, torch.inference_mode():
                got = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, cache=c
                )
            assert torch.equal(got, ref), kw
    finally:
        model.set_attn_implementation("sdpa")


def test_auto_host_attention_decides_by_room_and_burst(tiny: Any) -> None:
    from tierkv.attention.sparse import SparseOptions

    auto = SparseOptions(host="auto", queue_bound=2)
    assert not auto.host_wanted(5, room=8, in_flight=0)  # room for them: loaded
    assert auto.host_wanted(9, room=8, in_flight=0)  # more than the device's room
    assert auto.host_wanted(1, room=8, in_flight=3)  # a burst of transfers
    assert not auto.host_wanted(0, room=0, in_flight=9)
    assert SparseOptions(host=True).host_wanted(1, room=99, in_flight=0)
    assert not SparseOptions().host_wanted(9, room=0, in_flight=9)
    with pytest.raises(InvalidTypeError):
        SparseOptions(host="sometimes")
    model, ids, _, greedy = tiny
    with _cache(model, 8, host_attention="auto") as c:  # the device has room: pages load
        assert torch.equal(_run(model, ids, c), greedy)
        st = c.stats()
    assert st["sparse"]["host_pages"] == 0 and st["page_loads"] > 0
