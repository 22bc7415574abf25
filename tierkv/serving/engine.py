"""The serving engine: requests are asyncio tasks, one loop runs one forward per step for all
running requests, and each request's K/V lives in a :class:`~tierkv.KVStore`.

::

    engine = Engine(TinyModel(), EngineConfig(max_running=8))
    async with engine:
        async for ev in engine.generate(prompt_ids, SamplingParams(max_tokens=16)):
            print(ev.token, ev.finish_reason)

A step (see :mod:`tierkv.serving.scheduler` for what runs in it)::

    admit waiting requests   store.add_sequence(id, prompt) -> cached prompt tokens (skipped)
    store.schedule([step ids, next ids])       pages of the coming steps prefetched
    store.step_plan(step ids, tokens=counts)   the step planned once (tierkv.step): layers load
    for each layer:                            in groups, the next group while this one computes
        q, k, v of all rows at once; one append of every request's k, v (index_copy_), one
        gather of their K/V padded to the longest (index_select into the engine's buffer),
        one batched attention call for the decode rows (masked to each request's length),
        one call per prompt chunk over its views
    sample the requests whose prompt is complete; store.add_tokens; store.step()
    release finished and cancelled requests   full blocks stay cached for later prompts

The device tier only needs a few layers' pages of the step at a time, so it can be much smaller
than the live KV (by default half of ``max_running`` full contexts); the host tier holds the
rest. When the store is shared and the device is pinned full, a lease waits its turn (the
store's backpressure) and the step with it; nothing fails.

Errors (all tierkv errors, drawn in :mod:`tierkv.serving.errors`): :class:`RequestError` (an
``InvalidInputError``, so a ``ValueError``) for a request that can never run (empty, longer than
the context, larger than the device tier); the tierkv errors of a failed step are raised from
:meth:`Engine.generate` of each request in that step.

The file stays whole (over 400 lines): admission, the step loop and a request's ending (release,
publish, cancellation) change one set of running requests, and each must see the others' rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierkv import validate
from tierkv.arguments import checked_init
from tierkv.codecs import CODECS
from tierkv.errors import (
    InvalidInputError,
    InvalidTypeError,
    QuotaExceededError,
    StoreTimeoutError,
)
from tierkv.failures import FailureLog
from tierkv.serving.errors import (
    ContextLengthError,
    EngineBusyError,
    EngineNotOpenError,
    RequestError,
)
from tierkv.serving.model import ServingModel
from tierkv.serving.request import Request, TokenEvent
from tierkv.serving.sampling import Sampler, SamplingParams
from tierkv.serving.scheduler import Scheduler
from tierkv.serving.sparse import ServingSparse
from tierkv.store import KVStore
from tierkv.tenant_names import check_salt
from tierkv.tenants import Quota, tenant_index

Row = tuple[Request, int, int, int]
"""A request's rows in a step: the request, its first row, its end row, its tokens before."""


@dataclass
class _Layers:
    """A step's progress through the layers: the hidden states entering layer ``next``, their
    positions, and the requests' rows (fewer after a tenant's refusal)."""

    x: torch.Tensor
    pos: torch.Tensor
    rows: list[Row]
    next: int = 0


@checked_init
@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built with.

    Args:
        max_running: requests decoding together at most (the configured concurrency).
        max_batch_tokens: tokens in one forward at most (decode tokens plus prefill chunks).
        max_context: prompt + max_tokens of one request at most (None: the model's, capped at
            2,048).
        page_tokens: tokens per KV page.
        device_bytes: device tier (None: half the KV of ``max_running`` full contexts).
        host_bytes: host tier (None: twice the KV of ``max_running`` full contexts).
        prefix_reuse: load the cached KV of a prompt's prefix instead of computing it.
        prefetch: load the step's next layers while a layer computes (tierkv.step).
        codec: the store's cold-pool codec (None: none; a lossy one changes warm outputs).
        timeout: the store's bound on every wait, in seconds.
        tenants: the store's tenants and their quotas (``KVStore(tenants=)``); requests name
            theirs with ``generate(..., tenant=)``.
        sparse_topk: a decode row attends its first page, the ``sparse_recent`` last and
            this many chosen by per-page key summaries (Quest; :mod:`tierkv.serving.sparse`);
            None: every page.
        sparse_recent: the last pages always attended with ``sparse_topk``.
        sparse_mean_weight: with ``sparse_topk``, the weight in ``[0, 1)`` of a page's mean
            key in its score (``(1 - w) * bound + w * q . mean``); 0: Quest's bound alone
            (docs/attention.md measures 0.5 on SmolLM2).
        max_waiting: requests waiting to be admitted at most; a request beyond it is refused
            at once with :class:`~tierkv.serving.errors.EngineBusyError` (a 503), so a flood
            of requests cannot grow the queue without bound.

    Raises InvalidTypeError for a field of the wrong type (a str count, a float size, a
    non-bool flag), InvalidInputError (a ValueError) for a count below 1, a negative size,
    a timeout that is not finite seconds > 0 or a ``sparse_mean_weight`` outside ``[0, 1)``;
    :class:`Engine` for a ``sparse_topk`` above a request's pages.
    """

    max_running: int = 8
    max_batch_tokens: int = 512
    max_context: int | None = None
    page_tokens: int = 16
    device_bytes: int | None = None
    host_bytes: int | None = None
    prefix_reuse: bool = True
    prefetch: bool = True
    codec: str | None = None
    timeout: float = 60.0
    tenants: Mapping[str, Quota] | None = None
    sparse_topk: int | None = None
    sparse_recent: int = 2
    sparse_mean_weight: float = 0.0
    max_waiting: int = 4096

    def __post_init__(self) -> None:
        # types too (a str count was a TypeError of the comparison, max_running=2.5 and
        # prefix_reuse="no" were taken, a bad timeout found out at open)
        for name in ("max_running", "max_batch_tokens", "page_tokens", "max_waiting"):
            validate.count(name, getattr(self, name), 1)
        if self.max_context is not None:
            validate.count("max_context", self.max_context, 2)
        for name in ("device_bytes", "host_bytes"):
            if getattr(self, name) is not None:
                validate.count(name, getattr(self, name), 0)
        validate.flag("prefix_reuse", self.prefix_reuse)
        validate.flag("prefetch", self.prefetch)
        validate.seconds("timeout", self.timeout)
        if isinstance(self.codec, str):  # (UnknownCodecError now, not when the engine opens)
            CODECS.factory(self.codec)
        if self.sparse_topk is not None:
            validate.count("sparse_topk", self.sparse_topk, 1)
        validate.count("sparse_recent", self.sparse_recent, 0)
        validate.fraction("sparse_mean_weight", self.sparse_mean_weight)


YIELD_TURNS = 64
"""Loop turns the engine gives other tasks between two steps at most."""
YIELD_SECONDS = 0.005
"""Seconds the engine gives other tasks between two steps at most."""
QUIET_TURN_SECONDS = 10e-6
"""A loop turn shorter than this ran nothing else (a bare turn costs ~2 us on a 2-core VM)."""


@dataclass
class EngineCounters:
    """Totals since the engine opened."""

    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    prefix_tokens_reused: int = 0
    generated_tokens: int = 0
    steps: int = 0
    step_tokens: int = 0
    step_seconds: float = 0.0
    peak_running: int = 0
    peak_live_kv_bytes: int = 0
    refused_busy: int = 0  # requests refused: max_waiting were waiting
    # tokens after each request's first, and the seconds since that request's previous token:
    # decode_seconds / decode_tokens is the time per output token as the engine emits them
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    last_error: str = ""


@checked_init
class Engine:
    """Continuous batching of requests over one model and one KV store.

    Args:
        model: a :class:`~tierkv.serving.model.ServingModel`.
        config: an :class:`EngineConfig` (defaults when None).
        store: a store to share (opened and closed by its owner); by default the engine opens
            its own from ``config``.

    Raises InvalidInputError (a ValueError) for a bad config (or a store whose spec is not the
    model's).
    """

    def __init__(
        self,
        model: ServingModel,
        config: EngineConfig | None = None,
        *,
        store: KVStore | None = None,
    ) -> None:
        if config is not None and not isinstance(config, EngineConfig):
            raise InvalidTypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        missing = [a for a in ("max_context", "kv_spec", "num_layers") if not hasattr(model, a)]
        if missing:  # (an AttributeError from inside before)
            raise InvalidTypeError(
                f"model must be a ServingModel (tierkv.serving.load_model), got "
                f"{type(model).__name__} without {', '.join(missing)}"
            )
        if store is not None and not isinstance(store, KVStore):
            raise InvalidTypeError(f"store must be a KVStore, got {type(store).__name__}")
        cfg = config or EngineConfig()
        self.model = model
        self.config = cfg
        self.max_context = min(cfg.max_context or min(model.max_context, 2048), model.max_context)
        self.spec = model.kv_spec(cfg.page_tokens)
        if store is not None and store.spec != self.spec:
            raise InvalidInputError(f"the store's spec {store.spec} is not the model's {self.spec}")
        full = cfg.max_running * self.spec.bytes_for(self.max_context)  # every slot full
        self.device_bytes = cfg.device_bytes if cfg.device_bytes is not None else full // 2
        self.host_bytes = cfg.host_bytes if cfg.host_bytes is not None else 2 * full
        self._own_store = store is None
        self.store = store or KVStore(
            self.spec,
            device_bytes=self.device_bytes,
            host_bytes=self.host_bytes,
            codec=cfg.codec,
            timeout=cfg.timeout,
            tenants=cfg.tenants,
        )
        if store is None:
            device_pages = self.device_bytes // self.spec.page_bytes
        else:  # a shared store must be open: its device tier is what it holds
            device_pages = store.tiers.table.capacity("device")
            self.device_bytes = device_pages * self.spec.page_bytes
            self.host_bytes = store.tiers.table.capacity("host") * self.spec.page_bytes
        # one layer leased, the next being prefetched: each gets half the device
        self.scheduler = Scheduler(
            cfg.max_running,
            cfg.max_batch_tokens,
            max(1, device_pages // 2),
            cfg.page_tokens,
            share_prefill=cfg.prefix_reuse,
        )
        self._announced: list[str] = []
        self._kv_buf: torch.Tensor | None = None  # the step's K/V gathers (_buffer)
        self.counters = EngineCounters()
        self.sparse = (  # top-k pages at decode (None: off)
            None
            if cfg.sparse_topk is None
            else ServingSparse(
                self.store,
                self.spec,
                cfg.sparse_topk,
                cfg.sparse_recent,
                -(-self.max_context // cfg.page_tokens),
                cfg.sparse_mean_weight,
            )
        )
        self._failures = FailureLog("tierkv.serving")
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- life cycle ----------------------------------------------------------------------
    async def open(self) -> Engine:
        """Open the store (when the engine owns it) and start the step loop. Returns self.

        Raises EngineNotOpenError on an engine that was closed (an engine opens once: make a
        new one)."""
        if self._closed:
            raise EngineNotOpenError("the engine was closed: an engine opens once, make a new one")
        if self._task is None:
            if self._own_store:
                await self.store.open()
            self._task = asyncio.create_task(self._loop(), name="tierkv-serving-loop")
        return self

    async def close(self) -> None:
        """Stop the loop; requests still waiting or running end with ``"abort"``."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:  # bounded: a step stuck past cancelling is left behind
            self._task.cancel()
            await asyncio.wait([self._task], timeout=self.store.timeout)
            if self._task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    self._task.result()
        sched = self.scheduler
        for req in [*sched.running, *sched.waiting]:
            self._finish(req, "abort")
            sched.remove(req)
            await self._release(req)
        if self._own_store:
            await self.store.close()

    async def __aenter__(self) -> Engine:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- requests ------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise :class:`RequestError` when this request can never run here, InvalidTypeError
        when ``prompt`` is not token ids (a str, None, a nested list) or ``params`` not a
        SamplingParams."""
        prompt = validate.token_ids(prompt, "prompt")
        if not isinstance(params, SamplingParams):
            raise InvalidTypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        n = len(prompt)
        if n == 0:
            raise RequestError("the prompt is empty")
        if any(not 0 <= t < self.model.vocab_size for t in prompt):
            raise RequestError(f"token ids must be in [0, {self.model.vocab_size})")
        if n + params.max_tokens > self.max_context:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_context} tokens"
            )
        need = -(-(n + params.max_tokens) // self.spec.page_tokens)
        if need > self.scheduler.layer_pages:
            raise ContextLengthError(
                f"prompt + max_tokens need {need} pages per layer, the device tier allows "
                f"{self.scheduler.layer_pages}"
            )

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        salt: str | bytes | None = None,
        tenant: str | None = None,
    ) -> AsyncGenerator[TokenEvent, None]:
        """Generate from token ids: yields one :class:`TokenEvent` per token, the last with its
        finish reason. Leaving the loop early (``break``, cancellation) ends the request and
        frees its pages at the next step boundary. ``salt``: the request's cache salt (its
        prompt reuses and shares cached pages only with requests of the same salt);
        ``tenant``: one of the store's tenants, charged for the request's pages (its quotas
        apply: no room within them fails the request with QuotaExceededError).

        Raises RequestError (see :meth:`check`), TenantError (a bad salt or tenant name),
        UnknownTenantError, EngineBusyError (``max_waiting`` requests wait already),
        EngineNotOpenError before open or after close, StoreClosedError
        when the store closes under it, and the tierkv error of a step that failed.
        """
        params = params or SamplingParams()
        raw = check_salt(salt)
        tenant_index(self.store.tenants, tenant)
        if self._closed or self._task is None:
            raise EngineNotOpenError("the engine is not open")
        ids = validate.token_ids(prompt, "prompt")
        self.check(ids, params)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            self.counters.refused_busy += 1
            raise EngineBusyError(
                f"{self.config.max_waiting} requests are waiting already (max_waiting): "
                "try again later"
            )
        req = Request(
            f"r{next(self._ids)}",
            ids,
            params,
            Sampler(params),
            salt=raw,
            tenant=tenant,
        )
        self.counters.requests += 1
        self.scheduler.add(req)
        self._idle.clear()
        self._wake.set()
        try:
            while True:
                ev = await req.events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            if req.finished is None:  # left early: the loop frees it between steps
                req.cancelled = True
                self._wake.set()

    async def complete(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        *,
        salt: str | bytes | None = None,
        tenant: str | None = None,
    ) -> tuple[list[int], str]:
        """All generated tokens and the finish reason (see :meth:`generate`)."""
        out: list[int] = []
        reason = "length"
        async for ev in self.generate(prompt, params, salt=salt, tenant=tenant):
            if ev.token is not None:
                out.append(ev.token)
            if ev.finish_reason is not None:
                reason = ev.finish_reason
        return out, reason

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request is waiting or running. Raises StoreTimeoutError (a
        TimeoutError) when ``timeout`` runs out, InvalidTypeError / InvalidInputError for a
        timeout that is not finite seconds > 0 (a NaN was a wait without bound, a str a
        TypeError)."""
        limit = validate.seconds("timeout", timeout)
        try:
            async with asyncio.timeout(limit):
                await self._idle.wait()
        except TimeoutError:
            if self._idle.is_set():  # (set as the deadline struck)
                return
            raise StoreTimeoutError(
                f"the engine was not idle within {limit:g} s ({self.running} running, "
                f"{self.waiting} waiting)"
            ) from None

    @property
    def running(self) -> int:
        """Requests in the running set."""
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        """Requests waiting to be admitted."""
        return len(self.scheduler.waiting)

    def stats(self) -> dict[str, Any]:
        """The engine's counters, its sizes and the store's figures (``store``)."""
        c = self.counters
        return {
            "model": self.model.name,
            "running": self.running,
            "waiting": self.waiting,
            "max_running": self.config.max_running,
            "max_context": self.max_context,
            "prefix_reuse": self.config.prefix_reuse,
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            **{k: getattr(c, k) for k in c.__dataclass_fields__},
            "store": self.store.stats(),
        }

    # -- the loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        sched = self.scheduler
        while True:
            await self._reap()
            for req in sched.admit():
                try:
                    await self._join(req)
                except Exception as exc:  # (the store closed, a bad id): this request fails
                    self._fail(req, exc)
            step = sched.plan()
            if not step:
                if not sched.running and not sched.waiting:
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step(step)
            except Exception as exc:  # the step's requests fail; the loop and the others go on
                for req, _ in step:
                    self._fail(req, exc)
            await self._let_others_run()

    async def _let_others_run(self) -> None:
        """Give the loop's other tasks (the handlers streaming this step's tokens, a server
        accepting and parsing new requests) turns between steps until the loop is quiet: a
        step whose pages are all resident never awaits, so with one turn between steps each
        stage of a handler's work (a socket read, a parse, a write) would wait a whole step
        (tokens delivered late and in bursts, new requests admitted steps late). Two turns
        in a row that find nothing else to run end it; at most :data:`YIELD_TURNS` turns or
        :data:`YIELD_SECONDS`, so that a flood of handlers never stalls the steps."""
        clock = time.perf_counter
        start = quiet = clock()
        calm = 0
        for _ in range(YIELD_TURNS):
            await asyncio.sleep(0)
            now = clock()
            calm = calm + 1 if now - quiet < QUIET_TURN_SECONDS else 0
            if calm >= 2 or now - start > YIELD_SECONDS:
                return
            quiet = now

    def _fail(self, req: Request, exc: Exception) -> None:
        if req.finished is None:
            self.counters.failed += 1
            req.finished = "error"
            req.events.put_nowait(exc)

    async def _join(self, req: Request) -> None:
        store = self.store
        if self.config.prefix_reuse:
            await self._publish_shared(req)
            req.reused = await store.add_sequence(
                req.rid, req.prompt, salt=req.salt, tenant=req.tenant
            )
        else:
            await store.add_sequence(req.rid, [], salt=req.salt, tenant=req.tenant)
            store.add_tokens(req.rid, req.prompt)
        req.in_store = True
        req.computed = req.reused
        req.admitted = time.perf_counter()
        c = self.counters
        c.prompt_tokens += len(req.prompt)
        c.prefix_tokens_reused += req.reused
        c.peak_running = max(c.peak_running, len(self.scheduler.running))

    async def _publish_shared(self, req: Request) -> None:
        # A running request with the same first page may hold full blocks not yet published
        # (a write-back of the last lease was in flight): publish them now, so they are reused.
        t = self.spec.page_tokens
        for r in self.scheduler.running:
            if r is req or not r.in_store or r.prompt[:t] != req.prompt[:t] or r.salt != req.salt:
                continue
            seq = self.store.sequence(r.rid)
            if sum(seq.shared) < seq.length // t:
                await self._drain()
                self.store.publish(seq)

    async def _reap(self) -> None:
        sched = self.scheduler
        for req in [r for r in sched.waiting if r.cancelled]:
            sched.remove(req)
            self.counters.cancelled += 1
        for req in [r for r in sched.running if r.cancelled or r.finished]:
            if req.cancelled and req.finished is None:
                self.counters.cancelled += 1
                req.finished = "cancelled"
            sched.remove(req)
            try:
                await self._release(req)
            except Exception as exc:  # counted and logged; the loop goes on
                self.counters.failed += 1
                self.counters.last_error = self._failures.report("request release", exc)

    async def _release(self, req: Request) -> None:
        if not req.in_store:
            return
        req.in_store = False
        store = self.store
        if store.closed:
            return
        if self.config.prefix_reuse and req.finished in ("length", "stop"):
            seq = store.sequence(req.rid)
            if sum(seq.shared) < seq.length // seq.page_tokens:
                # a full block not yet published: a page in flight (a write-back the last
                # lease started) cannot be renamed, and release would free it uncached
                await self._drain()
        await store.release(req.rid)

    async def _drain(self) -> None:
        """Wait for the store's background copies, bounded by its timeout: a copy hung past
        it is logged (``last_error``), and the caller goes on (a release still frees its
        sequence; the block is then not reused)."""
        try:
            await self.store.drain()
        except StoreTimeoutError as exc:
            self.counters.last_error = self._failures.report("store drain", exc)

    def _finish(self, req: Request, reason: str, token: int | None = None) -> None:
        if req.finished is None:
            req.finished = reason
            req.events.put_nowait(TokenEvent(token, reason, req.reused))

    async def _step(self, step: list[tuple[Request, list[int]]]) -> None:
        t0 = time.perf_counter()
        model, store = self.model, self.store
        ids = [req.rid for req, _ in step]
        if ids != self._announced:  # a request joined or left: announce the coming steps
            self._announced = ids
            later = [r.rid for r in self.scheduler.running if r.rid not in set(ids)]
            store.schedule([ids, ids + later])
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[Row] = []  # request, first row, end row, past
        for req, toks in step:
            past = req.computed if req.prefilling else len(req.prompt) + len(req.output) - 1
            a = len(tokens)
            tokens += toks
            positions += range(past, past + len(toks))
            rows.append((req, a, len(tokens), past))
        self._count_live()
        with torch.inference_mode():
            state = _Layers(model.embed(torch.tensor(tokens)), torch.tensor(positions), rows)
            while state.next < model.num_layers:
                try:
                    await self._layers(state)
                except QuotaExceededError as exc:  # one tenant's refusal: its requests fail,
                    self._refuse(state, exc)  # the others go on from the layer it stopped
            rows, x = state.rows, state.x
            sample = [(req, b - 1) for req, a, b, past in rows if b - a + past >= len(req.prompt)]
            logits = model.logits(x[[r for _, r in sample]]) if sample else None
        now = time.perf_counter()
        for req, a, b, _ in rows:
            if req.prefilling:
                req.computed += b - a
        for i, (req, _) in enumerate(sample):
            assert logits is not None
            self._emit(req, req.sampler(logits[i]), now)
        store.step()
        c = self.counters
        c.steps += 1
        c.step_tokens += sum(b - a for _, a, b, _ in rows)
        c.step_seconds += now - t0

    async def _layers(self, state: _Layers) -> None:
        """Run the step's rows through layers ``state.next`` on, ``state`` following each
        layer done (its hidden states, the next layer), so that a failure leaves it at the
        layer to run again."""
        model, cfg, sp, rows = self.model, self.config, self.sparse, state.rows
        ids = [req.rid for req, _, _, _ in rows]
        counts = [b - a for _, a, b, _ in rows]
        lengths = [past + n for (_, _, _, past), n in zip(rows, counts)]
        # the leading one-token rows (decode: the scheduler puts them first) attend in one
        # batched call, masked to their lengths; top-k pages choose per request instead
        one = 0 if sp is not None else next((i for i, n in enumerate(counts) if n != 1), len(rows))
        s1 = max(lengths[:one], default=0)
        mask = None
        if len(set(lengths[:one])) > 1:
            mask = torch.arange(s1)[None, :] < torch.tensor(lengths[:one])[:, None]
        layers = list(range(state.next, model.num_layers))
        ahead = 2 if cfg.prefetch else 0
        async with self.store.step_plan(ids, layers, tokens=counts, ahead=ahead) as plan:
            buf = self._buffer(plan.flat, len(rows) * max(lengths, default=0))
            for layer in layers:
                x = state.x
                q, k, v = model.qkv(layer, x, state.pos)
                h = plan.layer_now(layer) or await plan.layer(layer)
                h.append(k, v)  # [H, N, D]: the requests' tokens one after another
                kp, vp = h.kv_padded(out=buf)  # one gather of every request's K/V
                parts = []
                if one:
                    qd = q[:, :one].transpose(0, 1)
                    kd, vd = kp[:one, :, :s1], vp[:one, :, :s1]
                    parts.append(model.attend_decode(layer, qd, kd, vd, mask))
                for i in range(one, len(rows)):
                    req, a, b, past = rows[i]
                    kk, vv = kp[i, :, : lengths[i]], vp[i, :, : lengths[i]]
                    if sp is None:
                        parts.append(model.attend(layer, q[:, a:b], kk, vv, past))
                    else:
                        sp.append(req.rid, layer, k[:, a:b], past)
                        parts.append(sp.attend(model, layer, req.rid, q[:, a:b], kk, vv, past))
                state.x = model.finish(layer, x, torch.cat(parts))
                state.next = layer + 1

    def _refuse(self, state: _Layers, exc: QuotaExceededError) -> None:
        """Fail the requests of the tenant ``exc`` refused and drop their rows from
        ``state``; re-raise when that would leave none or names no tenant of the step (then
        the step's requests all fail, as for any other error)."""
        rows = state.rows
        keep = [r for r in rows if r[0].tenant != exc.tenant]
        if exc.tenant is None or not keep or len(keep) == len(rows):
            raise exc
        for req, _, _, _ in rows:
            if req.tenant == exc.tenant:
                self._fail(req, exc)
        index = torch.cat([torch.arange(a, b) for _, a, b, _ in keep])
        state.x, state.pos = state.x[index], state.pos[index]
        state.rows = []
        at = 0
        for req, a, b, past in keep:
            state.rows.append((req, at, at + b - a, past))
            at += b - a

    def _buffer(self, flat: torch.Tensor, tokens: int) -> torch.Tensor:
        """The engine's gather buffer, grown to hold ``tokens`` positions of K and V (padded
        rows of a step's requests): allocated when a step needs more, then reused by every
        layer of every step (a fresh tensor per gather costs its page faults: an
        ``index_select`` of 48 MB took 2.5 times as long into a new tensor)."""
        need = tokens * 2 * self.spec.num_kv_heads * self.spec.head_dim
        buf = self._kv_buf
        if buf is None or buf.numel() < need or buf.device != flat.device:
            buf = self._kv_buf = torch.empty(need, dtype=flat.dtype, device=flat.device)
        return buf

    def _emit(self, req: Request, tok: int, now: float) -> None:
        if req.cancelled or req.finished:
            return
        if req.first_token is None:
            req.first_token = now
        else:  # decode speed as the engine makes tokens (a client's clock adds its loop's)
            self.counters.decode_tokens += 1
            self.counters.decode_seconds += now - req.last_token
        req.last_token = now
        p = req.params
        if tok in p.stop_ids:
            self.counters.finished += 1
            self._finish(req, "stop")
            return
        req.output.append(tok)
        self.store.add_tokens(req.rid, [tok])
        self.counters.generated_tokens += 1
        if len(req.output) >= p.max_tokens:
            self.counters.finished += 1
            self._finish(req, "length", tok)
        else:
            req.events.put_nowait(TokenEvent(tok, None, req.reused))

    def _count_live(self) -> None:
        # the KV every running request holds after this step, as if nothing were shared
        t = self.spec.page_tokens
        pages = sum(-(-(r.computed + len(r.output) + 1) // t) for r in self.scheduler.running)
        live = pages * self.spec.num_layers * self.spec.page_bytes
        c = self.counters
        c.peak_live_kv_bytes = max(c.peak_live_kv_bytes, live)
