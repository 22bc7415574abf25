"""`TierKVAwarePolicy`: tierkv's kvaware eviction policy as a cache policy of vLLM's CPU tier.

vLLM 0.33's CPU offloading manager (`CPUOffloadingManager`, also the primary tier of its
tiering manager) takes an out-of-tree `CachePolicy` by module path, no patch to vLLM::

    "kv_connector_extra_config": {"cpu_bytes_to_use": ...,
        "eviction_policy": "TierKVAwarePolicy",
        "cache_policy_module_path": "tierkv.integrations.vllm.policy"}

The adapter keeps vLLM's chunk slots as the policy's slots (``chunk_id``), so
`tierkv.policies.kvaware.KVAwarePolicy` runs unchanged: GreedyDual on use counts, chains
(a chunk's parent is the chunk before it in its request), conversation-shaped admission.
What vLLM does not tell a policy is derived from what it does: a chunk's depth and parent from
the order in which its request's chunks reach the policy (``on_request_access``, head to
tail), the request's leading hits from those already resident then, its length from the chunks
it has shown by the time one is inserted (so a request stored in several steps looks shorter
at first). Admission judges a request's new chunks as one batch when they do not all fit
(``on_store_miss``, before vLLM evicts for them); vLLM cannot decline a store, so a declined
chunk is kept on probation instead: first to be evicted, and a chunk of the policy once it is
used again. It still cost a victim when it came in, which tierkv's page table spares (the
figures: benchmarks/vllm_policy.py, docs/vllm.md).
A use is a chunk a request reused (``on_request_finished``'s reused keys); an insertion is not.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierkv import validate
from tierkv.errors import InvalidInputError, PageStateError
from tierkv.integrations.vllm._vllm import VllmUnavailableError
from tierkv.page_table import MAX_PAGES
from tierkv.policies import create_policy
from tierkv.policies.base import EvictionPolicy, PageHint


def _missing(why: str) -> Any:
    class Missing:
        """Stands in for vLLM's CachePolicy where vLLM is not installed: building raises."""

        def __init__(self, cache_capacity: int) -> None:
            raise VllmUnavailableError(f"vLLM's cache policy interface: {why}")

    return Missing


def _in_order(key_groups: Any, req_context: Any) -> list[Any]:
    """vLLM's `order_request_keys` stand-in (never called without vLLM)."""
    return [k for g in key_groups for k in g]


try:  # vLLM's interface, by name (this module imports without vLLM)
    _base = importlib.import_module("vllm.v1.kv_offload.cpu.policies.base")
    CachePolicy: Any = _base.CachePolicy
    order_request_keys: Any = _base.order_request_keys
except ImportError as exc:
    CachePolicy = _missing(str(exc))
    order_request_keys = _in_order


__all__ = ["TierKVAwarePolicy"]


@dataclass
class _Request:
    """What the policy has seen of one request: its chunks in order, its leading hits."""

    owner: object
    generation: int
    depth: dict[Any, int] = field(default_factory=dict)
    order: list[Any] = field(default_factory=list)
    hits: int = 0
    missed: bool = False
    declined: set[Any] = field(default_factory=set)  # chunks admission declined


class TierKVAwarePolicy(CachePolicy):
    """tierkv's kvaware policy behind vLLM's `CachePolicy` interface (see the module)."""

    policy_name = "kvaware"

    def __init__(self, cache_capacity: int) -> None:
        # (a float or str capacity was a TypeError from inside, 10**12 a MemoryError, 0 and -1
        # a policy that could hold nothing)
        if validate.count("cache_capacity", cache_capacity, 1) > MAX_PAGES:
            raise InvalidInputError(f"cache_capacity must be at most {MAX_PAGES} chunks")
        super().__init__(cache_capacity)
        self._generation = 0
        self._reset()

    def _reset(self) -> None:
        self.chunks: dict[Any, Any] = {}  # key -> vLLM's ChunkStatus
        self._slot_of: dict[Any, int] = {}  # keys the kvaware policy holds
        self._key_at: dict[int, Any] = {}
        self._in_slot: dict[int, Any] = {}  # every chunk's slot (probation's too) -> its key
        self._probation: OrderedDict[Any, None] = OrderedDict()  # declined by admission
        self.policy: EvictionPolicy = create_policy(self.policy_name)
        self.declined = 0  # chunks admission declined (kept on probation), since the reset
        self.policy.bind_slots(self.cache_capacity, self._slot_of)

    # -- per-request hints ---------------------------------------------------------------------
    def _request(self, ctx: Any) -> _Request:
        state = ctx.get_state(_Request)
        if state is None or state.owner is not self or state.generation != self._generation:
            state = _Request(self, self._generation)
            ctx.set_state(state)
        return state

    def on_request_access(self, keys: Iterable[Any], req_context: Any) -> None:
        """Record the request's chunks in order (depth, parent) and its leading hits."""
        r = self._request(req_context)
        for k in keys:
            if k in r.depth:
                continue
            r.depth[k] = len(r.order)
            r.order.append(k)
            chunk = self.chunks.get(k)
            if not r.missed and chunk is not None and chunk.is_ready:
                r.hits += 1
            else:
                r.missed = True

    def _hint(self, key: Any, ctx: Any) -> PageHint:
        r = self._request(ctx)
        d = r.depth.get(key)
        if d is None:  # not announced: the next in the request's order
            self.on_request_access([key], ctx)
            d = r.depth[key]
        n = len(r.order)
        return PageHint(d, d == n - 1, r.hits, r.order[d - 1] if d else None, n)

    # -- vLLM's CachePolicy ---------------------------------------------------------------------
    def get(self, key: Any) -> Any:
        """The chunk of ``key``, or None."""
        return self.chunks.get(key)

    def insert(self, key: Any, chunk: Any, req_context: Any) -> None:
        """A chunk vLLM allocated: kvaware's unless its admission declined it (then on
        probation). Raises InvalidInputError for a chunk id outside the cache, PageStateError
        for a key or a slot held already; nothing changed (a slot out of range was an
        IndexError after the chunk was recorded, a key inserted twice left its old slot
        naming it, and two keys in one slot made evictions answer None)."""
        slot = validate.count("chunk_id", chunk.chunk_id, 0)
        if slot >= self.cache_capacity:
            raise InvalidInputError(
                f"chunk_id {slot} is outside the cache of {self.cache_capacity}"
            )
        if key in self.chunks:
            raise PageStateError(f"chunk {key!r:.40} is in the cache already")
        if slot in self._in_slot:
            raise PageStateError(f"slot {slot} holds another chunk: evict or remove it first")
        hint = self._hint(key, req_context)
        self.chunks[key] = chunk
        self._in_slot[slot] = key
        if key in self._request(req_context).declined:
            self._probation[key] = None
            return
        self._adopt(key, hint)

    def _adopt(self, key: Any, hint: PageHint | None) -> None:
        slot = int(self.chunks[key].chunk_id)
        self._slot_of[key] = slot
        self._key_at[slot] = key
        self.policy.insert_slots([slot], [key], [hint] if hint is not None else None)

    def remove(self, key: Any) -> None:
        """Forget a chunk whose store failed."""
        chunk = self.chunks.pop(key, None)
        if chunk is not None:
            del self._in_slot[int(chunk.chunk_id)]
        if key in self._probation:
            del self._probation[key]
            return
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            del self._key_at[slot]
            self.policy.remove_slots([slot], [key])

    def touch(self, keys: Iterable[Any], req_context: Any) -> None:
        """Uses of chunks: kvaware counts them; a chunk on probation joins the policy."""
        held, slots, missed = [], [], []
        for k in keys:
            if k in self._probation:
                del self._probation[k]
                self._adopt(k, None)
            slot = self._slot_of.get(k)
            if slot is None:
                missed.append(k)
            else:
                held.append(k)
                slots.append(slot)
        if missed:
            self.policy.miss(missed)
        if held:
            self.policy.touch_slots(slots, held)

    def on_store_miss(self, keys: Iterable[Any], req_context: Any) -> None:
        """Chunks a request will store (vLLM calls this once per request, before it evicts
        for them): ghost feedback, and kvaware's admission judges them as one batch when they
        do not all fit, as tierkv's page table asks it."""
        keys = list(keys)
        self.policy.miss(keys)
        if not keys or not self.policy.admits:
            return
        if len(self.chunks) + len(keys) <= self.cache_capacity:
            return
        kept = self.policy.admit_many(keys, [self._hint(k, req_context) for k in keys])
        if kept is not None:
            declined = self._request(req_context).declined
            declined.update(k for k, ok in zip(keys, kept) if not ok)
            self.declined += kept.count(False)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[Any]],
        insertion_only_keys: set[Any],
        reused_keys: set[Any],
        req_context: Any,
    ) -> None:
        """The request's reused chunks are uses, in prefix order; its insertions are not."""
        ordered = order_request_keys(key_groups, req_context)
        self.touch([k for k in ordered if k in reused_keys], req_context)

    def evict(self, n: int, protected: set[Any]) -> list[tuple[Any, Any]] | None:
        """``n`` idle chunks outside ``protected``, chunks on probation first; None (nothing
        changed) when there are not that many."""
        if validate.count("n", n, 0) == 0:  # (-1 answered [], "2" a TypeError)
            return []
        chunks = self.chunks
        out = [
            k for k in self._probation
            if chunks[k].ref_cnt == 0 and k not in protected
        ][:n]  # fmt: skip
        key_at = self._key_at

        def can_evict(slot: int) -> bool:
            k = key_at[slot]
            return bool(chunks[k].ref_cnt == 0) and k not in protected

        want = n - len(out)
        slots = self.policy.evict_slots(want, can_evict) if want else []
        keys = [key_at[s] for s in slots]
        if len(out) + len(slots) < n:
            if slots:
                self.policy.restore_slots(slots, keys, self.policy.evicted_state_slots(slots, keys))
            self.policy.end_batch()  # the batch admission judged is not stored after all
            return None
        for k in out:
            del self._probation[k]
        for s, k in zip(slots, keys):
            del key_at[s]
            del self._slot_of[k]
        gone = [(k, chunks.pop(k)) for k in [*out, *keys]]
        for _, chunk in gone:
            del self._in_slot[int(chunk.chunk_id)]
        return gone

    def clear(self) -> None:
        """Forget every chunk, the policy's history and the requests' state."""
        self._generation += 1
        self._reset()

    def stats(self) -> dict[str, float]:
        """kvaware's own counters and the chunks admission declined."""
        return {**self.policy.stats(), "declined": self.declined}
