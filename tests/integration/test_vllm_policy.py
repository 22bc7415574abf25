"""tierkv's kvaware as the cache policy of vLLM 0.33's CPU manager (by module path): the
CachePolicy contract (atomic eviction, protected and pinned chunks kept, failed stores,
clear), the tiering manager's script with it, and a slice of the Mooncake trace through
vLLM's manager with lru, arc and kvaware. Skipped where vLLM is not installed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))
import vllm_driver as drv  # (skips this module where vLLM is not installed)
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm_driver import Script, build, key

from tierkv.integrations.vllm.policy import TierKVAwarePolicy

MODULE = "tierkv.integrations.vllm.policy"
TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")


def manager(chunks: int) -> CPUOffloadingManager:
    return CPUOffloadingManager(
        num_chunks=chunks, cache_policy="TierKVAwarePolicy", cache_policy_module_path=MODULE
    )


def store(m: CPUOffloadingManager, keys: list[bytes], req: str, ok: bool = True) -> Any:
    ctx = ReqContext(req_id=req)
    for j, k in enumerate(keys):
        ctx.set_offload_key_position(k, (j + 1) * 16)
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    if out is not None and out.keys_to_store:
        m.complete_store(out.keys_to_store, ctx, ok)
    m.on_request_finished(ctx)
    return out


def test_vllm_loads_it_by_module_path_and_the_contract_holds() -> None:
    m = manager(4)
    policy = m._policy
    assert isinstance(policy, TierKVAwarePolicy)
    a = [key(i) for i in range(4)]
    assert store(m, a, "a") is not None
    assert [m.lookup(k, ReqContext(req_id="x")).name for k in a] == ["HIT"] * 4
    # pinned chunks (a load in flight) are never victims: a store that needs them is refused
    ctx = ReqContext(req_id="load")
    m.prepare_load(a, ctx)
    assert store(m, [key(10)], "b") is None
    assert sorted(policy.chunks) == sorted(a)  # nothing changed
    assert policy.evict(1, set()) is None  # atomic: every chunk pinned
    assert len(policy.chunks) == 4 and len(policy.policy) + len(policy._probation) == 4
    m.complete_load(a, ctx)
    # protected chunks are not victims; evict(n) gives exactly n or None
    assert policy.evict(4, {a[0]}) is None
    assert len(policy.chunks) == 4
    got = policy.evict(3, {a[0]})
    assert got is not None and len(got) == 3 and a[0] not in [k for k, _ in got]
    assert list(policy.chunks) == [a[0]] and len(policy.policy) + len(policy._probation) == 1


def test_a_failed_store_and_a_reset_leave_nothing() -> None:
    m = manager(8)
    policy = m._policy
    store(m, [key(i) for i in range(4)], "a", ok=False)  # the worker's copy failed
    assert policy.chunks == {} and len(policy.policy) == 0 and not policy._probation
    store(m, [key(i) for i in range(4)], "b")
    m.reset_cache()
    assert policy.chunks == {} and len(policy.policy) == 0
    assert store(m, [key(i) for i in range(8)], "c") is not None
    assert len(policy.chunks) == 8


def test_the_tiering_manager_runs_the_script_with_it(tmp_path: Path) -> None:
    extra = {"eviction_policy": "TierKVAwarePolicy", "cache_policy_module_path": MODULE}
    s = Script(build([{"type": "fs", "root_dir": str(tmp_path)}], extra=extra))
    assert isinstance(s.manager.primary_tier._policy, TierKVAwarePolicy)
    try:
        drv.run_sequence(s)
    finally:
        s.close()
    assert s.mismatches == 0
    assert ("lookup", ["HIT"] * 12) in s.log


@pytest.mark.skipif(not TRACE.exists(), reason="the Mooncake trace is not in shared/")
def test_on_a_slice_of_the_mooncake_trace_it_beats_vllms_lru_and_arc() -> None:
    """Deterministic (no randomness anywhere): the first 2,000 requests, 1,000 chunks."""
    from benchmarks.vllm_policy import run_vllm
    from tierkv.replay import load_trace

    trace = load_trace(TRACE, 2000)
    lru, _ = run_vllm(trace, 1000, "lru", None)
    arc, _ = run_vllm(trace, 1000, "arc", None)
    ours, policy = run_vllm(trace, 1000, "TierKVAwarePolicy", MODULE)
    assert ours > max(lru, arc) > 0, (ours, lru, arc)
    assert isinstance(policy, TierKVAwarePolicy)
    assert policy.stats()["declined"] > 0  # admission ran, and its declines went on probation


@pytest.mark.parametrize("capacity", [0, -1, 1.5, "8", True, 10**12])
def test_a_bad_capacity_is_a_typed_error(capacity: object) -> None:
    """A float or str capacity was a TypeError from inside, 10**12 a MemoryError, 0 and -1 a
    policy that held nothing; now InvalidInputError (InvalidTypeError for the types)."""
    from tierkv.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="cache_capacity"):
        TierKVAwarePolicy(capacity)  # type: ignore[arg-type]


def _snapshot(p: TierKVAwarePolicy) -> Any:
    return (dict(p.chunks), dict(p._slot_of), dict(p._key_at), list(p._probation), len(p.policy))


def test_an_insert_vllm_would_never_make_is_refused_and_changes_nothing() -> None:
    """A chunk id outside the cache was an IndexError after the chunk was recorded; a key
    inserted twice left its old slot naming it; two keys in one slot left the policy unable to
    evict either. Now typed errors, the policy as it was."""
    from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

    from tierkv.errors import InvalidInputError, InvalidTypeError, PageStateError

    p, ctx = TierKVAwarePolicy(4), ReqContext(req_id="r")
    p.insert(key(1), ChunkStatus(0), ctx)
    before = _snapshot(p)
    for k, slot, error in [
        (key(2), 9, InvalidInputError),
        (key(2), -1, InvalidInputError),
        (key(1), 1, PageStateError),  # the same key again
        (key(2), 0, PageStateError),  # another key in a held slot
    ]:
        with pytest.raises(error):
            p.insert(k, ChunkStatus(slot), ctx)
        assert _snapshot(p) == before
    for n in (-1, "2", 1.0):
        with pytest.raises((InvalidInputError, InvalidTypeError)):
            p.evict(n, set())  # type: ignore[arg-type]
    # a slot is free again once its chunk is removed or evicted
    p.remove(key(1))
    p.insert(key(2), ChunkStatus(0), ctx)
    assert p.get(key(2)) is not None and p._key_at == {0: key(2)}
