"""A Hugging Face transformers ``Cache`` whose K/V live in a tierkv store.

::

    from tierkv.integrations.hf import TieredCache

    with TieredCache(model.config, dtype=model.dtype, device_bytes=8 << 20,
                     host_bytes=256 << 20) as cache:
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False, cache=cache)
        print(cache.stats()["page_loads"])

Prefix reuse: a ``Cache`` never sees token ids, so a cache that should share its prompt's KV
with other caches on the same store is told the prompt first::

    with TieredCache(store=store) as cache:
        reused = cache.set_prompt(inputs["input_ids"], inputs.get("attention_mask"))
        model.generate(**inputs, cache=cache, ...)   # computes only the tokens after `reused`

Its full prompt blocks then become reusable by the next cache whose prompt starts the same way.
``copy.deepcopy(cache)`` is an independent cache on the same store (shared full blocks, the
rest copied); a store the original opened closes when the last of its copies closes.

How a model's K/V reach the store: each batch row is one store sequence, each model layer one
store layer, and each forward one store step (:mod:`tierkv.step`), planned at layer 0::

    update(k, v, 0)   store.step_plan(rows, tokens=n), entered with no loop run where its
                      room is there at once: pins, loads, new pages, row indices
    update(k, v, L)   no wait for a group that landed or loaded at once (no loop run), one
                      append (one cat into the page, or one index_copy_), one gather (one
                      index_select into the cache's buffer); at a group's last layer with
                      inline copies, the next group loaded; the last layer: the step's end
                      (no loop run unless it started a write-behind or prefetch)
    returned          [B, H_kv, S, D] K and V: views of the gathered copy

so the device tier needs a few layers' pages of the batch at a time; the others wait on the
host tier, and the next group of layers loads while the model computes. A store the cache
opens runs in the caller's thread, a shared one on its loop thread (:mod:`.hf_store`). The
returned K/V are copies gathered from the pages, so greedy outputs are bit-identical to
``DynamicCache`` (live pages are never compressed unless ``compress_live``); they are views of
one buffer of the cache that every layer's gather reuses, valid until its next ``update()``
(attention uses them first: no gather allocates). A padded row (a zero in
``attention_mask``) shares nothing.

This file stays whole (over 400 lines): the cache and its layer class are one transformers
``Cache`` implementation; how it reaches its store and its rows' helpers are apart
(:mod:`.hf_store`, :mod:`.hf_rows`).

Unsupported, and raised as :class:`UnsupportedCacheOperation` (a ``NotImplementedError``):
cache edits that the store cannot express yet (``crop`` of a non-zero count, as assisted and
contrastive decoding do; ``reorder_cache``, as beam search does; ``batch_repeat_interleave``
and ``batch_select_indices``), a batch size that changes after the first update, and models
with sliding-window or other non-full-attention layers.

This file stays whole (over 400 lines): transformers' Cache interface, one class and its layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tierkv import validate
from tierkv.attention.sparse import SparseLayers, SparseOptions, sparse_options
from tierkv.errors import InvalidTypeError, SpecError, StoreClosedError, TierKVError
from tierkv.integrations.hf_rows import add_rows, copy_rows, token_rows
from tierkv.integrations.hf_store import (
    Driver,
    LocalStore,
    StoreOwner,
    ThreadStore,
    open_store,
)
from tierkv.spec import KVSpec, parse_dtype
from tierkv.step import LayerStep, StepPlan
from tierkv.store import KVStore
from tierkv.sync import SyncKVStore
from tierkv.tenant_names import check_salt, check_tenant
from tierkv.tenants import tenant_index

_cache_ids = itertools.count()


class UnsupportedCacheOperation(TierKVError, NotImplementedError):
    """A cache operation that :class:`TieredCache` does not support (see the module docstring)."""


def kv_spec_for(
    config: Any, dtype: torch.dtype | str | None = None, page_tokens: int = 16
) -> KVSpec:
    """The :class:`KVSpec` of a decoder's config (layers, KV heads, head dim).

    ``dtype`` defaults to the config's ``dtype`` (float32 when it names none). Raises SpecError
    for a config without the attention fields of a Llama-family decoder.
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        layers = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
    except AttributeError as exc:
        raise SpecError(f"config lacks a decoder's attention fields: {exc}") from exc
    if dtype is None:
        dtype = getattr(text, "dtype", None) or torch.float32
    return KVSpec(layers, kv_heads, head_dim, parse_dtype(dtype), page_tokens)


def _check_full_attention(config: Any) -> None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"} or getattr(text, "sliding_window", None):
        raise UnsupportedCacheOperation(
            f"TieredCache supports full-attention layers only, not {sorted(types)} "
            f"(sliding_window={getattr(text, 'sliding_window', None)})"
        )


class TieredLayer(CacheLayerMixin):
    """One model layer of a :class:`TieredCache`: holds no tensors, only its token count."""

    is_sliding = False
    is_croppable = False

    def __init__(self, cache: TieredCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.is_initialized = False

    def offload(self) -> None:
        pass  # the store decides where pages live

    def prefetch(self) -> None:
        pass

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise UnsupportedCacheOperation(
                "TieredCache cannot crop tokens (the store has no truncate yet): "
                "assisted and contrastive decoding are unsupported"
            )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedCacheOperation("TieredCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise UnsupportedCacheOperation("TieredCache cannot repeat batch rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedCacheOperation("TieredCache cannot select batch rows")


class TieredCache(Cache):
    """A transformers ``Cache`` backed by a tierkv store (see the module docstring).

    Args:
        config: the model's config (layers, KV heads, head dim, dtype); optional with ``store``.
        store: a :class:`SyncKVStore` to share (several caches, one store); the cache then
            releases its sequences on :meth:`close` but leaves the store open. Without it the
            cache opens its own store with ``device_bytes``, ``host_bytes`` and ``store_kwargs``
            (see :class:`tierkv.KVStore`) and closes it on :meth:`close`.
        dtype: the KV dtype; must be the model's (default: the config's, else float32).
        page_tokens: tokens per page.
        prefetch: load the coming layers' pages in the background while the model computes.
        prefetch_layers: how many layers load ahead of the one computing (the step's window,
            :mod:`tierkv.step`; it shrinks where the device cannot hold that many). Layers load
            in groups of that many, and each group has a fixed cost in the store (its pins,
            eviction, copy and rows): 3 (10 groups a token on SmolLM2's 30 layers) took
            ~30 us a layer call off 2's inside ``generate()``, for ~9% more page loads. Where
            the copies run inline on this thread (a store the cache opened, cpu backend), the
            same room holds one group of twice as many layers, loaded once the group before
            is read (5 groups a token on SmolLM2: ``StepPlan.done_with``).
        sparse_topk, sparse_recent, host_attention: decode attends the ``sparse_topk`` best
            pages by key summary plus the first and the ``sparse_recent`` last; pages only the
            host holds are attended there (``"auto"``: when they exceed the device's room or
            a transfer burst is on; :mod:`tierkv.attention.sparse`; the model's
            attention must be ``"tierkv"``: :func:`tierkv.attention.hf.route`). Off: None/False.
        salt: the cache salt of every row (str or bytes; vLLM's ``cache_salt``): its prompts
            share cached blocks only with caches of the same salt (:meth:`KVStore.add_sequence`).
        tenant: the store's tenant charged for every row's pages (its quotas apply; give the
            store's ``tenants=`` in ``store_kwargs``, or share a store that has them).
        sparse_dense_layers: with ``sparse_topk``, the first layers attend every page (the
            first layers of a decoder spread their attention: Quest keeps 2 dense).
        sparse_mean_weight: with ``sparse_topk``, the weight in ``[0, 1)`` of a page's mean
            key in its score, the rest Quest's bound (0: the bound alone;
            :func:`tierkv.attention.summaries.page_scores`).

    Raises:
        UnsupportedCacheOperation: a config with sliding-window (or other) attention layers.
        SpecError: no config and no store, a config without attention fields, budgets that hold
            no page, or (at an update) K/V whose head count, head dim or dtype differ from the
            spec.
        InvalidInputError: ``sparse_topk`` < 1 or above the store's pages, ``sparse_recent`` or
            ``sparse_dense_layers`` < 0, ``sparse_mean_weight`` outside ``[0, 1)``.
        TenantError: a salt that is not str or bytes of 1-256 bytes (before a store opens).
        InvalidTypeError: a ``store`` that is not a SyncKVStore (an async KVStore).
    """

    def __init__(
        self,
        config: Any = None,
        *,
        store: SyncKVStore | None = None,
        device_bytes: int | None = None,
        host_bytes: int | None = None,
        dtype: torch.dtype | str | None = None,
        page_tokens: int = 16,
        prefetch: bool = True,
        prefetch_layers: int = 3,
        sparse_topk: int | None = None,
        sparse_recent: int = 2,
        sparse_dense_layers: int = 0,
        sparse_mean_weight: float = 0.0,
        host_attention: bool | str = False,
        salt: str | bytes | None = None,
        tenant: str | None = None,
        **store_kwargs: Any,
    ) -> None:
        if store is not None and not isinstance(store, SyncKVStore):  # (an AttributeError)
            raise InvalidTypeError(
                f"store must be a SyncKVStore, got {type(store).__name__} (a KVStore is async: "
                "open a tierkv.SyncKVStore with the same arguments to share it)"
            )
        prefetch_layers = validate.count("prefetch_layers", prefetch_layers, 1)
        raw_salt = check_salt(salt)
        if tenant is not None:
            check_tenant(tenant)
        sparse = SparseOptions(
            sparse_topk,
            sparse_recent,
            host=host_attention,
            dense_layers=sparse_dense_layers,
            mean_weight=sparse_mean_weight,
        )
        driver: Driver
        if store is None:
            if config is None or device_bytes is None or host_bytes is None:
                raise SpecError("TieredCache needs a store, or config, device_bytes and host_bytes")
            spec = kv_spec_for(config, dtype, page_tokens)
            _check_full_attention(config)
            driver = open_store(
                spec, device_bytes=device_bytes, host_bytes=host_bytes, **store_kwargs
            )
            owner: StoreOwner | None = StoreOwner(driver)
        else:
            driver = ThreadStore(store)
            owner = None
        try:  # a tenant the store lacks: refused here, not at the first forward
            tenant_index(driver.store.tenants, tenant)
        except TierKVError:
            if owner is not None:
                owner.drop()  # (the store this cache opened closes again)
            raise
        sparse = sparse_options(sparse, driver.store, owner.drop if owner is not None else None)
        self._setup(driver, owner, prefetch_layers if prefetch else 0, sparse, raw_salt, tenant)

    def _setup(
        self,
        driver: Driver,
        owner: StoreOwner | None,
        prefetch: int,
        sparse: SparseOptions,
        salt: bytes | None,
        tenant: str | None,
    ) -> None:
        self.spec = driver.store.spec
        self._salt = salt
        self._tenant = tenant
        self._driver = driver
        self._owner = owner  # the store this cache (and its copies) opened, else None
        self.prefetch_layers = 0 if sparse.active else prefetch  # 0: no prefetch
        self._sparse = SparseLayers(driver.store, self.spec, sparse) if sparse.active else None
        self._prefix = f"hf-{next(_cache_ids)}"
        self._seq_ids: list[str] = []
        self._closed = False
        self._plan: StepPlan | None = None  # the step of the forward under way
        self._out: torch.Tensor | None = None  # what each layer's K/V are gathered into
        self._layers = [TieredLayer(self, i) for i in range(self.spec.num_layers)]
        self._local = isinstance(driver, LocalStore)  # (read on every layer call)
        self._cpu_pages = driver.store.tiers.pages.device.type == "cpu"
        self._last = self.spec.num_layers - 1
        super().__init__(layers=list(self._layers))

    def _update(
        self, layer: TieredLayer, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._closed:
            raise StoreClosedError("TieredCache is closed")
        batch, n = k.shape[0], k.shape[2]
        if not self._seq_ids:
            self._start(batch)
        elif batch != len(self._seq_ids):
            raise UnsupportedCacheOperation(
                f"batch size changed from {len(self._seq_ids)} to {batch} on a TieredCache"
            )
        idx = layer.layer_idx
        if self._sparse is not None:  # append only; the "tierkv" attention reads the pages
            last = idx == self.spec.num_layers - 1
            self._sparse.update(self._driver.run, self._seq_ids, idx, k, v, last)
            layer.length += n
            return k, v
        plan = self._plan
        if idx == 0 and plan is not None:  # a forward that stopped half way: its plan
            self._end_plan()
            plan = None
        # a layer of a group that has landed waits for nothing: no loop run (tierkv.step); at
        # a group's first layer the next group's task starts, and the loop runs a few turns
        # (no wait) to submit its loads. Only where this thread drives the store (a shared
        # store's state is its loop's)
        driver = self._driver
        local = self._local
        if idx == 0 and local:  # the step planned and entered with no loop run where it can
            plan = self._enter_now(n)
        step = plan.layer_now(idx, enter=True) if plan is not None and local else None
        if step is not None:
            if TYPE_CHECKING:
                assert plan is not None and isinstance(driver, LocalStore)
            try:
                started, plan.starting = plan.starting, None
                if started is not None and not started.done():  # (else loaded in layer_now)
                    driver.turn(started.done)
                step.append(k, v)
                keys, values = step.kv(out=self._gather_buffer(step))
                plan.done_with(step)  # (a window of one group: the next group loads now)
                started, plan.starting = plan.starting, None
                if started is not None and not started.done():
                    driver.turn(started.done)
            except BaseException:
                self._end_plan()
                raise
            if idx == self._last:  # the step's end, with no loop run where it can
                self._plan = None
                if not driver.leave(plan):
                    driver.run(plan.__aexit__(None, None, None))
                    driver.store.step()
        else:
            keys, values = self._driver.run(self._layer_step(idx, k, v, step))
        layer.length += n
        if self._cpu_pages:  # (K/V on another device than the cpu's pages are refused)
            return keys, values
        if keys.device != k.device:
            keys, values = keys.to(k.device), values.to(k.device)
        return keys, values

    def _enter_now(self, tokens: int) -> StepPlan | None:
        """The forward's step, planned and entered here (the admission had its room at
        once: :meth:`LocalStore.enter`), or None (then the loop run of layer 0 does it)."""
        driver = self._driver
        assert isinstance(driver, LocalStore)
        plan = self._step_plan(tokens)
        if not driver.enter(plan):
            return None
        self._plan = plan
        return plan

    def _step_plan(self, tokens: int) -> StepPlan:
        """The step of a forward of ``tokens`` new tokens a row. Layers load in groups of
        ``prefetch_layers``, the next while one computes; where this thread drives the store
        and a window's copy would run inline here (the cpu backend: no overlap to gain), the
        same room holds one group of twice that, loaded once the one before is read
        (``window=1``): half the groups a token, each with its fixed cost in the store."""
        store = self._driver.store
        ahead = self.prefetch_layers
        if ahead and self._local:
            spec = self.spec
            pages = -(-(self._layers[0].length + tokens) // spec.page_tokens)
            window = len(self._seq_ids) * pages * 2 * ahead * spec.page_bytes
            if store.tiers.engine.runs_inline(window):
                return store.step_plan(self._seq_ids, tokens=tokens, ahead=2 * ahead, window=1)
        return store.step_plan(self._seq_ids, tokens=tokens, ahead=ahead)

    def _gather_buffer(self, step: LayerStep) -> torch.Tensor:
        """The one buffer every layer's K/V are gathered into (grown by doubling): attention
        uses a layer's K/V before the next layer's update, so no gather allocates."""
        need = step.gather_numel()
        out = self._out
        if out is None or out.numel() < need:
            have = 0 if out is None else out.numel()
            device = self._driver.store.tiers.pages.device
            out = torch.empty(max(need, 2 * have), dtype=self.spec.dtype, device=device)
            self._out = out
        return out

    def _start(self, batch: int) -> None:
        ids = [f"{self._prefix}/{b}" for b in range(batch)]
        # No token ids reached this cache (no set_prompt): its blocks stay private.
        self._driver.run(
            add_rows(self._driver.store, ids, [None] * batch, self._salt, self._tenant)
        )
        self._seq_ids = ids

    def set_prompt(self, input_ids: Any, attention_mask: Any = None) -> int:
        """Declare the prompt's token ids before ``generate()``; returns the tokens reused.

        ``input_ids`` is ``[B, S]`` (a tensor or nested lists; one row may be a flat list).
        The longest prefix (whole pages, the same for every row, at least one token left)
        whose KV the store holds is taken from it: the cache then reports that length and
        ``generate()`` computes only the tokens after it. The rows' full prompt blocks become
        reusable by other caches on the store once computed. A row with padding (a zero in
        ``attention_mask``) reuses and shares nothing.

        Raises UnsupportedCacheOperation when the cache already holds tokens (``reset()``
        first), StoreClosedError after close, InvalidTypeError / SpecError for bad ids.
        """
        if self._closed:
            raise StoreClosedError("TieredCache is closed")
        if self._seq_ids:
            raise UnsupportedCacheOperation(
                "set_prompt on a TieredCache that holds tokens: call reset() first"
            )
        rows = token_rows(input_ids, "input_ids")
        masks = token_rows(attention_mask, "attention_mask") if attention_mask is not None else None
        if masks is not None and [len(m) for m in masks] != [len(r) for r in rows]:
            raise SpecError("attention_mask and input_ids differ in shape")
        decl: list[Sequence[int] | None] = [
            None if masks is not None and not all(masks[b]) else rows[b] for b in range(len(rows))
        ]
        ids = [f"{self._prefix}/{b}" for b in range(len(rows))]
        reused = self._driver.run(add_rows(self._driver.store, ids, decl, self._salt, self._tenant))
        self._seq_ids = ids
        for layer in self._layers:
            layer.length = reused
        return reused

    async def _layer_step(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, step: LayerStep | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # One run on the store's loop per update. The forward is one step of the store
        # (tierkv.step): planned at layer 0, ended after the last layer; each layer waits for
        # its pages (loaded ahead), appends and gathers with precomputed indices.
        store = self._driver.store
        plan = self._plan
        if plan is None:
            plan = self._step_plan(k.shape[2])
            await plan.__aenter__()
            self._plan = plan
        try:
            if step is None:
                step = await plan.layer(layer)
            step.append(k, v)
            kv = step.kv(out=self._gather_buffer(step))
            plan.done_with(step)
        except BaseException as exc:
            self._plan = None
            await plan.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        if layer == self.spec.num_layers - 1:
            self._plan = None
            await plan.__aexit__(None, None, None)
            store.step()
        return kv

    def _end_plan(self) -> None:
        plan, self._plan = self._plan, None
        if plan is not None:
            self._driver.run(plan.__aexit__(None, None, None))

    def reset(self) -> None:
        """Drop every token (the store's sequences are released); the cache stays usable."""
        self._end_plan()
        self._release()
        for layer in self.layers:
            layer.reset()

    # -- life cycle and figures ----------------------------------------------------------
    @property
    def store(self) -> KVStore:
        """The :class:`~tierkv.KVStore` holding the cache's pages (shared or its own)."""
        return self._driver.store

    def stats(self) -> dict[str, Any]:
        """The store's figures (:meth:`tierkv.KVStore.stats`; ``"sparse"``: the sparse path's)."""
        got = self._driver.call(self._driver.store.stats)
        if self._sparse is not None:
            got["sparse"] = self._sparse.counters.as_dict()
        return got

    def full_kv_bytes(self) -> int:
        """Page bytes of the cache's tokens in all layers (what an all-resident tier holds)."""
        return len(self._seq_ids) * self.spec.bytes_for(self.get_seq_length())

    def _release(self) -> None:
        ids, self._seq_ids = self._seq_ids, []
        store = self._driver.store
        for sid in ids:
            self._driver.run(store.release(sid))

    def close(self) -> None:
        """Release the store's sequences (and close the store if the cache opened it and no
        copy of the cache still uses it).

        Idempotent; later updates raise StoreClosedError.
        """
        if self._closed:
            return
        self._closed = True
        self._out = None
        try:
            self._end_plan()
            self._release()
        finally:
            if self._owner is not None:
                self._owner.drop()

    def __deepcopy__(self, memo: dict[int, Any]) -> TieredCache:
        """An independent cache on the same store holding the same tokens and KV.

        Full blocks with content keys are shared (they never change); the rest is copied
        page by page. Raises StoreClosedError for a closed cache, TierKVError when the store
        has no room for the copy.
        """
        if self._closed:
            raise StoreClosedError("TieredCache is closed: nothing to copy")
        if self._sparse is not None:
            raise UnsupportedCacheOperation("a TieredCache with sparse attention cannot be copied")
        new = TieredCache.__new__(TieredCache)
        if self._owner is not None:
            self._owner.refs += 1
        new._setup(
            self._driver,
            self._owner,
            self.prefetch_layers,
            SparseOptions(),
            self._salt,
            self._tenant,
        )
        try:
            if self._seq_ids:
                ids = [f"{new._prefix}/{b}" for b in range(len(self._seq_ids))]
                self._driver.run(copy_rows(self._driver.store, self._seq_ids, ids))
                new._seq_ids = ids
        except BaseException:
            new.close()
            raise
        for mine, theirs in zip(self._layers, new._layers):
            theirs.length = mine.length
            theirs.is_initialized = mine.is_initialized
            if mine.is_initialized:
                theirs.device = mine.device
        memo[id(self)] = new
        return new

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TieredCache(layers={self.spec.num_layers}, tokens={self.get_seq_length()}, "
            f"rows={len(self._seq_ids)})"
        )
