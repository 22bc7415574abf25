"""Drives vLLM 0.33's own `TieringOffloadingManager` on the CPU, as its scheduler and worker
would: the primary tier over vLLM's shared region (in /dev/shm), no GPU. The "GPU -> CPU"
copy of the worker is a write of each chunk's bytes into the primary tier's memoryview; a load
is checked by reading the primary rows back after vLLM's `prepare_load`.

`Script` runs one request sequence and records what vLLM answered, so that the same script on
vLLM's ``fs`` tier and on a tierkv tier can be compared side by side.
"""

from __future__ import annotations

import hashlib
import itertools
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip(  # a test module that imports this one is skipped without vLLM
    "vllm.v1.kv_offload.tiering.manager",
    reason="vLLM 0.33 not installed (pip install --no-deps vllm==0.33.0: docs/vllm.md)",
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

TIERKV = "tierkv.integrations.vllm"
STEP = 0.002
"""Seconds between engine steps while a lookup answers RETRY (a model step's stand-in: vLLM's
lookup threads answer between steps)."""
_ENGINES = itertools.count()


def offloading_config(
    tiers: list[dict[str, Any]],
    *,
    cpu_chunks: int = 8,
    block_bytes: int = 64 << 10,
    blocks_per_chunk: int = 8,
    model: str = "org/model-a",
    dtype: str = "float16",
    engine: str | None = None,
    extra: dict[str, Any] | None = None,
) -> OffloadingConfig:
    """vLLM's normalized offloading config: one KV group, TP 1; a chunk of
    ``block_bytes * blocks_per_chunk`` bytes, ``cpu_chunks`` chunks in the primary tier."""
    chunk = block_bytes * blocks_per_chunk
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": cpu_chunks * chunk,
            "secondary_tiers": tiers,
            **(extra or {}),
        },
        engine_id=engine or f"tierkv-test-{threading.get_native_id()}-{next(_ENGINES)}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def build(tiers: list[dict[str, Any]], **kw: Any) -> TieringOffloadingManager:
    """vLLM's own manager, built by vLLM's spec and tier factory from the tier configs."""
    manager = TieringOffloadingSpec(offloading_config([dict(t) for t in tiers], **kw)).get_manager()
    assert isinstance(manager, TieringOffloadingManager)
    return manager


def key(i: int, salt: bytes = b"") -> bytes:
    """The offload key of chunk ``i`` (a 32-byte block hash, group 0)."""
    return make_offload_key(hashlib.sha256(salt + i.to_bytes(8, "little")).digest(), 0)


def payload(k: bytes, nbytes: int) -> np.ndarray:
    """Deterministic chunk bytes for key ``k``."""
    seed = int.from_bytes(hashlib.sha256(k).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@dataclass
class Script:
    """One manager driven step by step; `log` records vLLM's answers."""

    manager: TieringOffloadingManager
    log: list[tuple[str, Any]] = field(default_factory=list)
    make: Callable[[bytes, int], np.ndarray] = payload  # a chunk's bytes from its key
    same: Callable[[bytes, np.ndarray], bool] | None = None  # a loaded row is right (None: equal)
    mismatches: int = 0
    _ctx: dict[str, ReqContext] = field(default_factory=dict)
    _new: list[str] = field(default_factory=list)

    @property
    def rows(self) -> np.ndarray:
        view = self.manager.primary_tier.get_kv_memoryview()
        return np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)

    def ctx(self, req: str) -> ReqContext:
        if req not in self._ctx:
            c = ReqContext(req_id=req)
            with self.manager.lock:
                self.manager.on_new_request(c)
            self._ctx[req] = c
            self._new.append(req)
        return self._ctx[req]

    def step(self, preempted: tuple[str, ...] = ()) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(tuple(self._new), preempted))
        self._new.clear()

    def settle(self, max_steps: int = 2000) -> None:
        """Step until no copy of any tier is running (each step waits on the tiers' own
        completion: vLLM's drain_jobs blocks until every job has ended)."""
        for _ in range(max_steps):
            with self.manager.lock:
                for tier in self.manager.secondary_tiers:
                    tier.drain_jobs()
            self.step()
            if not self.manager.has_pending_work():
                return
        raise AssertionError("the manager kept pending work")

    def store(self, req: str, keys: list[bytes]) -> None:
        """prepare_store, the worker's copy into the primary rows, complete_store."""
        c = self.ctx(req)
        with self.manager.lock:
            out = self.manager.prepare_store(keys, c)
        if out is None:
            self.log.append(("store-refused", len(keys)))
            return
        rows = self.rows
        for k, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            rows[int(cid)] = self.make(k, rows.shape[1])
        if out.keys_to_store:
            with self.manager.lock:
                self.manager.complete_store(out.keys_to_store, c, True)
        self.log.append(("stored", len(out.keys_to_store)))

    def lookup(self, req: str, keys: list[bytes], within: float = 60.0) -> list[str]:
        """Look each key up as the scheduler does (RETRY / HIT_PENDING: the next engine step
        asks again; a step is STEP seconds, as a model's forward pass would take); load the
        HITs and check their bytes in the primary rows."""
        c = self.ctx(req)
        answers: list[str] = []
        for k in keys:
            deadline = time.monotonic() + within
            while True:
                with self.manager.lock:
                    r = self.manager.lookup(k, c)
                if r in (LookupResult.HIT, LookupResult.MISS):
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"{k.hex()} not resolved within {within} s")
                self.settle()
                time.sleep(STEP)
            answers.append(r.name)
            if r is LookupResult.HIT:
                with self.manager.lock:
                    spec = self.manager.prepare_load([k], c)
                row = self.rows[int(spec.chunk_ids[0])]
                if self.same is not None:
                    self.mismatches += not self.same(k, row)
                elif not np.array_equal(row, self.make(k, row.shape[0])):
                    self.mismatches += 1
                with self.manager.lock:
                    self.manager.complete_load([k], c)
        self.log.append(("lookup", answers))
        return answers

    def end(self, req: str) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(self._ctx.pop(req))

    def reset(self) -> None:
        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()
        self.log.append(("reset", None))

    def close(self) -> None:
        self.manager.shutdown()


def run_sequence(s: Script, n: int = 24, salt: bytes = b"") -> None:
    """Stores of more chunks than the primary holds (so most come back from the secondary
    tier), lookups of prefixes, request ends, a preemption and a cache reset."""
    keys = [key(i, salt) for i in range(n)]
    for lo in range(0, n, 4):
        s.store(f"w{lo}", keys[lo : lo + 4])
        s.settle()
        s.end(f"w{lo}")
    s.settle()
    s.lookup("r1", keys[:12])
    s.step(preempted=("r1",))  # preempted: its hits are asked again when it resumes
    s.lookup("r1", keys[:12])
    s.end("r1")
    s.settle()
    s.lookup("r2", [*keys[12:], key(999, salt)])  # the last one was never stored
    s.end("r2")
    s.settle()
    s.reset()
    s.lookup("r3", keys[::3])
    s.end("r3")
    s.settle()


def store_in_a_child(config: dict[str, Any]) -> None:
    """Store keys 0-7 (two jobs of 4) through one tier built from ``config`` in a child
    process, which closes it: the pages another process finds afterwards (its own vLLM
    manager). Fails with the child's stderr if it did not store."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from vllm_driver import Script, build, key
        s = Script(build([{config!r}]))
        for lo in range(0, 8, 4):
            s.store("w%d" % lo, [key(i) for i in range(lo, lo + 4)])
            s.settle()
            s.end("w%d" % lo)
        s.settle()
        s.close()
        print("stored")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "stored" in out.stdout, out.stderr[-3000:]


def stores(s: Script, keys: list[bytes], tag: str) -> None:
    """Store ``keys`` in jobs of 4 (a request each), each job settled before the next."""
    for lo in range(0, len(keys), 4):
        s.store(f"{tag}{lo}", keys[lo : lo + 4])
        s.settle()
        s.end(f"{tag}{lo}")
    s.settle()


def side_by_side(root: Path, tier: dict[str, Any], salt: bytes = b"") -> tuple[Script, Script, Any]:
    """`run_sequence` on vLLM's ``fs`` tier under ``root``, then on ``tier``: both scripts and
    the tier's `tierkv_stats` (taken before it closes)."""
    reference = Script(build([{"type": "fs", "root_dir": str(root)}]))
    try:
        run_sequence(reference, salt=salt)
    finally:
        reference.close()
    ours = Script(build([tier]))
    try:
        run_sequence(ours, salt=salt)
        stats = ours.manager.secondary_tiers[0].tierkv_stats()
    finally:
        ours.close()
    return reference, ours, stats


def check_shared(child: dict[str, Any], here: dict[str, Any]) -> None:
    """A child process stores keys 0-7 through tier ``child`` (`store_in_a_child`); a manager
    here on tier ``here`` finds them all (bit-exact) and misses key 8; a manager of another
    model on the same tier finds none of them."""
    store_in_a_child(child)
    s = Script(build([here]))
    try:
        assert s.lookup("r", [key(i) for i in range(8)] + [key(8)]) == ["HIT"] * 8 + ["MISS"]
        assert s.mismatches == 0
        s.end("r")
        s.settle()
    finally:
        s.close()
    other = Script(build([here], model="org/model-b"))
    try:
        assert other.lookup("r", [key(0)]) == ["MISS"]
        other.end("r")
    finally:
        other.close()


def check_unreachable(tier: dict[str, Any]) -> None:
    """A manager on ``tier``, whose server nothing answers for, starts; a store fails (vLLM is
    told) and a lookup misses; nothing raises."""
    s = Script(build([tier]))
    try:
        s.store("a", [key(0)])
        s.settle()
        s.end("a")
        assert s.lookup("b", [key(1)]) == ["MISS"]
        s.end("b")
        s.settle()
    finally:
        s.close()
    assert s.log[0] == ("stored", 1)


def check_gone_after_a_hit(tier: dict[str, Any], gone: Callable[[], None]) -> None:
    """A request's cached HIT whose chunks have since left the tier (``gone``: flushed, the
    server killed): the load fails, the tier marks the keys a miss for the request, and its
    next lookup answers MISS instead of promoting the same keys forever; nothing raises."""
    s = Script(build([tier], cpu_chunks=4))
    a = [key(600 + i) for i in range(4)]
    try:
        stores(s, a, "a")
        stores(s, [key(610 + i) for i in range(4)], "b")  # a leaves the 4-chunk primary
        assert s.lookup("r", a) == ["HIT"] * 4  # from the tier; cached for request r
        stores(s, [key(620 + i) for i in range(4)], "c")  # a leaves the primary again
        gone()
        assert s.lookup("r", a) == ["MISS"] * 4
        assert s.manager.secondary_tiers[0].tierkv_stats()["jobs_failed"] >= 1
        assert s.mismatches == 0
        s.end("r")
        s.settle()
    finally:
        s.close()
