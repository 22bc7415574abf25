"""`TierKVColdTier`: vLLM's CPU-tier chunks in a cold pool of host RAM, encoded by a tierkv codec.

Lossless unless the operator names a lossy codec. The default, ``none``, keeps each chunk's
bytes as they are (bit-exact, NaN and inf included); ``fp16``, ``bf16``, ``int8`` and
``int8-group`` (`tierkv.codecs`, docs/codecs.md) are lossy and only used when named: a chunk
then comes back within the codec's stated error bound (`Codec.error_bound`, elementwise), or,
for ``int8``, 1.99x smaller for fp16 KV. A lossy codec views a chunk as KV elements of vLLM's
KV dtype (``float16``, ``bfloat16``, ``float32``), ``head_dim`` of them per row: its bound holds
per element whatever the layout. A chunk holding NaN or inf cannot be encoded by a lossy codec:
its store fails (vLLM is told), nothing is kept.

The pool is one preallocated ``[slots, encoded_bytes]`` array of ``cold_bytes`` (``none``: the
chunk's bytes, copied by numpy; a lossy codec: its header, scales and payload, by torch); a store
evicts the least recently used chunks (never one a load is reading). Each slot keeps the
CRC-32C of its encoded bytes, checked before it is decoded: a slot that fails is a miss,
dropped, never served. Lookups answer HIT or MISS at once from the index; encodes and decodes
run on the tier's own threads.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, ClassVar

import numpy as np
import torch

from tierkv import page_sums
from tierkv.codecs import Codec, create_codec
from tierkv.errors import SpecError, TierFullError, TierKVError
from tierkv.integrations.vllm._vllm import LookupResult, Medium
from tierkv.integrations.vllm.config import Field, VllmTierConfigError
from tierkv.integrations.vllm.tier import TierKVTierBase, result
from tierkv.spec import KVSpec, parse_dtype

__all__ = ["LOSSY_DTYPES", "TierKVColdTier", "chunk_spec"]

log = logging.getLogger("tierkv.integrations.vllm")

LOSSY_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32"}
"""vLLM's KV dtypes a lossy codec takes (vLLM's name -> tierkv's)."""


def chunk_spec(codec: Codec, chunk_bytes: int, kv_dtype: str, head_dim: int) -> KVSpec:
    """The page layout ``codec`` sees a vLLM chunk as: one layer, one head of ``head_dim``,
    as many tokens as fill the chunk. A lossless codec sees bytes (fp8, any chunk size).
    Raises VllmTierConfigError where a lossy codec cannot take the chunk."""
    if codec.lossless:
        return KVSpec(1, 1, chunk_bytes // 2, dtype=parse_dtype("fp8"), page_tokens=1)
    if codec.needs_layers:
        raise VllmTierConfigError(f"codec {codec.name!r} needs page layers: not for vLLM chunks")
    dtype = LOSSY_DTYPES.get(kv_dtype)
    if dtype is None:
        raise VllmTierConfigError(
            f"the lossy codec {codec.name!r} takes KV dtypes {sorted(LOSSY_DTYPES)}, vLLM's is "
            f"{kv_dtype!r} (codec 'none' takes any)"
        )
    row = 2 * head_dim * parse_dtype(dtype).itemsize
    if chunk_bytes % row:
        raise VllmTierConfigError(
            f"a chunk of {chunk_bytes} bytes is not whole rows of head_dim {head_dim} {dtype} "
            "(K and V)"
        )
    spec = KVSpec(1, 1, head_dim, dtype=parse_dtype(dtype), page_tokens=chunk_bytes // row)
    try:
        codec.encoded_bytes(spec)  # SpecError: a dtype or group size the codec refuses
    except SpecError as exc:
        raise VllmTierConfigError(f"codec {codec.name!r}: {exc}") from exc
    return spec


class TierKVColdTier(TierKVTierBase):
    """A vLLM secondary tier: a cold pool of encoded chunks in host RAM.

    Config::

        {"type": "TierKVColdTier", "module_path": "tierkv.integrations.vllm",
         "cold_bytes": 17179869184}

    Fields: ``cold_bytes`` (required: the pool, preallocated), ``codec`` (``"none"``: lossless;
    a lossy one only when named: ``fp16``, ``bf16``, ``int8``, ``int8-group``),
    ``codec_options`` (e.g. ``{"group_size": 64}``), ``head_dim`` (128: the row a lossy codec
    sees), ``threads`` (2: encode / decode threads), ``locality``, ``drain_timeout``.
    """

    medium: ClassVar[Any] = Medium.CPU if Medium is not None else None
    FIELDS: ClassVar[dict[str, Field]] = {
        "cold_bytes": Field((int,), minimum=1),
        "codec": Field((str,), "none"),
        "codec_options": Field((dict, type(None)), None),
        "head_dim": Field((int,), 128, minimum=1),
        "threads": Field((int,), 2, minimum=1, maximum=256),
    }

    def _open(self, o: dict[str, Any]) -> None:
        try:
            self.codec = create_codec(o["codec"], **(o["codec_options"] or {}))
        except (TierKVError, KeyError) as exc:  # UnknownCodecError, SpecError (an option)
            raise VllmTierConfigError(
                f"TierKVColdTier tier {self.tier_type!r}: {exc} (codec_options "
                f"{o['codec_options']})"
            ) from exc
        kv_dtype = str(self._offloading_spec.config.model.dtype).removeprefix("torch.")
        self.spec = chunk_spec(self.codec, self.block_size_bytes, kv_dtype, o["head_dim"])
        # ``none`` keeps the bytes as they are: copied row to slot by numpy, no header (torch's
        # copies ran 10x slower on worker threads of a loaded 2-core machine)
        self._raw = self.codec.name == "none"
        self.encoded_bytes = (
            self.block_size_bytes if self._raw else self.codec.encoded_bytes(self.spec)
        )
        capacity = o["cold_bytes"] // self.encoded_bytes
        if capacity < 1:
            raise VllmTierConfigError(
                f"cold_bytes {o['cold_bytes']} holds no chunk ({self.encoded_bytes} bytes "
                f"encoded by {self.codec.name!r})"
            )
        if not self.codec.lossless:
            log.warning(
                "tierkv tier %s: lossy codec %r (chunks come back within its error bound, "
                "docs/codecs.md)", self.tier_type, self.codec.name,
            )  # fmt: skip
        try:
            self.pool = np.empty((capacity, self.encoded_bytes), dtype=np.uint8)
        except (MemoryError, ValueError) as exc:  # (numpy: "array is too big" past its sizes)
            raise VllmTierConfigError(
                f"TierKVColdTier tier {self.tier_type!r}: cold_bytes {o['cold_bytes']} cannot "
                f"be allocated: {exc}"
            ) from None
        self._sums = np.zeros(capacity, dtype=np.int64)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # readable, LRU first
        self._writing: set[bytes] = set()
        self._pins: Counter[int] = Counter()  # slot -> loads reading it
        self._doomed: set[int] = set()  # slots that failed their checksum, still pinned
        self._free = list(range(capacity - 1, -1, -1))
        self._lock = threading.Lock()
        self._workers = concurrent.futures.ThreadPoolExecutor(
            o["threads"], thread_name_prefix=f"tierkv_vllm_{self.tier_type}"
        )
        self.counters.update(dict.fromkeys(("stored", "evicted", "refused", "corrupt"), 0))

    # -- the index (under the lock) ---------------------------------------------------------------
    def _take(self, n: int) -> list[int] | None:
        """``n`` free slots, evicting least recently used unpinned chunks; None (nothing
        taken) when that many cannot be had."""
        short = n - len(self._free)
        if short > 0:
            victims = [k for k, s in self._index.items() if not self._pins[s]][:short]
            if len(victims) < short:
                return None  # (nothing evicted)
            self._free.extend(self._index.pop(k) for k in victims)
            self.counters["evicted"] += short
        return [self._free.pop() for _ in range(n)]

    def lookup(self, key: Any, req_context: Any) -> Any:
        """HIT when the pool holds the chunk (readable), MISS otherwise."""
        self.counters["lookups"] += 1
        tkey = self.keys(key)
        with self._lock:
            if tkey not in self._index:
                return LookupResult.MISS
            self._index.move_to_end(tkey)
        self.counters["hits"] += 1
        return LookupResult.HIT

    # -- copies -------------------------------------------------------------------------------
    def submit_store(self, job_metadata: Any) -> None:
        """Encode the job's chunks into free (or evicted) slots, on the tier's threads."""
        job_id, t0 = job_metadata.job_id, time.monotonic()
        try:
            keys = list(job_metadata.keys)
            tkeys = self.keys.many(keys)
            rows = self._chunk_rows(keys, job_metadata.chunk_ids)
            with self._lock:
                todo = [
                    (k, r) for k, r in zip(tkeys, rows)
                    if k not in self._index and k not in self._writing
                ]  # fmt: skip
                slots = self._take(len(todo))
                if slots is None:
                    self.counters["refused"] += 1
                    raise TierFullError(f"no room for {len(todo)} chunks: the pool is pinned")
                self._writing.update(k for k, _ in todo)
            future = self._workers.submit(self._encode, todo, slots)
        except Exception as exc:
            self._fail_now(job_id, "store", exc)
            return
        nbytes = len(todo) * self.block_size_bytes
        self._track(job_id, future, lambda _: result(job_id, True, nbytes, t0))

    def _encode(self, todo: list[tuple[bytes, int]], slots: list[int]) -> None:
        """Encode, record the slots' checksums, make them readable; on failure give the slots
        back (nothing kept) and raise."""
        keys = [k for k, _ in todo]
        try:
            if todo and self._raw:
                for (_, r), slot in zip(todo, slots):
                    self.pool[slot] = self._rows[r]
            elif todo:
                src = torch.from_numpy(self._rows[[r for _, r in todo]])
                self.pool[slots] = self.codec.encode(src, self.spec).numpy()
            if todo:
                self._sums[slots] = page_sums.row_sums(self.pool, slots)
        except BaseException:
            with self._lock:
                self._writing.difference_update(keys)
                self._free.extend(slots)
            raise
        with self._lock:
            self._writing.difference_update(keys)
            self._index.update(zip(keys, slots))
            self.counters["stored"] += len(keys)

    def submit_load(self, job_metadata: Any) -> None:
        """Decode the job's chunks (the leading ones the pool holds) into their primary rows."""
        job_id, t0 = job_metadata.job_id, time.monotonic()
        keys = list(job_metadata.keys)
        try:
            tkeys = self.keys.many(keys)
            rows = self._chunk_rows(keys, job_metadata.chunk_ids)
            with self._lock:
                slots: list[int] = []
                for k in tkeys:
                    slot = self._index.get(k)
                    if slot is None:
                        break
                    slots.append(slot)
                    self._pins[slot] += 1
            future = self._workers.submit(self._decode, tkeys[: len(slots)], slots, rows)
        except Exception as exc:
            self._fail_now(job_id, "load", exc)
            return
        size = self.block_size_bytes

        def finish(n: int) -> Any:
            if n == len(keys):
                return result(job_id, True, n * size, t0)
            return result(job_id, False, n * size, t0, tuple(keys[:n]) or None)

        self._track(job_id, future, finish)

    def _decode(self, tkeys: list[bytes], slots: list[int], rows: list[int]) -> int:
        """Check the slots' checksums, decode the leading intact ones into ``rows``; a slot
        that failed is dropped. Returns how many were decoded."""
        try:
            n = len(slots)
            if page_sums.enabled() and slots:
                got = page_sums.row_sums(self.pool, slots)
                bad = [i for i, s in enumerate(slots) if got[i] != self._sums[s]]
                if bad:
                    n = bad[0]
                    self._drop([(tkeys[i], slots[i]) for i in bad])
            if n and self._raw:
                for slot, r in zip(slots[:n], rows):
                    self._rows[r] = self.pool[slot]
            elif n:
                out = torch.empty((n, self.block_size_bytes), dtype=torch.uint8)
                self.codec.decode(torch.from_numpy(self.pool[slots[:n]]), self.spec, out=out)
                self._rows[rows[:n]] = out.numpy()
            return n
        finally:
            with self._lock:
                for s in slots:
                    self._pins[s] -= 1
                    if not self._pins[s] and s in self._doomed:
                        self._doomed.discard(s)
                        self._free.append(s)

    def _drop(self, bad: list[tuple[bytes, int]]) -> None:
        """Forget chunks whose slot failed its checksum: a miss from now on; the slot is
        freed when the last load reading it ends."""
        with self._lock:
            for k, s in bad:
                if self._index.get(k) == s:
                    del self._index[k]
                    self._doomed.add(s)
                    self.counters["corrupt"] += 1

    def tierkv_stats(self) -> dict[str, Any]:
        """The tier's counters and the pool's: chunks held, capacity, the codec and its
        compression ratio."""
        out: dict[str, Any] = dict(self.counters)
        with self._lock:
            out["cold_chunks"] = len(self._index)
        out["cold_capacity"] = self.pool.shape[0]
        out["cold_codec"] = self.codec.name
        out["cold_lossless"] = bool(self.codec.lossless)
        out["cold_ratio"] = self.block_size_bytes / self.encoded_bytes
        return out

    def shutdown(self) -> None:
        """Wait for the copies, stop the threads, drop the pool (idempotent)."""
        if self.shut_down:
            return
        self.drain_jobs()
        self._workers.shutdown(wait=True)
        self._release_rows()
        self.pool = np.empty((0, self.encoded_bytes), dtype=np.uint8)
