"""The sparse and host-side attention path of a :class:`~tierkv.integrations.hf.TieredCache`.

With ``TieredCache(sparse_topk=k)`` or ``TieredCache(host_attention=True)`` a layer's update
only appends the new tokens (leasing no page but the one it writes) and the model's attention
(the ``"tierkv"`` attention function, :mod:`tierkv.attention.hf`) asks this class for the
layer's attention with the query in hand::

    update(k, v)      lease(blocks=[]) -> append -> store.summaries.append(k)  (no history read)
    attend(q, mask)   decode (one query token) and sparse_topk: page_scores(q, summaries,
                        mean_weight)
                        -> select_pages: sink + top-k + recent          (else: every page)
                      host_attention: the chosen pages the host holds and the device does not,
                        and those only the cold tier holds (decoded on the host)
                        -> read on the host, partial attention there   (never sent down)
                      the rest: lease(blocks=those) -> kv_blocks -> partial attention
                      merge (log-sum-exp, exact) -> output

Off by default; with ``k`` covering every page and host attention off the result equals full
attention up to float rounding (the parts are merged exactly, :mod:`.partial`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tierkv import validate
from tierkv.attention.host import cold_only, host_only, read_cold_tokens, read_host_tokens
from tierkv.attention.partial import finish, merge, partial_attention
from tierkv.attention.summaries import KeySummaries, page_scores, select_pages
from tierkv.errors import InvalidInputError, SpecError, TierKVError
from tierkv.spec import KVSpec
from tierkv.tier_names import DEVICE

__all__ = [
    "AttentionNotRoutedError",
    "Pending",
    "SparseCounters",
    "SparseLayers",
    "SparseOptions",
    "set_pending",
    "take_pending",
]


@dataclass(frozen=True)
class SparseOptions:
    """What a :class:`SparseLayers` does.

    Args:
        topk: pages chosen by score at each decode step and layer (besides the sink and the
            recent pages); None: every page.
        recent: the last pages always attended.
        sink: the first pages always attended (the attention sink).
        host: attend on the host the chosen pages the host tier holds and the device does not,
            and those only the cold tier holds (decoded in host memory): True always;
            ``"auto"`` only when they are more than the device tier has room for (free or
            evictable slots) or more than ``queue_bound`` transfer batches are in
            flight (a burst); False never.
        queue_bound: the transfer batches in flight above which ``"auto"`` attends on the host.
        dense_layers: the first layers attend every page even with ``topk`` (Quest keeps 2;
            on SmolLM2 and the language reference the replay in docs/benchmarks.md gained
            0.004 to 0.019 of greedy agreement per dense layer for 0.024 more of the pages).
        max_pages: the most pages a sequence's layer can have (the store's room): ``topk``
            above it is an error.
        mean_weight: the weight in ``[0, 1)`` of a page's mean key in its score against the
            query, the rest Quest's upper bound (0: the bound alone;
            :func:`~tierkv.attention.summaries.page_scores`).
    """

    topk: int | None = None
    recent: int = 2
    sink: int = 1
    host: bool | str = False
    max_pages: int | None = None
    queue_bound: int = 4
    dense_layers: int = 0
    mean_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.topk is not None:
            validate.count("sparse_topk", self.topk, 1)
            if self.max_pages is not None and self.topk > self.max_pages:
                raise InvalidInputError(
                    f"sparse_topk {self.topk} is above the {self.max_pages} pages the store holds"
                )
        validate.count("sparse_recent", self.recent, 0)
        validate.count("sparse_sink", self.sink, 0)
        if self.host != "auto":
            validate.flag("host_attention", self.host)
        validate.count("queue_bound", self.queue_bound, 0)
        validate.count("dense_layers", self.dense_layers, 0)
        validate.fraction("sparse_mean_weight", self.mean_weight)

    @property
    def active(self) -> bool:
        """Whether the path is used at all (top-k or host attention on)."""
        return self.topk is not None or bool(self.host)

    def host_wanted(self, host_pages: int, room: int, in_flight: int) -> bool:
        """Whether ``host_pages`` chosen pages that only the host holds are attended there,
        with ``room`` device slots free or evictable and ``in_flight`` transfer batches."""
        if not host_pages or not self.host:
            return False
        if self.host is True:
            return True
        return host_pages > room or in_flight > self.queue_bound


def sparse_options(
    options: SparseOptions, store: Any, undo: Callable[[], None] | None = None
) -> SparseOptions:
    """``options`` checked against the pages ``store`` holds (device, host and cold tiers).

    Raises InvalidInputError for a ``topk`` above them, after calling ``undo`` (closing a
    store opened for the check)."""
    table = store.tiers.table
    room = sum(table.capacity(t) for t in table.tier_names)
    try:
        return replace(options, max_pages=room)
    except BaseException:
        if undo is not None:
            undo()
        raise


@dataclass
class SparseCounters:
    """What the path did (summed over rows, layers and steps)."""

    decode_attends: int = 0  # (row, layer) attentions of one query token
    decode_pages: int = 0  # pages those had
    decode_chosen: int = 0  # pages they attended
    host_pages: int = 0  # pages attended on the host (from the host or the cold tier)
    host_bytes: int = 0  # their page bytes (read on the host, never sent to the device)
    cold_pages: int = 0  # of those, pages only the cold tier held (decoded on the host)
    cold_bytes: int = 0  # their encoded bytes (read in the cold tier)
    partial_bytes: int = 0  # the host partials' state (what goes to the device instead)
    device_pages: int = 0  # pages attended from the device tier
    append_loads: int = 0  # partly filled last pages brought back to the device to append to
    attend_loads: int = 0  # pages loaded to the device to be attended there (cold ones)

    def as_dict(self) -> dict[str, Any]:
        """The counters and the share of pages a decode step attended."""
        share = self.decode_chosen / self.decode_pages if self.decode_pages else 1.0
        return {**self.__dict__, "decode_page_share": share}


class SparseLayers:
    """The sparse / host-side attention of one cache's layers (module docstring)."""

    def __init__(self, store: Any, spec: KVSpec, options: SparseOptions) -> None:
        self._store = store
        self.spec = spec
        self.options = options
        self.summaries: KeySummaries = store.summaries  # the store's: per page key
        self.counters = SparseCounters()

    def update(
        self,
        run: Callable[[Coroutine[Any, Any, Any]], Any],
        ids: list[str],
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        last: bool,
    ) -> None:
        """A cache's layer update: append (with ``run``, the cache's store driver), then leave
        the layer pending for the ``"tierkv"`` attention function."""
        run(self.append(ids, layer, k, v, last))
        set_pending(Pending(self, run, ids, layer))

    async def append(
        self, ids: Sequence[str], layer: int, k: torch.Tensor, v: torch.Tensor, last: bool
    ) -> None:
        """Append the rows' new KV of ``layer`` (``[B, H, n, D]``) leasing only what it writes;
        ``last``: the model's last layer (the store's step ends)."""
        store = self._store
        starts = [store.sequence(sid).kv_len_of(layer) for sid in ids]
        t = self.spec.page_tokens
        tails = [store.sequence(sid).pages(layer)[-1] for sid, s in zip(ids, starts) if s % t]
        if tails:  # (the appends load these if they left the device: counted, not hidden)
            on_device = store.tiers.table.readable(tails, DEVICE)
            self.counters.append_loads += len(tails) - len(on_device)
        async with store.lease(list(ids), [layer], blocks={}) as lease:
            for b, sid in enumerate(ids):
                await lease.append(sid, layer, k[b], v[b])
        for b, sid in enumerate(ids):
            self.summaries.append(store.sequence(sid).pages(layer), k[b], starts[b], t)
        if last:
            store.step()

    async def attend(
        self,
        ids: Sequence[str],
        layer: int,
        q: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Attention ``[B, Hq, n, D]`` of the rows' queries ``q`` over ``layer``'s pages.

        ``mask`` is the model's ``[B, 1, n, S]`` mask (bool: True attends; float: added), or
        None for causal. Raises SpecError when its shape does not match the sequences.
        """
        outs = [
            await self._attend_row(sid, layer, q[b : b + 1], _row_mask(mask, b), scale)
            for b, sid in enumerate(ids)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _count(self, on_device: list[int], pages: int, chosen: int, n: int) -> None:
        c = self.counters
        c.device_pages += len(on_device)
        if n == 1:
            c.decode_attends += 1
            c.decode_pages += pages
            c.decode_chosen += chosen

    def _choose(self, sid: str, layer: int, q: torch.Tensor, pages: int, scale: float) -> list[int]:
        topk = self.options.topk
        if topk is None or q.shape[2] != 1 or layer < self.options.dense_layers:
            return list(range(pages))
        keys = self._store.sequence(sid).pages(layer)[:pages]
        table = self.summaries.table(keys)
        scores = page_scores(q[0, :, 0], table, scale, self.options.mean_weight)
        return select_pages(scores, topk, self.options.sink, self.options.recent)

    async def _attend_row(
        self, sid: str, layer: int, q: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        store, spec = self._store, self.spec
        seq = store.sequence(sid)
        total, t = seq.kv_len_of(layer), spec.page_tokens
        n = q.shape[2]
        if mask is not None and mask.shape[-1] != total:
            raise SpecError(f"mask covers {mask.shape[-1]} keys, the sequence has {total}")
        pages = seq.pages(layer)
        chosen = self._choose(sid, layer, q, len(pages), scale)
        on_host, on_cold = self._host_blocks(pages, chosen)
        elsewhere = {*on_host, *on_cold}
        on_device = [b for b in chosen if b not in elsewhere]
        qpos = torch.arange(total - n, total)
        # the pages attended on the host are read first (their copies in host memory): the
        # device lease below may make room by moving host pages down the tiers
        host_kv = self._read_host(pages, on_host, on_cold, total) if elsewhere else None
        async with store.lease([sid], [layer], blocks={sid: on_device}) as lease:
            self.counters.attend_loads += lease.waited_pages
            k, v = lease.kv_blocks(sid, layer, on_device)
            k, v = k.unsqueeze(0).to(q.device), v.unsqueeze(0).to(q.device)
        kpos = _positions(on_device, t, total)
        bias = _bias(mask, qpos, kpos, q.device)
        self._count(on_device, len(pages), len(chosen), n)
        if host_kv is None:  # one part: plain attention (SDPA), no merge to do
            return _sdpa(q, k, v, scale, bias)
        parts = [partial_attention(q, k, v, scale, bias)]  # (the device part, then the host's)
        hk, hv, kpos = host_kv
        bias = _bias(mask, qpos, kpos, torch.device("cpu"))
        part = partial_attention(q.cpu(), hk.unsqueeze(0), hv.unsqueeze(0), scale, bias)
        self.counters.partial_bytes += part.nbytes
        parts.append(part.to(q.device))
        return finish(merge(parts), q.dtype)

    def _host_blocks(self, pages: Sequence[bytes], chosen: list[int]) -> tuple[list[int], ...]:
        """Of the ``chosen`` blocks, those attended on the host: the ones only the host tier
        holds, and the ones only the cold tier holds (when the option says so)."""
        if not self.options.host:
            return [], []
        tiers = self._store.tiers
        keys = [pages[b] for b in chosen]
        host, cold = host_only(tiers, keys), cold_only(tiers, keys)
        if not self.options.host_wanted(len(host) + len(cold), *_pressure(self._store)):
            return [], []
        return [b for b in chosen if pages[b] in host], [b for b in chosen if pages[b] in cold]

    def _read_host(
        self, pages: Sequence[bytes], on_host: list[int], on_cold: list[int], total: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V ``[H, S, D]`` and the positions of the blocks read on the host (host pages
        gathered, cold pages decoded there), the last page cut at ``total`` tokens."""
        spec, tiers, c = self.spec, self._store.tiers, self.counters
        ks, vs, ps = [], [], []
        for blocks, read in ((on_host, read_host_tokens), (on_cold, read_cold_tokens)):
            if not blocks:
                continue
            kv = read(tiers, spec, [pages[b] for b in blocks])
            kpos = _positions(blocks, spec.page_tokens, total)
            ks.append(kv[0, :, : kpos.numel()])
            vs.append(kv[1, :, : kpos.numel()])
            ps.append(kpos)
        c.host_pages += len(on_host) + len(on_cold)
        c.host_bytes += (len(on_host) + len(on_cold)) * spec.page_bytes
        if on_cold:  # (a store without a cold tier has no cold slot size)
            c.cold_pages += len(on_cold)
            c.cold_bytes += len(on_cold) * tiers.cold.slot_bytes
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1), torch.cat(ps)


class AttentionNotRoutedError(TierKVError, NotImplementedError):
    """A sparse or host-attending cache's layer was never attended by the ``"tierkv"``
    function (the model's attention is another): call :func:`route` on the model."""


@dataclass(frozen=True)
class Pending:
    """A layer appended by ``update`` whose attention is still to come."""

    layers: SparseLayers
    run: Callable[[Coroutine[Any, Any, Any]], Any]
    ids: list[str]
    layer: int


_PENDING: ContextVar[Pending | None] = ContextVar("tierkv_pending_layer", default=None)


def set_pending(pending: Pending) -> None:
    """Leave ``pending`` for the next attention call; raises AttentionNotRoutedError when the
    one before it was never taken (the model does not use the ``"tierkv"`` function)."""
    before = _PENDING.get()
    if before is not None and before.layers is pending.layers:
        _PENDING.set(None)
        raise AttentionNotRoutedError(
            f"layer {before.layer} of a TieredCache with sparse_topk / host_attention was "
            f"not attended by the {'tierkv'} attention function: call "
            "tierkv.attention.hf.route(model) first"
        )
    _PENDING.set(pending)


def take_pending(layer: int) -> Pending | None:
    """The pending layer if it is ``layer`` (then no longer pending), else None."""
    got = _PENDING.get()
    if got is None or got.layer != layer:
        return None
    _PENDING.set(None)
    return got


def _pressure(store: Any) -> tuple[int, int]:
    """The device tier's room (free and evictable slots) and the transfer batches in flight."""
    table = store.tiers.table
    room = table.capacity(DEVICE) - table.used(DEVICE) + table.evictable(DEVICE)
    e = store.engine_stats()
    return room, e.submitted - e.completed - e.failed - e.cancelled


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None
) -> torch.Tensor:
    """Attention of one part (grouped-query heads; ``bias`` additive or None)."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    if k.shape[2] == 0:
        return torch.zeros_like(q)
    if bias is None:
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale)
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), bias.to(q.dtype), scale=scale
    )
    return out.nan_to_num_(0.0)  # a row with every key masked (padding) attends nothing


def _row_mask(mask: torch.Tensor | None, b: int) -> torch.Tensor | None:
    if mask is None:
        return None
    return mask[b : b + 1] if mask.shape[0] > 1 else mask


def _positions(blocks: Sequence[int], t: int, total: int) -> torch.Tensor:
    """Token positions of ``blocks`` in order (the last page up to ``total``)."""
    if not blocks:
        return torch.empty(0, dtype=torch.int64)
    idx = torch.tensor(blocks, dtype=torch.int64).unsqueeze(1) * t + torch.arange(t)
    flat = idx.flatten()
    return flat[flat < total]


def _bias(
    mask: torch.Tensor | None, qpos: torch.Tensor, kpos: torch.Tensor, device: torch.device
) -> torch.Tensor | None:
    """Additive ``[1, 1|H, n, len(kpos)]`` bias: the model's mask at those keys, else causal
    (None when every key precedes every query, as at decode)."""
    if mask is None:
        if kpos.numel() == 0 or int(kpos.max()) <= int(qpos.min()):
            return None
        allowed = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
        return torch.where(allowed, 0.0, float("-inf")).view(1, 1, *allowed.shape).to(device)
    cols = mask.index_select(-1, kpos.to(mask.device))
    if cols.dtype == torch.bool:
        return torch.where(cols, 0.0, float("-inf")).to(device)
    return cols.float().to(device)
