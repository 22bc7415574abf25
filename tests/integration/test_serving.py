"""The serving engine on the tiny model: continuous batching gives the tokens of sequential runs,
requests join and leave between steps, cancellation frees pages, admission and lease
backpressure wait instead of failing, a shared prefix is reused."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
import torch

from tierkv import KVStore, SequenceError
from tierkv.demo.model import ModelConfig
from tierkv.serving import Engine, EngineConfig, RequestError, SamplingParams, TinyModel
from tierkv.serving.model import Mask

MODEL = ModelConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=128, seed=3)
PAGE = 8


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; oversubscribed threads only slow it down
    yield
    torch.set_num_threads(n)


def engine(**kw: object) -> Engine:
    cfg = EngineConfig(**{"page_tokens": PAGE, "max_context": 256, **kw})  # type: ignore[arg-type]
    return Engine(TinyModel(MODEL), cfg)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(MODEL.vocab) for _ in range(rnd.randrange(lo, hi))] for _ in range(n)]


async def sequential(ps: list[list[int]], params: SamplingParams) -> list[list[int]]:
    out = []
    async with engine(max_running=1, max_batch_tokens=512) as e:
        for p in ps:
            out.append((await e.complete(p, params))[0])
    return out


async def test_batched_continuous_decoding_matches_sequential() -> None:
    ps = prompts(8)
    params = SamplingParams(max_tokens=10)
    want = await sequential(ps, params)
    # small steps: prompts are prefilled in chunks batched with the others' decode tokens
    async with engine(max_running=6, max_batch_tokens=24) as e:
        got = await asyncio.gather(*(e.complete(p, params) for p in ps))
        c = e.counters
        assert c.peak_running == 6 and c.finished == 8
        assert c.steps < sum(len(p) for p in ps) // 24 + 8 * 10  # rows were batched
        assert e.store.stats()["background_errors"] == 0
    assert [g[0] for g in got] == want
    assert all(reason == "length" for _, reason in got)


async def test_requests_join_and_leave_between_steps() -> None:
    ps = prompts(4, seed=1)
    lengths = [3, 12, 6, 9]
    want = [(await sequential([p], SamplingParams(max_tokens=n)))[0] for p, n in zip(ps, lengths)]
    async with engine(max_running=4) as e:
        first = asyncio.create_task(e.complete(ps[1], SamplingParams(max_tokens=12)))
        seen: list[int] = []
        async for _ in e.generate(ps[0], SamplingParams(max_tokens=3)):
            seen.append(e.running)
        # the short request left while the long one goes on; two more join mid-flight
        late = [
            asyncio.create_task(e.complete(p, SamplingParams(max_tokens=n)))
            for p, n in zip(ps[2:], lengths[2:])
        ]
        got = [(await t)[0] for t in (first, *late)]
        assert max(seen) == 2
        await e.wait_idle()
        assert e.running == 0 and e.counters.peak_running >= 2
    assert got == [want[1], want[2], want[3]]


async def test_a_stop_id_ends_the_request_without_emitting_it() -> None:
    p = prompts(1, seed=2)[0]
    (full,) = await sequential([p], SamplingParams(max_tokens=8))
    async with engine() as e:
        tokens, reason = await e.complete(
            p, SamplingParams(max_tokens=8, stop_ids=frozenset({full[3]}))
        )
    assert reason == "stop" and tokens == full[: full.index(full[3])]


async def test_cancellation_frees_the_request_pages() -> None:
    async with engine(max_running=1) as e:
        store = e.store
        agen = e.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=50))
        n = 0
        async for _ in agen:  # 5 + 2 tokens: less than a page, so every page is private
            n += 1
            if n == 2:
                break
        await agen.aclose()
        # one waiting behind another, cancelled before it was admitted
        running = asyncio.create_task(e.complete([7] * 3, SamplingParams(max_tokens=4)))
        waiting = asyncio.create_task(e.complete([9] * 3, SamplingParams(max_tokens=4)))
        for _ in range(1000):  # until the loop has queued it
            if e.waiting:
                break
            await asyncio.sleep(0)
        waiting.cancel()
        await running
        assert waiting.cancelled()
        await e.wait_idle()
        assert e.counters.cancelled == 2
        await store.drain()  # background write-backs and prefetches
        tiers = store.tiers
        assert not tiers.ownership.owners  # no page is held by a sequence any more
        # what stays is the cache of full blocks (content pages), none pinned; private ones went
        left = list(tiers.table.keys("device")) + list(tiers.table.keys("host"))
        assert all(tiers.table.pins(k, "device") == 0 for k in tiers.table.keys("device"))
        assert len(left) <= 2 * (5 + 50) // PAGE * MODEL.layers
        for sid in ("r0", "r1", "r2"):
            with pytest.raises(SequenceError):
                store.sequence(sid)


async def test_prefix_is_computed_once_and_reused() -> None:
    rnd = random.Random(4)
    system = [rnd.randrange(MODEL.vocab) for _ in range(5 * PAGE)]
    users = [[rnd.randrange(MODEL.vocab) for _ in range(5)] for _ in range(3)]
    params = SamplingParams(max_tokens=6)
    want = await sequential([system + u for u in users], params)
    async with engine() as e:
        first = [ev async for ev in e.generate(system + users[0], params)]
        assert first[0].cached_tokens == 0
        rest = []
        for u in users[1:]:
            rest.append([ev async for ev in e.generate(system + u, params)])
        assert all(evs[0].cached_tokens == 5 * PAGE for evs in rest)
        assert e.counters.prefix_tokens_reused == 2 * 5 * PAGE
        got = [[ev.token for ev in evs] for evs in [first, *rest]]
    assert got == want
    async with engine(prefix_reuse=False) as e:
        for u in users:
            evs = [ev async for ev in e.generate(system + u, params)]
            assert evs[0].cached_tokens == 0
        assert e.counters.prefix_tokens_reused == 0


async def test_admission_waits_for_room_on_the_device() -> None:
    # the device holds two layers' pages of one request at a time: the others wait their turn
    spec = TinyModel(MODEL).kv_spec(PAGE)
    ps = prompts(3, seed=5, lo=40, hi=41)
    params = SamplingParams(max_tokens=8)
    want = await sequential(ps, params)
    async with engine(max_running=3, device_bytes=12 * spec.page_bytes) as e:
        assert e.scheduler.layer_pages == 6
        got = await asyncio.gather(*(e.complete(p, params) for p in ps))
        assert e.counters.peak_running == 1
    assert [g[0] for g in got] == want


async def test_a_step_waits_for_lease_backpressure_on_a_shared_store() -> None:
    model = TinyModel(MODEL)
    spec = model.kv_spec(PAGE)
    params = SamplingParams(max_tokens=4)
    p = prompts(1, seed=6, lo=20, hi=21)[0]
    (want,) = await sequential([p], params)
    async with KVStore(
        spec, device_bytes=24 * spec.page_bytes, host_bytes=256 * spec.page_bytes, codec=None
    ) as store:
        # another user of the store pins 22 of the 24 device pages
        await store.add_sequence("other", list(range(88)))
        k = torch.zeros(MODEL.kv_heads, 88, MODEL.head_dim, dtype=spec.dtype)
        async with Engine(model, EngineConfig(page_tokens=PAGE, max_context=64), store=store) as e:
            lease = store.lease(["other"], [0, 1])
            await lease.__aenter__()
            for layer in (0, 1):
                await lease.append("other", layer, k, k)
            task = asyncio.create_task(e.complete(p, params))
            t0 = time.perf_counter()
            while store.admission.waiting == 0:  # the engine's lease waits its turn
                await asyncio.sleep(0.01)
                assert time.perf_counter() - t0 < 10 and not task.done()
            assert not task.done()
            await lease.__aexit__(None, None, None)
            tokens, _ = await task
        await store.release("other")
    assert tokens == want


async def test_oversized_requests_are_refused_and_the_device_defaults_to_half() -> None:
    async with engine(max_running=4) as e:
        spec = e.spec
        assert e.device_bytes == 4 * spec.bytes_for(256) // 2
        with pytest.raises(RequestError, match="context"):
            await e.complete([1] * 250, SamplingParams(max_tokens=10))
        with pytest.raises(RequestError, match="empty"):
            await e.complete([], SamplingParams())
        with pytest.raises(RequestError, match="token ids"):
            await e.complete([MODEL.vocab], SamplingParams())
        assert (await e.complete([1, 2], SamplingParams(max_tokens=2)))[1] == "length"


async def test_sampling_with_a_seed_repeats() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
    async with engine() as e:
        a = await e.complete([5, 6, 7], params)
        b = await e.complete([5, 6, 7], params)
    assert a == b


async def test_close_aborts_requests_in_flight() -> None:
    e = await engine(max_running=1).open()
    agen = e.generate([1, 2, 3], SamplingParams(max_tokens=100))
    await agen.__anext__()
    await e.close()
    reasons = [ev.finish_reason async for ev in agen]
    assert reasons[-1] == "abort"


class FlakyModel(TinyModel):
    """Fails one forward (as a store error inside a step would)."""

    fail_next = False

    def finish(self, layer: int, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return super().finish(layer, x, att)


async def test_a_failed_step_fails_its_requests_and_the_engine_goes_on() -> None:
    model = FlakyModel(MODEL)
    async with Engine(model, EngineConfig(page_tokens=PAGE, max_context=128)) as e:
        model.fail_next = True
        with pytest.raises(RuntimeError, match="boom"):
            await e.complete([1, 2, 3], SamplingParams(max_tokens=4))
        await e.wait_idle()
        assert e.counters.failed == 1
        assert not e.store.tiers.ownership.owners  # its pages were released
        tokens, reason = await e.complete([1, 2, 3], SamplingParams(max_tokens=4))
        assert len(tokens) == 4 and reason == "length"


async def test_requests_arriving_together_compute_a_shared_prompt_once() -> None:
    rnd = random.Random(7)
    system = [rnd.randrange(MODEL.vocab) for _ in range(5 * PAGE)]
    ps = [system + [rnd.randrange(MODEL.vocab) for _ in range(5)] for _ in range(4)]
    other = prompts(1, seed=8, lo=30, hi=31)[0]  # shares nothing: runs beside the first
    params = SamplingParams(max_tokens=5)
    want = await sequential([*ps, other], params)
    async with engine(max_running=8) as e:

        async def run(p: list[int]) -> tuple[int, list[int]]:
            evs = [ev async for ev in e.generate(p, params)]
            return evs[0].cached_tokens, [ev.token for ev in evs if ev.token is not None]

        got = await asyncio.gather(*(run(p) for p in [*ps, other]))
        assert [c for c, _ in got] == [0, 5 * PAGE, 5 * PAGE, 5 * PAGE, 0]
        assert e.counters.peak_running >= 2
    assert [t for _, t in got] == want


async def test_sparse_topk_covering_every_page_gives_the_dense_tokens() -> None:
    ps = prompts(4, seed=5, lo=20, hi=60)
    params = SamplingParams(max_tokens=8)
    async with engine(max_running=4) as e:
        want = await asyncio.gather(*(e.complete(p, params) for p in ps))
    async with engine(max_running=4, sparse_topk=32) as e:  # 256 / 8 = 32 pages: all
        got = await asyncio.gather(*(e.complete(p, params) for p in ps))
        assert e.sparse is not None
        sp = e.sparse.counters.as_dict()
        assert sp["decode_attends"] == 4 * 7 * MODEL.layers and sp["decode_page_share"] == 1.0
        assert e.sparse.summaries is e.store.summaries  # the store's table, by page key
    assert [g[0] for g in got] == [w[0] for w in want]


async def test_a_small_sparse_topk_attends_fewer_pages() -> None:
    ps = prompts(2, seed=6, lo=120, hi=160)  # 15-20 pages of 8 tokens
    async with engine(max_running=2, sparse_topk=2, sparse_recent=1) as e:
        got = await asyncio.gather(*(e.complete(p, SamplingParams(max_tokens=6)) for p in ps))
        assert e.sparse is not None
        share = e.sparse.counters.as_dict()["decode_page_share"]
    assert all(len(g[0]) == 6 for g in got)
    assert share < 0.3  # 4 pages (first, 2 chosen, last) of 15-21


def test_bad_sparse_options_are_typed_errors_at_entry() -> None:
    from tierkv.errors import InvalidInputError, InvalidTypeError

    for kw in (
        {"sparse_topk": 0},
        {"sparse_topk": 33},
        {"sparse_topk": 4, "sparse_recent": -1},
        {"sparse_topk": 4, "sparse_mean_weight": 1.0},
        {"sparse_topk": 4, "sparse_mean_weight": -0.1},
        {"sparse_topk": 4, "sparse_mean_weight": float("nan")},
        {"sparse_topk": 4, "sparse_mean_weight": 10**400},  # (was float()'s OverflowError)
    ):
        with pytest.raises(InvalidInputError):
            engine(**kw)
    with pytest.raises(InvalidTypeError):
        engine(sparse_topk=4, sparse_mean_weight="0.5")


async def test_sparse_mean_weight_scores_the_engine_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's decode rows score pages with the configured mean weight (the store's
    summaries keep each page's mean key), and a k covering every page stays dense-exact."""
    import tierkv.serving.sparse as serving_sparse

    weights: list[float] = []
    real = serving_sparse.page_scores

    def spy(q: torch.Tensor, table: torch.Tensor, scale: float, w: float = 0.0) -> torch.Tensor:
        weights.append(w)
        return real(q, table, scale, w)

    monkeypatch.setattr(serving_sparse, "page_scores", spy)
    ps = prompts(3, seed=5, lo=20, hi=60)
    params = SamplingParams(max_tokens=6)
    async with engine(max_running=3) as e:
        want = await asyncio.gather(*(e.complete(p, params) for p in ps))
    async with engine(max_running=3, sparse_topk=32, sparse_mean_weight=0.5) as e:
        got = await asyncio.gather(*(e.complete(p, params) for p in ps))
    assert weights and set(weights) == {0.5}
    assert [g[0] for g in got] == [w[0] for w in want]
    weights.clear()
    async with engine(max_running=2, sparse_topk=2, sparse_recent=1, sparse_mean_weight=0.5) as e:
        ps = prompts(2, seed=6, lo=120, hi=160)
        got = await asyncio.gather(*(e.complete(p, SamplingParams(max_tokens=4)) for p in ps))
        assert e.sparse is not None
        assert e.sparse.counters.as_dict()["decode_page_share"] < 0.3
    assert set(weights) == {0.5} and all(len(g[0]) == 4 for g in got)


class Recording(TinyModel):
    """The tiny model, recording every step's logits."""

    def __init__(self, kv_dtype: str) -> None:
        super().__init__(MODEL, kv_dtype)
        self.seen: list[torch.Tensor] = []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = super().logits(x)
        self.seen.append(out)
        return out


class PerRequestModel(Recording):
    """The engine's attention before the padded gather: each decode row on its own, over its
    sequence's K/V unpadded (``causal_attention``)."""

    def attend_decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
    ) -> torch.Tensor:
        lengths = [k.shape[2]] * len(q) if mask is None else mask.sum(1).tolist()
        return torch.cat(
            [
                self.attend(layer, q[b][:, None], k[b, :, :s], v[b, :, :s], s - 1)
                for b, s in enumerate(lengths)
            ]
        )


@pytest.mark.parametrize(("kv_dtype", "tol"), [("fp32", 1e-6), ("fp16", 1e-5)])
async def test_batched_decode_attention_gives_the_per_request_logits(
    kv_dtype: str, tol: float
) -> None:
    # one gather and one attention call for the decode rows against one call per request
    # over its own K/V: the same tokens; logits within 1e-6 of their scale with fp32 K/V
    # (fp16 K/V: a ~3e-7 difference in attention can round a later token's K to the next
    # fp16 value, so 1e-5); ragged lengths, prompt chunks in the same steps
    ps = prompts(6, seed=5)
    params = SamplingParams(max_tokens=12)
    out = []
    for model in (PerRequestModel(kv_dtype), Recording(kv_dtype)):
        cfg = EngineConfig(page_tokens=PAGE, max_context=256, max_running=6, max_batch_tokens=20)
        async with Engine(model, cfg) as e:
            got = await asyncio.gather(*(e.complete(p, params) for p in ps))
        out.append(([g[0] for g in got], model.seen))
    (want_tokens, want_logits), (got_tokens, got_logits) = out
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits) > 12
    for a, b in zip(got_logits, want_logits):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


async def test_a_prompt_that_is_not_token_ids_is_a_type_error_and_nothing_runs() -> None:
    """A careless caller's prompt: a str, None, a generator, a nested list were TypeErrors
    from inside ``check`` (``'<=' not supported``), bytes and a dict ran as ids (their bytes,
    their keys). Now InvalidTypeError / SpecError at entry; an array or tensor of ids still
    runs, as the same ids."""
    import numpy as np

    from tierkv.errors import InvalidInputError, InvalidTypeError

    async with engine() as e:
        params = SamplingParams(max_tokens=2)
        for bad in ("hello", None, b"ab", {1: 2}, (t for t in [1, 2]), [[1, 2]], [1.5, 2.0]):
            with pytest.raises(InvalidInputError):
                await e.complete(bad, params)  # type: ignore[arg-type]
        with pytest.raises(InvalidTypeError):
            await e.complete([1, 2], {"max_tokens": 2})  # type: ignore[arg-type]
        assert e.counters.requests == 0 and e.running == 0
        e.store.check()
        want = await e.complete([1, 2, 3], params)
        assert await e.complete(np.array([1, 2, 3]), params) == want
        assert await e.complete(torch.tensor([1, 2, 3]), params) == want


@pytest.mark.parametrize(
    "kw",
    [
        {"max_running": "8"},  # a TypeError of the comparison
        {"max_running": 2.5},  # taken
        {"max_context": "9"},
        {"prefix_reuse": "no"},  # taken: a non-empty str is true
        {"timeout": "x"},  # found out when the engine opened
        {"timeout": -1},
        {"device_bytes": 1.5},
        {"page_tokens": True},
        {"sparse_topk": "4"},
        {"sparse_recent": -1},
        {"codec": "bogus"},
        {"max_waiting": 0},
    ],
)
def test_engine_config_checks_its_types_at_construction(kw: dict[str, object]) -> None:
    from tierkv.errors import InvalidInputError, UnknownNameError

    with pytest.raises((InvalidInputError, UnknownNameError)):  # (codec: UnknownCodecError)
        EngineConfig(**kw)  # type: ignore[arg-type]


async def test_a_flood_of_requests_is_refused_past_max_waiting() -> None:
    """The waiting queue was unbounded: a client flooding the server grew it (and the O(n)
    scans of it) without end. Past ``max_waiting`` a request is refused at once with
    EngineBusyError (a 503), counted; the queued ones run, the store is left consistent."""
    from tierkv.serving import EngineBusyError, http_status

    async with engine(max_running=1, max_waiting=2) as e:
        params = SamplingParams(max_tokens=4)
        tasks = [asyncio.create_task(e.complete([1, 2, i], params)) for i in range(6)]
        got = await asyncio.gather(*tasks, return_exceptions=True)
        busy = [g for g in got if isinstance(g, EngineBusyError)]
        done = [g for g in got if isinstance(g, tuple)]
        assert len(done) + len(busy) == 6 and len(done) >= 2 and busy
        assert all(http_status(b) == 503 for b in busy)
        assert e.stats()["refused_busy"] == len(busy) and e.waiting == 0
        e.store.check()
        assert len((await e.complete([1, 2, 3], params))[0]) == 4  # it serves on


async def test_other_tasks_get_turns_between_steps_that_never_await() -> None:
    """All pages resident, a step never awaits: the engine then gives the loop's other tasks
    (a server's handlers: read, parse, write) turns between steps until the loop is quiet.
    With one turn per step (before), a task needing several turns advanced one stage per
    step: tokens reached clients late and in bursts (the all-resident server's time to first
    token in benchmarks/serve.py grew from 2.9 s to 5.3 s)."""
    model = TinyModel(MODEL)
    cfg = EngineConfig(max_running=4, max_context=96, device_bytes=1 << 24)
    stages: list[int] = []
    steps: list[int] = []
    done = asyncio.Event()

    async def handler() -> None:  # a chain of small stages, each a loop turn apart
        while not done.is_set():
            stages.append(len(steps))
            await asyncio.sleep(0)

    async with Engine(model, cfg) as eng:
        orig = eng._step

        async def counted(step: list) -> None:  # type: ignore[type-arg]
            await orig(step)
            steps.append(1)

        eng._step = counted  # type: ignore[method-assign]
        task = asyncio.ensure_future(handler())
        async for _ in eng.generate(list(range(1, 40)), SamplingParams(max_tokens=12)):
            pass
        done.set()
        await task
    per_step = [stages.count(i) for i in range(1, len(steps))]
    assert len(steps) >= 10
    assert min(per_step) >= 3, per_step  # several stages between any two steps (was 1)
    assert eng.counters.decode_tokens == 11  # tokens after the first, timed by the engine
    assert eng.counters.decode_seconds > 0
