"""tierkv's vLLM tiers called as a careless caller would: keys that are not vLLM's bytes
offload keys, chunk ids out of range, of the wrong type or not one per key. Each is refused:
a lookup raises a typed error; a store or load is a failed job that touched no primary row
and kept nothing. Skipped where vLLM is not installed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm_driver import TIERKV, Script, build, key

from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.integrations.vllm import VllmTierConfigError
from tierkv.integrations.vllm.keys import PageKeys
from tierkv.integrations.vllm.source import TierKVSourceTier


def _disk(tmp: Path) -> dict[str, Any]:
    return {"type": "TierKVDiskTier", "module_path": TIERKV, "path": str(tmp),
            "disk_bytes": 64 << 20}  # fmt: skip


def _cold(tmp: Path) -> dict[str, Any]:
    return {"type": "TierKVColdTier", "module_path": TIERKV, "cold_bytes": 32 * (512 << 10)}


def _redis(tmp: Path) -> dict[str, Any]:  # (nothing listens: the checks come first)
    return {"type": "TierKVRedisTier", "module_path": TIERKV, "url": "redis://127.0.0.1:1/0",
            "timeout": 0.2}  # fmt: skip


@pytest.fixture(params=[_disk, _cold, _redis], ids=["disk", "cold", "redis"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    script = Script(build([request.param(tmp_path)]))
    try:
        yield script.manager.secondary_tiers[0]
    finally:
        script.close()


def _rows(tier: Any) -> np.ndarray:
    return tier._rows  # (the tier's own uint8 view of vLLM's primary rows)


def _job(job_id: int, keys: list[bytes], chunk_ids: Any, load: bool) -> TransferJob:
    return TransferJob(job_id, keys, np.asarray(chunk_ids), load, ReqContext(req_id="r"))


def _run(tier: Any, job: TransferJob) -> Any:
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    tier.drain_jobs()
    (done,) = tier.get_finished_jobs()
    return done


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (32, InvalidTypeError),  # bytes(32): 32 zero bytes, the key of another chunk
        (10**4, InvalidTypeError),  # (10**12 allocated a terabyte)
        ("abc", InvalidTypeError),  # a silent miss
        (None, InvalidTypeError),
        ([1, 2], InvalidTypeError),
        (b"", InvalidInputError),
        (b"k" * 4096, InvalidInputError),
    ],
    ids=["int", "big-int", "str", "None", "list", "empty", "long"],
)
def test_a_key_that_is_not_an_offload_key_is_a_typed_error(
    tier: Any, bad: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        tier.lookup(bad, ReqContext(req_id="r"))
    with pytest.raises(error):
        PageKeys(b"d" * 32)(bad)
    assert _run(tier, _job(1, [bad], [0], load=False)).success is False


def test_a_load_into_a_negative_chunk_id_fails_and_writes_no_row(tier: Any) -> None:
    """Chunk id -1 indexed the last row: the load succeeded into another chunk's slot."""
    k, rows = key(1), _rows(tier)
    rows[0] = 7
    stored = _run(tier, _job(1, [k], [0], load=False)).success
    assert stored or isinstance(tier, TierKVSourceTier)  # (no Redis listens: a failed store)
    rows[-1] = 1
    assert _run(tier, _job(2, [k], [-1], load=True)).success is False
    assert (rows[-1] == 1).all()
    assert _run(tier, _job(3, [k], [len(rows)], load=True)).success is False


@pytest.mark.parametrize(
    ("n_keys", "chunk_ids"),
    [
        (2, [1, 2.5]),  # truncated to 2
        (1, [True]),
        (1, [[1]]),
        (1, [1, 2]),
        (2, [1]),  # the cold pool stored the first key and reported the job done
        (1, []),
        (2, [1, -1]),
        (1, ["end"]),
    ],
    ids=["float", "bool", "2-d", "two-for-one", "one-for-two", "none", "negative", "past-end"],
)
def test_a_store_with_bad_chunk_ids_fails_and_keeps_nothing(
    tier: Any, n_keys: int, chunk_ids: list[Any]
) -> None:
    keys = [key(5), key(6)][:n_keys]
    ids = [len(_rows(tier)) if c == "end" else c for c in chunk_ids]
    assert _run(tier, _job(1, keys, ids, load=False)).success is False
    ctx = ReqContext(req_id="r")
    assert all(tier.lookup(k, ctx) is not LookupResult.HIT for k in keys)


def _peer(tmp: Path) -> dict[str, Any]:
    return {"type": "TierKVPeerTier", "module_path": TIERKV, "peers": ["127.0.0.1:1"],
            "timeout": 0.2, "secret": "ab" * 16}  # fmt: skip


@pytest.mark.parametrize(
    ("make", "field", "value"),
    [
        (_disk, "drain_timeout", 1e300),  # built; drain_jobs then raised OverflowError
        (_cold, "threads", 10**6),  # built: up to a million threads
        (_redis, "timeout", 1e300),  # OverflowError at startup, its coroutine left pending
        (_redis, "ttl", 1e300),  # built: a 304-digit PX (Redis takes a 64-bit one)
        (_redis, "namespace", "a b"),  # SpecError, naming neither the tier nor vLLM's config
        (_redis, "url", "http://x"),
        (_peer, "timeout", 1e300),
        (_peer, "retry_after", 1e300),  # InvalidInputError from RemoteCluster
    ],
    ids=lambda v: v.__name__ if callable(v) else None,
)
def test_a_config_value_out_of_range_is_a_typed_error_naming_the_tier(
    tmp_path: Path, make: Any, field: str, value: Any
) -> None:
    import threading

    before = threading.active_count()
    with pytest.raises(VllmTierConfigError, match=rf"{make(tmp_path)['type']}.*{field}"):
        build([{**make(tmp_path), field: value}])
    assert threading.active_count() == before  # (no loop or worker thread left behind)


def test_shutdown_twice_is_a_no_op_and_a_job_after_it_fails(tier: Any) -> None:
    """The Redis and peer tiers' second shutdown raised RuntimeError (their loop closed) and
    left a coroutine never awaited; a job after shutdown failed as "chunk ids in [0, 0)"."""
    tier.shutdown()
    tier.shutdown()
    done = _run(tier, _job(1, [key(1)], [0], load=False))
    assert done.success is False and not tier.has_pending_work()
