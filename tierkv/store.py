"""The KV store an inference server embeds.

::

    async with tierkv.KVStore(spec, device_bytes=2 << 30, host_bytes=32 << 30) as store:
        cached = await store.add_sequence("req-1", prompt_ids)     # reuses a cached prefix
        async with store.lease(["req-1"]) as lease:                # pages on the device, pinned
            await lease.append("req-1", layer, k, v)               # new KV ([H, n, D])
            k_all, v_all = lease.kv("req-1", layer)                # [H, S, D] for attention
        store.add_tokens("req-1", [next_token])
        async with store.step_plan(["req-1"], tokens=1) as step:   # a decode step, planned once
            for layer in range(spec.num_layers):                   # (tierkv.step)
                h = await step.layer(layer)                        # its pages pinned, loaded
                h.append(k, v)                                     # [B, H, n, D]
                k_all, v_all = h.kv()                              # [B, H, S, D]
        store.schedule([["req-2"], ["req-3"]])                     # prefetch the next steps
        store.step()                                               # one decode step done
        await store.release("req-1")                               # full blocks stay cached

Pages of a sequence live on the device while leased and move down (host, then compressed cold)
when the device needs room; they come back on the next lease or, better, on a prefetch announced
with :meth:`KVStore.schedule` or :meth:`KVStore.prefetch`.

This file stays whole (over 400 lines): it is the public API of the store, one method per verb
a server calls, each a thin checked entry over the tier core (:mod:`tierkv.tiers`), and most of
its length is their documentation.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from itertools import repeat
from typing import Any, cast

from tierkv import validate
from tierkv.admission import Admission
from tierkv.arguments import checked_init
from tierkv.attention.summaries import KeySummaries
from tierkv.boundary import async_boundary, boundary
from tierkv.chain import LowerChain, open_lower
from tierkv.chain_config import UNSET, Chain, TierEntry, Unset, build_chain, conflicts, shorthand
from tierkv.codecs import CODECS, Codec
from tierkv.errors import (
    InvalidInputError,
    InvalidTypeError,
    QuotaConfigError,
    SequenceError,
    SpecError,
    StoreClosedError,
    StoreTimeoutError,
    TierConfigError,
)
from tierkv.failures import Background, FailureLog
from tierkv.keys import page_key, prefix_keys
from tierkv.lease import Lease
from tierkv.page_source import PageSource
from tierkv.policies import DEFAULT_POLICY, POLICIES
from tierkv.prefetch import Prefetcher
from tierkv.prompt import prompt_keys
from tierkv.remote_tier import StoreRemote
from tierkv.runtime import BACKENDS, EngineStats, TransferEngine, create_backend
from tierkv.runtime.transfer import INLINE_MAX_BYTES
from tierkv.seq_flight import ADD, RELEASE, InFlight
from tierkv.sequence import SequenceState
from tierkv.spec import KVSpec
from tierkv.stats import StoreCounters
from tierkv.step import StepPlan, check_tokens
from tierkv.step_claims import StepClaims
from tierkv.tenant_names import check_salt
from tierkv.tenants import Quota, Tenants, tenant_index
from tierkv.tiers import COLD, DEVICE, HOST, TierSet
from tierkv.timeline import Timeline
from tierkv.turns import DEFAULT_BUDGET as DEFAULT_TURN_BUDGET
from tierkv.turns import TurnBudget

_OWN_AT_ONCE = 4096  # pages owned in one loop turn (a few ms)


@checked_init
class KVStore:
    """A tiered, paged KV store for one model layout.

    The tiers are a chain, fastest first: ``tiers=[tierkv.Device(bytes=...),
    tierkv.Host(bytes=...), tierkv.Cold(codec=..., bytes=...), tierkv.Disk(path=..., bytes=...),
    tierkv.Remote(sources=[...])]``, any subset in that order that starts with the device or
    the host (*host-first*: leases pin pages in host memory; see :mod:`tierkv.chain_config`
    and docs/configuration.md), or the keyword shorthand below that builds today's chain.

    Args:
        spec: the page layout.
        device_bytes: device tier budget (GPU memory; host memory on the cpu backend);
            required without ``tiers``.
        host_bytes: host tier budget, including the compressed cold pool; required without
            ``tiers``.
        backend: ``"cpu"``, ``"cuda"`` or ``"auto"``.
        policy: eviction policy name for every tier.
        codec: codec of the cold pool (``"int8"``, ``"fp16"``... or a Codec built with options,
            such as ``head-sparse`` with its ranking; ``"int8"`` when not given), or None for
            no compression.
        cold_fraction: share of ``host_bytes`` given to the compressed pool (0.25 when not
            given).
        compress_after: decode steps a host page may stay idle before it is compressed.
        prefetch_window: how many announced steps :meth:`schedule` prefetches ahead.
        max_inflight: transfer batches in flight at once.
        namespace: keeps different models' (or adapters') pages apart.
        timeout: the bound, in seconds, of every wait.
        compress_live: also compress idle pages of live sequences (their later tokens then
            depend on the lossy codec); by default only pages no live sequence owns (cached
            prefixes) are compressed.
        write_behind: copy pages a lease wrote down to the host in the background when the
            lease ends, so that evicting them later costs no wait.
        remote: a remote tier (any :class:`~tierkv.page_source.PageSource`: a peer's page server,
            a cluster of them, Redis), or several consulted in order. Blocks missing locally
            are imported from it by :meth:`add_sequence` / :meth:`fetch_prefix`; content pages
            leaving the host tier are pushed to the first one (``remote_write``). Failures are
            counted in ``stats()["remote"]``, never raised. The caller opens and closes the
            sources.
        remote_write: push content pages leaving the host tier to the remote (batched, in the
            background; an eviction waits at most ``remote_push_wait`` seconds for it).
        remote_push_pages: staging buffer of those pushes, in pages.
        remote_push_wait: the longest an eviction waits for room in that buffer (else the
            pages are not pushed, counted as ``push_dropped``).
        turn_budget: seconds of store work in one loop turn after which the store's async
            calls (adding and releasing sequences, entering a lease, appending) wait for a
            later turn (first come, first served) before going on, so that a thousand tasks
            stepping at once never hold the loop for long (:mod:`tierkv.turns`); ``None``
            never waits.
        disk_path: an existing, writable directory for the disk tier (docs/disk.md): content
            pages leaving the host tier are written there, prefix lookups that miss the host
            find them, also in a later process opening the same path (its lock keeps a
            second one out). Private pages never go to disk. None: no disk tier.
        disk_bytes: the disk tier's budget (segment files preallocated at open), required
            with ``disk_path``.
        tiers: the chain of tiers, fastest first (:mod:`tierkv.chain_config`): typed entries
            or dicts ``{"tier": "host", "bytes": ...}``. Given, the seven tier keywords above
            (``device_bytes`` ... ``remote``) must not be.
        tenants: tenant name -> :class:`tierkv.Quota` (per tier, a reservation and a limit in
            bytes; :mod:`tierkv.tenants`): sequences added with ``tenant=`` are charged for
            the pages they make, and evictions keep to the quotas. None: no tenants.

    Raises:
        InvalidTypeError: an argument of the wrong type (``device_bytes="1G"``, a non-bool flag).
        InvalidInputError: an argument out of range (``timeout <= 0``).
        SpecError: a budget too small for one page per tier (TierSizeError with ``tiers``).
        TierConfigError: a bad chain (:mod:`tierkv.errors`: an unknown kind, a wrong type,
            a tier twice or out of order, ``tiers`` with an old tier keyword, compress_live on
            a host-first chain); QuotaConfigError: quotas that do not add up (reservations
            over a tier's capacity) or name a tier the store lacks.
        UnknownNameError: a policy, codec or backend name its registry does not know
            (:class:`~tierkv.errors.UnknownPolicyError`, also an InvalidInputError;
            :class:`~tierkv.codecs.UnknownCodecError`;
            :class:`~tierkv.runtime.errors.UnknownBackendError`), raised before anything is
            allocated.

    Every public method raises tierkv errors only (see :mod:`tierkv.errors`): arguments are
    checked at entry (:mod:`tierkv.validate`), runtime failures mapped at the boundary.
    """

    def __init__(
        self,
        spec: KVSpec,
        *,
        device_bytes: int | Unset = UNSET,
        host_bytes: int | Unset = UNSET,
        backend: str = "cpu",
        policy: str = DEFAULT_POLICY,
        codec: str | Codec | Unset | None = UNSET,
        cold_fraction: float | Unset = UNSET,
        compress_after: int = 5,
        prefetch_window: int = 4,
        max_inflight: int = 4,
        namespace: object = None,
        timeout: float = 30.0,
        write_behind: bool = True,
        compress_live: bool = False,
        remote: PageSource | Sequence[PageSource] | None = None,
        remote_write: bool = True,
        remote_push_pages: int = 256,
        remote_push_wait: float = 0.05,
        turn_budget: float | None = DEFAULT_TURN_BUDGET,
        disk_path: str | os.PathLike[str] | None = None,
        disk_bytes: int | None = None,
        tiers: Sequence[TierEntry | Mapping[str, Any]] | None = None,
        tenants: Mapping[str, Quota] | None = None,
    ) -> None:
        spec = validate.spec(spec)  # every argument is checked before anything is allocated
        if tiers is not None:
            conflicts(
                dict(
                    device_bytes=device_bytes is not UNSET,
                    host_bytes=host_bytes is not UNSET,
                    codec=codec is not UNSET,
                    cold_fraction=cold_fraction is not UNSET,
                    disk_path=disk_path is not None,
                    disk_bytes=disk_bytes is not None,
                    remote=remote is not None,
                )
            )
            chain = build_chain(spec, tiers)
        else:
            chain = _keyword_chain(
                spec, device_bytes, host_bytes, codec, cold_fraction, disk_path, disk_bytes, remote
            )
        backend = validate.registered("backend", backend, BACKENDS, "auto")
        policy = validate.registered("policy", policy, POLICIES)
        compress_after = validate.count("compress_after", compress_after, 0)
        prefetch_window = validate.count("prefetch_window", prefetch_window, 0)
        max_inflight = validate.count("max_inflight", max_inflight, 1)
        namespace = validate.namespace(namespace)
        timeout = validate.seconds("timeout", timeout)
        write_behind = validate.flag("write_behind", write_behind)
        compress_live = validate.flag("compress_live", compress_live)
        remote_write = validate.flag("remote_write", remote_write)
        remote_push_pages = validate.count("remote_push_pages", remote_push_pages, 1)
        remote_push_wait = validate.seconds("remote_push_wait", remote_push_wait, allow_zero=True)
        if turn_budget is not None:
            turn_budget = validate.seconds("turn_budget", turn_budget)
        if chain.host_first and compress_live:
            raise TierConfigError(
                "compress_live needs a device tier: in a host-first store a live sequence's "
                "pages have one exact copy, in the host tier, and stay there"
            )
        pages = {DEVICE: chain.lease_pages, HOST: chain.host_pages, COLD: chain.cold_pages}
        self.tenants = None if tenants is None else _tenants(spec, chain, pages, tenants)
        self.chain = chain
        self.spec = spec
        self.namespace = namespace
        self.timeout = timeout
        self.compress_after = compress_after
        # (no host tier under the leased one: nothing to write behind to)
        self.write_behind = write_behind and chain.host_pages > 0
        self.turns = TurnBudget(turn_budget)
        self.steps = StepClaims()  # the sequences in an entered step plan (one plan each)
        self.compress_live = compress_live
        self._codec = chain.codec
        self._pages = pages
        self._backend_name = backend
        # small cpu copies on the loop's thread (measured: benchmarks/step.py, issue 26);
        # TIERKV_INLINE_COPIES=0 turns it off
        self._inline = os.environ.get("TIERKV_INLINE_COPIES", "1") != "0"
        self._policy = policy
        self._max_inflight = max_inflight
        self._seqs: dict[str, SequenceState] = {}
        self._flight = InFlight()  # the ids whose add_sequence or release is in flight
        # per page key, the min/max of its K (top-k attention's page summaries): one table for
        # every sequence and tier, following renames, pruned of pages no tier holds
        self.summaries = KeySummaries(spec.num_kv_heads, spec.head_dim)
        self._tiers: TierSet | None = None
        self._admission: Admission | None = None
        self._incarnations = 0
        self._engine: TransferEngine | None = None
        self._tasks: dict[asyncio.Task[Any], Background] = {}  # each with what it works on
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it was opened on
        self._failures = FailureLog("tierkv.store")
        # pages leases wrote, waiting for the one write-behind task (a dict of bytes: the
        # collector does not track it; one task per batch of leases, not two per lease)
        self._behind: dict[bytes, None] = {}
        self._behind_task: asyncio.Task[Any] | None = None
        # the idle clock: page -> the step it was last leased at, oldest first (re-inserted at
        # each use), so that step() reads only the pages that just went idle; idle pages still
        # owned (not compressible unless compress_live) are parked until their release
        self._last_use: dict[bytes, int] = {}
        self._parked: dict[bytes, int] = {}
        self._due: dict[bytes, int] = {}  # parked pages released: compressible at the next step
        self._clock = 0
        self.counters = StoreCounters()
        self.timeline = Timeline()
        self._prefetcher = Prefetcher(
            spec,
            self._seqs,
            lambda: self.tiers,
            lambda: self.admission,
            self._spawn,
            self.counters,
            self.timeline,
            window=prefetch_window,
            timeout=timeout,
        )
        self._closed = False
        self._chain: LowerChain | None = None
        self.remote: StoreRemote | None = None
        if chain.remote is not None:
            self.remote = StoreRemote(
                chain.remote,
                spec.page_bytes,
                write=remote_write,
                timeout=min(timeout, 10.0),
                push_pages=remote_push_pages,
                push_wait=remote_push_wait,
            )

    # -- life cycle ----------------------------------------------------------------------
    @async_boundary
    async def open(self) -> KVStore:
        """Allocate the arenas and start the transfer engine. Returns self.

        Raises AllocationError when a tier's memory cannot be reserved, EngineError when the
        backend cannot run here.
        """
        if self._closed:  # (first: a closed store keeps its tiers, and opened nothing here)
            raise StoreClosedError("store was closed")
        if self._tiers is not None:
            return self
        chain = self._open_chain()  # first: a bad path fails before anything is allocated
        self._loop = asyncio.get_running_loop()
        try:
            self._open_core()
        except BaseException:
            if chain is not None:
                chain.close()
            raise
        renames = self.tiers.ownership  # every per-page record follows a rename
        renames.on_rename(self._renamed)
        renames.on_rename(self._prefetcher.rename)
        renames.on_rename(self.summaries.rename)
        table = self.tiers.table
        self.summaries.limit = 2 * sum(table.capacity(t) for t in table.tier_names)
        if chain is not None:
            chain.attach(self.tiers)
            self._chain = chain
        if self.remote is not None:
            self.remote.attach(self.tiers)
        return self

    def _open_chain(self) -> LowerChain | None:
        """The tiers below the host, their media opened in the listed order (the disk, the
        plug-in tiers: `tierkv.chain_config.register_tier`); None without any."""
        return open_lower(self.spec, self.chain, self.timeout)

    def _open_core(self) -> None:
        backend = create_backend(self._backend_name)
        self._engine = TransferEngine(
            backend,
            max_inflight=self._max_inflight,
            timeout=self.timeout,
            inline_bytes=INLINE_MAX_BYTES if self._inline else 0,
        )
        self._tiers = TierSet(
            self.spec,
            backend,
            self._engine,
            device_pages=self._pages[DEVICE],
            host_pages=self._pages[HOST],
            cold_pages=self._pages[COLD],
            codec=self._codec,
            policy=self._policy,
            timeline=self.timeline,
            host_first=self.chain.host_first,
            tenants=self.tenants,
        )
        self._admission = Admission(self._pages[DEVICE])

    @async_boundary
    async def close(self) -> None:
        """Stop background work, finish transfers in flight, free everything. Idempotent.

        Every wait is bounded by the store's timeout. Raises StoreTimeoutError when transfers
        in flight (a hung copy) outlast it, after everything else was let go all the same
        (the lower tiers' media and locks, the prefault thread, the sequences): a failed
        close leaves nothing half-closed, and a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        self._behind.clear()
        if self._admission is not None:  # leases waiting for room fail now, not at their deadline
            self._admission.close(lambda: StoreClosedError("store closed while the lease waited"))
        if self.remote is not None:
            await self.remote.aclose()
        if self._chain is not None:
            self._chain.detach()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.timeout)
        try:
            if self._chain is not None:
                await self._persist(self._chain)
            if self._engine is not None:
                await self._engine.aclose(self.timeout, cancel_pending=True)
        finally:  # (a transfer that outlasted the timeout: the rest goes all the same)
            if self._tiers is not None:
                self._tiers.close()
            if self._chain is not None:
                self._chain.close()
            self._seqs.clear()

    async def _persist(self, chain: LowerChain) -> None:
        """At close: the host tier's content pages go down to the disk (bounded by the
        timeout; a failure is logged and counted, the close goes on)."""
        try:
            await asyncio.wait_for(chain.persist(), self.timeout)
        except Exception as exc:  # a close never fails for the disk
            self.counters.background_errors += 1
            self.counters.last_error = self._failures.report("disk persist at close", exc)

    async def __aenter__(self) -> KVStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def prefetch_window(self) -> int:
        """How many announced steps :meth:`schedule` prefetches ahead."""
        return self._prefetcher.prefetch_window

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    @property
    def tiers(self) -> TierSet:
        """The tiers (raises StoreClosedError when closed or not opened)."""
        if self._closed or self._tiers is None:
            raise StoreClosedError("store is closed" if self._closed else "store is not open")
        return self._tiers

    @property
    def admission(self) -> Admission:
        """The FIFO admission of leases to the device (raises StoreClosedError when closed)."""
        self.tiers  # noqa: B018 - raises when closed
        assert self._admission is not None  # opened together with the tiers
        return self._admission

    def check(self) -> None:
        """Assert the store's invariants (for tests and debugging): the page table's, the
        owners' pins, the doomed pages, the admission's. Raises AssertionError."""
        tiers = self.tiers
        tiers.check()
        self.admission.check()
        owned: dict[bytes, int] = {}
        for seq in self._seqs.values():
            for k in dict.fromkeys(seq.all_pages()):
                owned[k] = owned.get(k, 0) + 1
        assert owned == tiers.ownership.owners, "owners differ from the live sequences' pages"

    # -- sequences -----------------------------------------------------------------------
    @boundary
    def lookup(self, tokens: Sequence[int], *, salt: bytes | str | None = None) -> int:
        """Tokens of ``tokens``' longest prefix whose KV is cached (all layers, any tier)
        under ``salt`` (see :meth:`add_sequence`).

        Hashes on the caller's thread: for long prompts prefer :meth:`fetch_prefix`, which
        gives the loop a turn between slices. Raises InvalidTypeError, SpecError for bad ids,
        TenantError for a bad salt.
        """
        raw = check_salt(salt)
        arr = validate.token_array(tokens)
        keys = prefix_keys(arr, self.spec.page_tokens, self.namespace, salt=raw)
        n = self._cached_blocks(keys)
        return (n + self._lower_blocks(keys[n:])) * self.spec.page_tokens

    def _lower_blocks(self, blocks: list[bytes]) -> int:
        """How many of ``blocks``, from the first, a lower tier holds (every layer's page; a
        page readable in a local tier counts too: a block split between the host and the disk
        is whole)."""
        if self._chain is None or not blocks:
            return 0
        layers, table = self.spec.num_layers, self.tiers.table
        n, window = 0, 64
        while n < len(blocks):  # doubling windows, as _cached_blocks
            part = blocks[n : n + window]
            pages = [page_key(b, j) for b in part for j in range(layers)]
            local = set(table.readable(pages, table.tier_names))
            found = [f or p in local for p, f in zip(pages, self._chain.lookup(pages), strict=True)]
            full = next(
                (i for i in range(len(part)) if not all(found[i * layers : (i + 1) * layers])),
                len(part),
            )
            n += full
            if full < len(part):
                break
            window *= 2
        return n

    async def _fetch_lower(self, blocks: list[bytes]) -> int:
        """Import the leading ``blocks`` a lower tier holds into the host, as many as the host
        tier has room for (its free and evictable slots: an import is all or nothing);
        returns pages."""
        layers = self.spec.num_layers
        table, top = self.tiers.table, self.tiers.top  # (the leased tier when host-first)
        room = table.capacity(top) - table.used(top) + table.evictable(top)
        n = self._lower_blocks(blocks[: room // layers])
        if n == 0 or self._chain is None:
            return 0
        return await self._chain.fetch([page_key(b, j) for b in blocks[:n] for j in range(layers)])

    def _cached_blocks(self, keys: list[bytes]) -> int:
        table = self.tiers.table
        # layer 0 in doubling windows: a long prompt with a short cached prefix costs the
        # prefix, not 62,500 page keys per million tokens (~10 ms of loop block)
        n, window = 0, 64
        while n < len(keys):
            part = keys[n : n + window]
            got = table.lookup([page_key(k, 0) for k in part])
            n += got
            if got < len(part):
                break
            window *= 2
        for layer in range(1, self.spec.num_layers):
            n = min(n, table.lookup([page_key(k, layer) for k in keys[:n]]))
        return n

    @async_boundary
    async def add_sequence(
        self,
        seq_id: str,
        tokens: Sequence[int],
        *,
        salt: bytes | str | None = None,
        tenant: str | None = None,
    ) -> int:
        """Start a sequence with its prompt; returns the prompt tokens whose KV was reused.

        At least one prompt token is always left to compute (its logits start decoding).
        A long prompt is checked and hashed in slices with a loop turn between them
        (:mod:`tierkv.prompt`). With a remote tier, the blocks missing locally are imported
        first (bounded).

        ``salt``: a cache salt (vLLM's ``cache_salt``; str or bytes of 1-256 bytes) mixed into
        the first block's content key, so the sequence shares pages only with sequences of
        the same salt, in every tier (docs/security.md, "Tenants"); ``None``: unsalted keys.
        ``tenant``: one of the store's ``tenants``, charged for the pages the sequence makes
        (and for the blocks imported for it from the disk or a remote tier); its quotas
        apply to them (:mod:`tierkv.tenants`).

        Calls of one id take turns (:mod:`tierkv.seq_flight`): while a :meth:`release` of
        ``seq_id`` is in flight (begun, not returned) this waits for it to return, then adds
        (at most the store's timeout: StoreTimeoutError, nothing changed); a release of
        ``seq_id`` begun while this is in flight waits for this to return, then releases what
        it added. A sequence is registered whole when this returns, or not at all.

        Raises SequenceError when the id is in use (live, or an add_sequence of it is in
        flight), StoreClosedError after close, InvalidTypeError / SpecError for a bad id or
        token, TenantError for a bad salt or tenant name, UnknownTenantError for a tenant the
        store was not given, StoreTimeoutError as above (nothing is changed then).
        """
        seq_id = validate.seq_id(seq_id)
        raw = check_salt(salt)
        who = tenant_index(self.tenants, tenant)
        self.tiers  # noqa: B018 - raises when closed
        if seq_id in self._seqs:
            raise SequenceError(f"sequence {seq_id!r} already exists")
        await self._flight.turn(seq_id, ADD, self.timeout)  # after a release of it in flight
        try:
            return await self._add(seq_id, tokens, raw, who)
        finally:
            self._flight.end(seq_id)

    async def _add(
        self, seq_id: str, tokens: Sequence[int], raw: bytes | None, who: int | None
    ) -> int:
        """:meth:`add_sequence`'s work, its arguments checked, no other call of the id in
        flight."""
        await self.turns.pause()
        tiers = self.tiers  # (the store may have closed meanwhile)
        t0 = time.perf_counter()  # the store work, charged to the turn budget
        try:
            if seq_id in self._seqs:
                raise SequenceError(f"sequence {seq_id!r} already exists")
            t = self.spec.page_tokens
            toks, keys = await prompt_keys(tokens, t, self.namespace, salt=raw)
            keys = keys[: max(0, len(toks) - 1) // t]
            tiers = self.tiers  # a long prompt yielded: the store may have closed meanwhile
            if seq_id in self._seqs:
                raise SequenceError(f"sequence {seq_id!r} already exists")
            n = self._cached_blocks(keys)
            if (self._chain is not None or self.remote is not None) and n < len(keys):
                n = await self._import(keys, n, who)
                tiers = self.tiers  # raises if the store closed meanwhile
                if seq_id in self._seqs:
                    raise SequenceError(f"sequence {seq_id!r} already exists")
                n = self._cached_blocks(keys)  # no await from here on: nothing can evict them
            self._incarnations += 1
            seq = SequenceState(
                seq_id,
                self.spec.num_layers,
                t,
                self.namespace,
                tokens=toks,
                incarnation=self._incarnations,
                salt=raw,
                tenant=who,
            )
            seq.set_blocks(keys[:n], shared=True)
            seq.set_all_kv_len(n * t)
            seq.cached_tokens = n * t
            pages = seq.all_pages()
            if len(pages) <= _OWN_AT_ONCE:
                tiers.ownership.own(pages)
            else:  # a million-token prompt: owned in slices, a loop turn between them
                await tiers.ownership.own_async(pages, _OWN_AT_ONCE)
                try:
                    tiers = self.tiers
                    if seq_id in self._seqs:
                        raise SequenceError(f"sequence {seq_id!r} already exists")
                except BaseException:
                    tiers.ownership.disown(pages)
                    raise
                held = next(
                    (
                        i
                        for i, b in enumerate(keys[:n])
                        if not all(
                            tiers.holds(page_key(b, layer)) for layer in range(self.spec.num_layers)
                        )
                    ),
                    n,
                )  # pages owned late may have left meanwhile: keep the prefix still held
                if held < n:
                    tiers.ownership.disown(pages)
                    n = held
                    seq.set_blocks(keys[:n], shared=True)
                    seq.set_all_kv_len(n * t)
                    seq.cached_tokens = n * t
                    tiers.ownership.own(seq.all_pages())
            self._seqs[seq_id] = seq
            self.counters.prefix_tokens_reused += n * t
            self.counters.prompt_tokens += len(toks)
            if who is not None:
                assert self.tenants is not None
                c = self.tenants.counters[who]
                c.sequences += 1
                c.prompt_tokens += len(toks)
                c.prefix_tokens_reused += n * t
            return n * t
        finally:
            self.turns.charge(time.perf_counter() - t0)

    @async_boundary
    async def fetch_prefix(self, tokens: Sequence[int], *, salt: bytes | str | None = None) -> int:
        """Like :meth:`lookup`, but first imports the blocks of ``tokens``' prefix that are
        missing locally from the remote tier (if any); hashes a long prompt in slices with a
        loop turn between them. Returns the tokens now cached under ``salt``."""
        raw = check_salt(salt)
        _, keys = await prompt_keys(tokens, self.spec.page_tokens, self.namespace, salt=raw)
        n = self._cached_blocks(keys)
        if (self._chain is not None or self.remote is not None) and n < len(keys):
            n = await self._import(keys, n, None)
        return n * self.spec.page_tokens

    async def _import(self, keys: list[bytes], n: int, who: int | None) -> int:
        """Import the blocks of ``keys`` after the ``n`` cached ones from the disk, then the
        remote tier; the pages are charged to tenant ``who`` (their maker here; those that
        do not come are pruned with the other stale charges). Returns the blocks now
        cached."""
        if self.tenants is not None and who is not None:
            layers = range(self.spec.num_layers)
            pages = [page_key(b, layer) for b in keys[n:] for layer in layers]
            self.tenants.charge(pages, who, fresh=True)
        if self._chain is not None and n < len(keys):
            await self._fetch_lower(keys[n:])
            n = self._cached_blocks(keys)
        if self.remote is not None and n < len(keys):
            await self._fetch(keys[n:])
            n = self._cached_blocks(keys)
        return n

    async def _fetch(self, blocks: list[bytes]) -> int:
        assert self.remote is not None
        layers = self.spec.num_layers
        pages = [page_key(b, layer) for b in blocks for layer in range(layers)]
        return await self.remote.fetch(pages, layers)

    @boundary
    def add_tokens(self, seq_id: str, tokens: Sequence[int]) -> None:
        """Declare generated tokens (their KV is appended by the next step).

        Raises SequenceError, InvalidTypeError / SpecError for bad ids (nothing is added).
        """
        seq = self.sequence(seq_id)
        seq.add_tokens(validate.token_ids(tokens))

    def sequence_ids(self) -> list[str]:
        """Ids of the live sequences (added, not yet released), oldest first."""
        return list(self._seqs)

    def has_sequence(self, seq_id: str) -> bool:
        """True while ``seq_id`` is a live sequence (False for an id of another type)."""
        return seq_id in self._seqs

    @boundary
    def sequence(self, seq_id: str) -> SequenceState:
        """The state of a live sequence. Raises SequenceError, StoreClosedError,
        InvalidTypeError (an id neither str nor int)."""
        seq_id = validate.seq_id(seq_id)
        self.tiers  # noqa: B018 - raises when closed
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise SequenceError(f"unknown sequence {seq_id!r}") from None

    @async_boundary
    async def release(self, seq_id: str) -> None:
        """End a sequence: its full blocks stay cached for reuse, its private pages are freed.

        While an :meth:`add_sequence` of ``seq_id`` is in flight this waits for it to return
        (at most the store's timeout: StoreTimeoutError, nothing changed), then releases what
        it added; an add_sequence of ``seq_id`` begun while this is in flight waits for this
        to return (:mod:`tierkv.seq_flight`).

        Raises SequenceError for an unknown (or already released, or being released) id.
        """
        seq_id = validate.seq_id(seq_id)
        # (no suspension unless an add of the id is in flight: see below)
        await self._flight.turn(seq_id, RELEASE, self.timeout)
        try:
            await self._release(seq_id)
        finally:
            self._flight.end(seq_id)

    async def _release(self, seq_id: str) -> None:
        # no pause before the release: a write-behind task let run then would copy down the
        # very pages being freed (the pause comes after, when the work is done)
        t0 = time.perf_counter()  # the store work, charged to the turn budget
        try:
            seq = self.sequence(seq_id)
            self.publish(seq)
            del self._seqs[seq_id]
            pages = seq.all_pages()
            tiers = self.tiers
            tiers.ownership.disown(pages)
            layers = range(seq.num_layers)
            full = dict(seq.unpublished())  # full blocks busy now: renamed once idle
            private: list[bytes] = []
            for i, (b, shared) in enumerate(zip(seq.blocks, seq.shared)):
                if shared:
                    continue
                old = [page_key(b, layer) for layer in layers]
                if i in full:
                    tiers.ownership.rename_when_idle(
                        old, [page_key(full[i], layer) for layer in layers]
                    )
                else:
                    private += old
            tiers.ownership.forget(private)
            for k in private:
                self._last_use.pop(k, None)
                self._parked.pop(k, None)
            parked, owners = self._parked, tiers.ownership.owners
            for k in pages:
                t = parked.get(k)
                if t is not None and k not in owners:
                    del parked[k]
                    self._due[k] = t
            self._prefetcher.forget(private)  # never to be used: no growth
        finally:
            self.turns.charge(time.perf_counter() - t0)
        await self.turns.pause()

    def publish(self, seq: SequenceState) -> None:
        """Give full private blocks their content keys, so other requests can reuse them."""
        tiers = self.tiers
        for i, key in seq.unpublished():  # lazy: stopping early hashes no further block
            old = [page_key(seq.block(i), layer) for layer in range(seq.num_layers)]
            new = [page_key(key, layer) for layer in range(seq.num_layers)]
            if tiers.pages.pinned_on_device(old):
                break  # leased right now: publish at the end of the lease
            if not tiers.ownership.rekey(old, new):  # (the idle clock follows: _renamed)
                break
            seq.set_block(i, key, shared=True)

    def _renamed(self, old: Sequence[bytes], new: Sequence[bytes]) -> None:
        """Pages were renamed (a publish, or a released block once idle): the idle clock
        follows (a renamed page goes to the end of ``_last_use``: it waits a few steps more)."""
        for use in (self._last_use, self._parked, self._due):
            if use:
                for o, n in zip(old, new):
                    if o in use:
                        use[n] = use.pop(o)

    # -- leases and prefetch -------------------------------------------------------------
    @boundary
    def lease(
        self,
        seq_ids: Sequence[str],
        layers: Sequence[int] | None = None,
        blocks: Mapping[str, Sequence[int]] | None = None,
    ) -> Lease:
        """Pin these sequences' pages (of ``layers``, all by default) on the device.

        ``blocks`` pins only those page indices of each sequence (none for a sequence it does
        not name), read with :meth:`Lease.kv_blocks`; appends pin what they write.
        Use as ``async with store.lease(ids) as lease:``. One writer of a sequence's layer at
        a time (:mod:`tierkv.step_claims`): entering raises SequenceError while a step plan
        appends to one of its sequences in a leased layer, and an append to a layer another
        entered lease appended to raises SequenceError (nothing appended); leases that only
        read may overlap. Raises SequenceError for an unknown id (in ``blocks`` too),
        SpecError for a bad layer, InvalidTypeError for a single str instead of a list or
        ``blocks`` that is no dict of int lists, InvalidInputError for a negative block.
        """
        ls = validate.layers(layers, self.spec.num_layers)
        ids = validate.seq_ids(seq_ids)
        chosen = validate.blocks(blocks, ids)
        seqs = [self.sequence(s) for s in ids]
        return Lease(self, seqs, ls, chosen)

    @boundary
    def step_plan(
        self,
        seq_ids: Sequence[str],
        layers: Sequence[int] | None = None,
        *,
        tokens: int | Sequence[int] = 1,
        ahead: int = 2,
        window: int = 2,
    ) -> StepPlan:
        """Plan a step: ``seq_ids`` run ``layers`` (all by default, in that order), each
        appending ``tokens`` new tokens (one count for all, or one per sequence) to every
        layer; layers load in groups of ``ahead``, ``window`` groups (1 or 2) pinned at a
        time: with 2 the next group loads while this one computes, with 1 once the caller is
        done with this one (:meth:`StepPlan.done_with`; see :mod:`tierkv.step`).

        Use as ``async with store.step_plan(ids) as step:``. A sequence runs in one entered
        plan at a time, and a plan that appends to it is refused at entry (SequenceError)
        while a lease over one of its layers is entered (:mod:`tierkv.step_claims`). Raises
        SequenceError (an unknown or repeated id), SpecError (a bad layer, a count list of
        the wrong length, a page layout the step path cannot index), InvalidTypeError /
        InvalidInputError for bad arguments; nothing changes then.
        """
        ls = validate.layers(layers, self.spec.num_layers)
        if len(set(ls)) != len(ls):
            raise SpecError(f"layers: each at most once, got {ls}")
        ids = validate.seq_ids(seq_ids)
        if len(set(ids)) != len(ids):
            raise SequenceError(f"a sequence is named twice in {ids}")
        seqs = [self.sequence(s) for s in ids]
        counts = check_tokens(tokens, len(seqs))
        group = validate.count("ahead", ahead, 0)
        if validate.count("window", window, 1) > 2:
            raise InvalidInputError(f"window: 1 or 2 groups at a time, got {window}")
        return StepPlan(
            self, seqs, ls, counts, group, partial(self.prefetch, wait=False), window=window
        )

    @async_boundary
    async def prefetch(
        self,
        seq_ids: Sequence[str],
        layers: Sequence[int] | None = None,
        *,
        wait: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Load these sequences' pages to the device ahead of use; returns pages loaded
        (see :meth:`tierkv.prefetch.Prefetcher.prefetch`). Raises InvalidTypeError,
        InvalidInputError or SpecError for bad arguments, before anything is loaded."""
        ids = validate.seq_ids(seq_ids)
        ls = None if layers is None else validate.layers(layers, self.spec.num_layers)
        limit = None if timeout is None else validate.seconds("timeout", timeout)
        flag = validate.flag("wait", wait)
        return await self._prefetcher.prefetch(ids, ls, wait=flag, timeout=limit)

    @boundary
    def schedule(self, steps: Sequence[Sequence[str]]) -> None:
        """Announce the sequences of the coming steps, the step about to run first (see
        :meth:`tierkv.prefetch.Prefetcher.schedule`). Raises InvalidTypeError for a step
        that is not a list of ids."""
        if isinstance(steps, str | bytes) or not isinstance(steps, Sequence):
            raise InvalidTypeError(f"steps: expected a list of lists of ids, got {steps!r}")
        self._prefetcher.schedule([validate.seq_ids(step, "a step") for step in steps])

    # -- the lease's hooks (tierkv.lease.LeaseHost) -------------------------------------------
    def lease_began(self, keys: Sequence[bytes]) -> None:
        """A lease pinned ``keys``: compute reads them now (prefetch accounting)."""
        self._prefetcher.used(keys)

    def is_live(self, seq: SequenceState) -> bool:
        """True while ``seq`` is a live sequence of this store (not released, id not reused)."""
        return self._seqs.get(seq.seq_id) is seq

    def lease_ended(self, seqs: Sequence[SequenceState], pinned: Sequence[bytes]) -> None:
        """A lease let go of ``pinned``: they were used now (the idle clock), and the full
        blocks of its live sequences get their content keys (:meth:`publish`). No idle clock
        without compression (:meth:`step` reads it only then)."""
        if pinned and self._codec is not None and self.compress_after > 0:
            # C-speed passes, no Python per page (a step lets go of thousands)
            clock, last = self._clock, self._last_use
            for use in (last, self._parked, self._due):
                if use:
                    deque(map(use.pop, pinned, repeat(None)), 0)
            last.update(zip(pinned, repeat(clock)))  # at the end: the dict stays oldest first
        for seq in seqs:
            if self.is_live(seq):
                self.publish(seq)

    def lease_wrote(self, keys: list[bytes]) -> None:
        """Pages a lease wrote: with ``write_behind``, copied down in the background. The
        leases that end before the copy task first runs (in the same loop round, as a thousand
        sequences' leases do) share one task and one copy, instead of two tasks each."""
        if not keys or not self.write_behind:
            return
        self._behind.update(dict.fromkeys(keys))
        if self._behind_task is None:
            what = Background("write-behind", HOST)
            self._behind_task = self._spawn(self._write_behind(what), what)

    async def _write_behind(self, what: Background) -> None:
        keys = what.keys = list(self._behind)  # every page written since this task was spawned
        self._behind.clear()
        self._behind_task = None  # the next lease to end starts the next copy
        if keys:
            await self.tiers.pages.write_behind(keys)

    @boundary
    def step(self) -> None:
        """One decode step has finished: advances the clock, compresses idle host pages (and
        prunes the page summaries of pages gone from every tier, once past their limit)."""
        self._clock += 1
        if self.summaries.due():
            self.summaries.prune(self.tiers.holds)
        if self._codec is None or self.compress_after <= 0:
            return
        limit = self._clock - self.compress_after
        owners = self.tiers.ownership.owners
        last, parked = self._last_use, self._parked
        stale: list[tuple[bytes, int]] = []
        for k, t in last.items():  # oldest first: only the pages that went idle are read
            if t > limit:
                break  # (a page renamed by publish may sit later: it waits a few steps more)
            stale.append((k, t))
        for k, _ in stale:
            del last[k]
        stale += self._due.items()
        self._due = {}
        idle: list[bytes] = []
        for k, t in stale:
            if self.compress_live or k not in owners:
                idle.append(k)
            else:
                parked[k] = t  # compressible once released (see release)
        if idle:
            self._spawn(self._compress(idle), Background("compression", COLD, idle))

    async def _compress(self, keys: list[bytes]) -> None:
        n = await self.tiers.cold.compress_idle(keys)
        self.counters.idle_compressed += n

    def _spawn(self, coro: Any, what: Background) -> asyncio.Task[Any]:
        self.tiers  # noqa: B018 - raises when closed
        loop: asyncio.AbstractEventLoop | None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous caller outside the loop (a TieredCache's step
            # exit: tierkv.integrations.hf_store): the store's own loop, not asyncio's default
            loop = self._loop  # one that nothing runs
        task = asyncio.ensure_future(coro, loop=loop)
        self._tasks[task] = what
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        what = self._tasks.pop(task, None)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        self.counters.background_errors += 1
        if what is None:  # not spawned by _spawn
            what = Background("task")
        self.counters.last_error = self._failures.report(
            what.kind, exc, tier=what.tier, keys=what.keys
        )

    @property
    def background(self) -> int:
        """Background tasks under way (prefetches, write-behinds, compressions)."""
        return len(self._tasks)

    @async_boundary
    async def drain(self, timeout: float | None = None) -> None:
        """Wait for background prefetches, compressions and write-behinds to finish (those
        they start too), then, in the time left, for the pages staged for the remote tier to
        go out (best effort: a remote too slow for the bound keeps them staged, counted in
        ``stats()["remote"]``, as remote failures are never raised). Released pages that are
        idle by then are gone when it returns (reaped now, not at the next loop turn).

        ``timeout``: the bound, in seconds, of the whole call (the store's ``timeout`` when
        None). Every wait is woken by a task finishing, none polls.

        Raises StoreTimeoutError, saying which background tasks are still running, when
        they have not all finished by the deadline (nothing is reaped or flushed then, and
        the tasks run on); InvalidTypeError / InvalidInputError for a bad ``timeout``.
        """
        limit = self.timeout if timeout is None else validate.seconds("timeout", timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while self._tasks:  # a finishing task may spawn another: the same deadline bounds it
            left = deadline - loop.time()
            if left <= 0:
                raise StoreTimeoutError(
                    f"drain: {_pending(self._tasks.values())} still running after {limit:g} s"
                )
            await asyncio.wait(list(self._tasks), timeout=left)
        if not self._closed and self._tiers is not None:
            self._tiers.ownership.reap()
        if self.remote is not None:
            await self.remote.flush(max(0.0, deadline - loop.time()))

    # -- figures -------------------------------------------------------------------------
    @boundary
    def engine_stats(self) -> EngineStats:
        """A snapshot of the transfer engine's totals: batches (per priority), pages, bytes,
        copy seconds and queue-wait seconds. Raises StoreClosedError when closed or not open."""
        self.tiers  # noqa: B018 - raises when closed
        assert self._engine is not None  # opened together with the tiers
        return self._engine.stats

    @boundary
    def stats(self) -> dict[str, Any]:
        """Counters: hits per tier, prefetch accuracy, late fetches, bytes moved, tiers..."""
        tiers = self.tiers
        c = self.counters
        ts = tiers.stats
        loads = ts.loads_from[HOST] + ts.loads_from[COLD]
        return {
            "pages_leased": c.pages_leased,
            # leased pages by the tier they came from (host-first: "host" = already resident)
            "hits": {HOST: c.device_hits, COLD: ts.loads_from[COLD]}
            if self.chain.host_first
            else {
                DEVICE: c.device_hits,
                HOST: ts.loads_from[HOST],
                COLD: ts.loads_from[COLD],
            },
            "page_loads": loads,
            "late_fetches": c.late_fetches,
            "prefetched": c.prefetched,
            "prefetch_used": c.prefetch_used,
            "prefetch_accuracy": c.prefetch_used / c.prefetched if c.prefetched else 1.0,
            "bytes_h2d": ts.bytes_h2d,
            "bytes_d2h": ts.bytes_d2h,
            "written_back": ts.pages_written_back,
            "compressed": ts.pages_compressed,
            "idle_compressed": c.idle_compressed,
            "dropped": ts.pages_dropped,
            "peak_device_pages": ts.peak_device_pages,
            "peak_device_bytes": ts.peak_device_pages * self.spec.page_bytes,
            "prefix_tokens_reused": c.prefix_tokens_reused,
            "background_errors": c.background_errors,
            "corrupt_pages": {t: ts.corrupt.get(t, 0) for t in ("cold", "peer", "redis")}
            | ts.corrupt,
            "chain": list(self.chain.names),  # fastest first (docs/configuration.md)
            # pages per tier; a host-first store's leased tier (the core's "device") is "host"
            "tiers": {
                HOST if self.chain.host_first and t == DEVICE else t: v
                for t, v in tiers.info().items()
            },
            **({"remote": self.remote.stats()} if self.remote is not None else {}),
            **({"tenants": self._tenant_stats()} if self.tenants is not None else {}),
            **(self._chain.stats() if self._chain is not None else {}),
        }

    def _tenant_stats(self) -> dict[str, Any]:
        """Per tenant figures, tier names as the user sees them (a host-first store's leased
        tier is ``host``)."""
        assert self.tenants is not None
        out = self.tenants.stats()
        if self.chain.host_first:
            for fig in out.values():
                fig["tiers"] = {HOST if t == DEVICE else t: v for t, v in fig["tiers"].items()}
        return out


def _pending(tasks: Iterable[Background]) -> str:
    """What background tasks work on, for an error: ``"2 background tasks (prefetch on
    device: 8 pages; compression on cold: 3 pages)"``."""
    kinds: dict[tuple[str, str | None], list[int]] = {}
    for what in tasks:
        got = kinds.setdefault((what.kind, what.tier), [0, 0])
        got[0] += 1
        got[1] += len(what.keys)
    n = sum(t for t, _ in kinds.values())
    parts = [
        f"{k}{'' if tier is None else f' on {tier}'}: {t} task{'s' * (t != 1)}, {p} pages"
        for (k, tier), (t, p) in kinds.items()
    ]
    return f"{n} background task{'s' * (n != 1)} ({'; '.join(parts)})"


def _tenants(
    spec: KVSpec, chain: Chain, pages: Mapping[str, int], quotas: Mapping[str, Quota]
) -> Tenants:
    """The tenants' accounting of a store with these tiers (checked: raises QuotaConfigError
    for reservations over a tier, or a quota for a tier the store lacks). A host-first store's
    leased tier is its host tier: the quotas' host fields apply to it."""
    slot = {DEVICE: spec.page_bytes, HOST: spec.page_bytes}
    if chain.codec is not None:
        slot[COLD] = chain.codec.encoded_bytes(spec)
    have = {t: b for t, b in slot.items() if pages[t] > 0}
    if chain.host_first and isinstance(quotas, Mapping):
        for name, q in quotas.items():
            if isinstance(q, Quota) and (q.device_reserve or q.device_limit is not None):
                raise QuotaConfigError(f"tenant {name!r}: a device quota, no device tier")
        quotas = {
            n: replace(
                q,
                device_reserve=q.host_reserve,
                device_limit=q.host_limit,
                host_reserve=0,
                host_limit=None,
            )
            if isinstance(q, Quota)
            else q
            for n, q in quotas.items()
        }
    return Tenants(quotas, have, pages)


def _keyword_chain(
    spec: KVSpec,
    device_bytes: object,
    host_bytes: object,
    codec: object,
    cold_fraction: object,
    disk_path: object,
    disk_bytes: object,
    remote: object,
) -> Chain:
    """The chain of today's keyword arguments (checked here, with today's errors):
    device, host, cold (``cold_fraction`` of ``host_bytes``), disk, remote."""
    if device_bytes is UNSET or host_bytes is UNSET:
        raise TierConfigError(
            "KVStore needs device_bytes and host_bytes, or a chain of tiers in tiers=[...] "
            "(docs/configuration.md)"
        )
    device = validate.byte_size("device_bytes", device_bytes)
    host = validate.byte_size("host_bytes", host_bytes)
    name = "int8" if codec is UNSET else codec
    if name is not None and not isinstance(name, Codec):  # (an instance: built with options)
        name = validate.registered("codec", name, CODECS)
    fraction = validate.fraction("cold_fraction", 0.25 if cold_fraction is UNSET else cold_fraction)
    sources = None
    if remote is not None:
        sources = list(remote) if isinstance(remote, Sequence) else [remote]
    tiers = shorthand(
        spec,
        device_bytes=device,
        host_bytes=host,
        codec=name,
        cold_fraction=fraction,
        disk=_disk_args(disk_path, disk_bytes),
        remote=cast("list[PageSource] | None", sources),  # (checked by Remote)
    )
    return build_chain(spec, tiers)


def _disk_args(path: object, size: object) -> tuple[str, int] | None:
    """``disk_path`` and ``disk_bytes`` checked (both or neither); the directory itself is
    checked when the store opens (DiskConfigError, nothing created)."""
    if path is None and size is None:
        return None
    if path is None or size is None:
        raise InvalidInputError("disk_path and disk_bytes go together: give both or neither")
    if not isinstance(path, str | os.PathLike):
        raise InvalidTypeError(f"disk_path must be a str or path, got {type(path).__name__}")
    return os.fspath(path), validate.byte_size("disk_bytes", size)
