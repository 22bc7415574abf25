"""Units of tierkv.serving: stop strings on streamed text, the scheduler's plan and admission,
sampling parameters."""

from __future__ import annotations

import pytest

from tierkv.serving import SamplingParams, StopText
from tierkv.serving.request import Request
from tierkv.serving.sampling import Sampler
from tierkv.serving.scheduler import Scheduler


def chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def test_stop_text_holds_back_a_possible_stop_and_cuts_before_it() -> None:
    s = StopText(chars, ["END"])
    out = "".join(s.push(ord(c)) for c in "abcEN")
    assert out == "abc"  # "EN" may start "END": held back
    assert s.push(ord("D")) == "" and s.stopped and s.text == "abc"
    s = StopText(chars, ["END"])
    out = "".join(s.push(ord(c)) for c in "abENx") + s.flush()
    assert out == "abENx" and not s.stopped


def test_stop_text_without_stops_emits_everything() -> None:
    s = StopText(chars, [])
    assert [s.push(ord(c)) for c in "hi"] == ["h", "i"] and s.flush() == ""


def request(rid: str, prompt: int, max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(range(prompt)), params, Sampler(params))


def test_the_plan_puts_decode_tokens_first_then_prefill_chunks() -> None:
    s = Scheduler(max_running=4, max_batch_tokens=8, layer_pages=100, page_tokens=4)
    a, b, c = request("a", 3, 4), request("b", 20, 4), request("c", 20, 4)
    for r in (a, b, c):
        s.add(r)
    assert s.admit() == [a, b, c]
    a.computed, a.output = 3, [7]  # a decodes
    b.computed = 4
    plan = s.plan()
    assert [(r.rid, len(t)) for r, t in plan] == [("a", 1), ("b", 7)]
    assert plan[1][1] == list(range(4, 11))


def test_admission_is_fifo_by_layer_footprint() -> None:
    s = Scheduler(max_running=8, max_batch_tokens=8, layer_pages=7, page_tokens=4)
    small, big, tiny = request("small", 4, 4), request("big", 20, 4), request("tiny", 1, 1)
    for r in (small, big, tiny):
        s.add(r)
    assert s.admit() == [small]  # 2 pages; big's 6 do not fit beside them, tiny never overtakes
    s.remove(small)
    assert s.admit() == [big, tiny]  # 6 + 1 pages
    assert s.admit() == [] and not s.waiting
    assert not s.could_fit(request("huge", 30, 4))
    alone = request("alone", 20, 20)  # 10 pages: alone it could never run
    assert not s.could_fit(alone)


def test_sampling_params_are_checked() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"stop": ("",)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("n", "past"), [(1, 0), (1, 37), (5, 0), (5, 37)])
def test_grouped_attention_matches_repeated_heads(n: int, past: int) -> None:
    import torch
    import torch.nn.functional as F

    from tierkv.serving.model import causal_attention

    g = torch.Generator().manual_seed(n * 100 + past)
    q = torch.randn(6, n, 8, generator=g)
    k = torch.randn(2, past + n, 8, generator=g)
    v = torch.randn(2, past + n, 8, generator=g)
    kk, vv = k.repeat_interleave(3, 0), v.repeat_interleave(3, 0)
    mask = torch.arange(past + n)[None, :] <= torch.arange(past, past + n)[:, None]
    want = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
    got = causal_attention(q, k, v, past)
    torch.testing.assert_close(got, want.transpose(0, 1).reshape(n, 48))


def test_engine_config_is_checked() -> None:
    from tierkv.serving import EngineConfig

    for bad in (
        {"max_running": 0},
        {"max_batch_tokens": 0},
        {"max_context": 1},
        {"host_bytes": -1},
    ):
        with pytest.raises(ValueError):
            EngineConfig(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_batched_decode_attention_matches_attention_per_sequence(kv_dtype: str) -> None:
    # the engine's one call for its decode rows against the per-request call it replaced,
    # over K/V padded with finite rows that the mask hides
    import torch

    from tierkv.serving.model import causal_attention, decode_attention
    from tierkv.spec import parse_dtype

    g = torch.Generator().manual_seed(7)
    lengths = [1, 9, 64, 33, 2]
    smax, hq, hkv, d = max(lengths), 6, 2, 16
    q = torch.randn(len(lengths), hq, d, generator=g)
    k = torch.randn(len(lengths), hkv, smax, d, generator=g).to(parse_dtype(kv_dtype))
    v = torch.randn(len(lengths), hkv, smax, d, generator=g).to(parse_dtype(kv_dtype))
    mask = torch.arange(smax)[None, :] < torch.tensor(lengths)[:, None]
    got = decode_attention(q, k, v, mask)
    for b, s in enumerate(lengths):
        want = causal_attention(q[b][:, None], k[b, :, :s], v[b, :, :s], s - 1)
        assert (got[b] - want[0]).abs().max().item() <= 1e-6
    same = decode_attention(q, k, v, None)  # no padding: no mask, every position
    for b in range(len(lengths)):
        want = causal_attention(q[b][:, None], k[b], v[b], smax - 1)
        assert (same[b] - want[0]).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 2.0},  # ran as 2
        {"max_tokens": True},
        {"temperature": "0.5"},
        {"top_p": None},
        {"seed": 1.5},  # torch's RuntimeError when the request started
        {"seed": True},
        {"stop_ids": "ab"},  # a TypeError at the first token
        {"stop_ids": 5},
        {"stop_ids": (1.5,)},
        {"stop": b"x"},
        {"stop": ("a", 3)},
        {"stop": 3},
    ],
)
def test_sampling_params_of_the_wrong_type_are_type_errors(bad: dict[str, object]) -> None:
    """A careless caller's types: refused by SamplingParams itself (InvalidTypeError), never
    found out inside a running request."""
    from tierkv.errors import InvalidTypeError

    with pytest.raises(InvalidTypeError):
        SamplingParams(**bad)  # type: ignore[arg-type]


def test_sampling_params_normalize_a_single_stop_string_and_the_stop_ids() -> None:
    """A bare ``stop="END"`` stopped at any of E, N, D (a str is a sequence of characters); it
    is one stop string. ``stop_ids`` of any collection become a frozenset (hashable)."""
    p = SamplingParams(stop="END", stop_ids=[7, 7, 9])
    assert p.stop == ("END",) and p.stop_ids == frozenset({7, 9})
    hash(p)
    s = StopText(chars, p.stop)
    assert "".join(s.push(ord(c)) for c in "aNb") == "a" and not s.stopped  # N held back
    assert s.flush() == "Nb" and not s.stopped  # no stop at N alone


async def test_wait_idle_checks_its_timeout_and_raises_a_typed_timeout() -> None:
    """wait_idle(nan) waited without bound, wait_idle("1") was a TypeError, and a wait that
    ran out was a bare TimeoutError; now InvalidInputError / InvalidTypeError at the call and
    StoreTimeoutError (still a TimeoutError) when it runs out."""
    import asyncio

    from tierkv.errors import InvalidInputError, InvalidTypeError, StoreTimeoutError
    from tierkv.serving import Engine, EngineConfig, TinyModel

    config = EngineConfig(max_running=2, page_tokens=4, max_context=64, device_bytes=1 << 16)
    async with Engine(TinyModel(), config) as engine:
        for bad in (float("nan"), -1, 0, float("inf")):
            with pytest.raises(InvalidInputError):
                await engine.wait_idle(bad)
        with pytest.raises(InvalidTypeError):
            await engine.wait_idle("1")  # type: ignore[arg-type]
        await engine.wait_idle(1.0)  # idle: at once
        agen = engine.generate(list(range(1, 20)), SamplingParams(40))
        first = await agen.__anext__()  # running now
        assert first.token is not None
        with pytest.raises(StoreTimeoutError, match="not idle") as info:
            await engine.wait_idle(1e-3)
        assert isinstance(info.value, TimeoutError)
        await agen.aclose()
        await asyncio.wait_for(engine.wait_idle(10.0), 20)


def test_an_engine_of_wrong_objects_is_a_type_error() -> None:
    """Engine("model") and Engine(model, {"max_running": 2}) were AttributeErrors from inside."""
    from tierkv.errors import InvalidTypeError
    from tierkv.serving import Engine, EngineConfig, TinyModel

    with pytest.raises(InvalidTypeError, match="ServingModel"):
        Engine("model", EngineConfig())  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="EngineConfig"):
        Engine(TinyModel(), {"max_running": 2})  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="KVStore"):
        Engine(TinyModel(), store="store")  # type: ignore[arg-type]
