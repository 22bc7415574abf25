"""tierkv's Redis tier inside vLLM 0.33's tiering manager: the fs reference script, a server
stopped and restarted mid-sequence, and a prefix stored by one process that is a hit for
another. Skipped where vLLM, redis-py or a redis-server binary is missing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.manager",
    reason="vLLM 0.33 not installed (pip install --no-deps vllm==0.33.0: docs/vllm.md)",
)
pytest.importorskip("redis")

sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, skip_without_redis
from vllm_driver import (
    TIERKV,
    Script,
    build,
    check_gone_after_a_hit,
    check_shared,
    check_unreachable,
    key,
    side_by_side,
    stores,
)

from tierkv.integrations.vllm import TierKVRedisTier, VllmTierTypeError

skip_without_redis()


@pytest.fixture
def server() -> Any:
    with RedisServer() as srv:
        yield srv


def redis_tier(url: str, **kw: Any) -> dict[str, Any]:
    return {"type": "TierKVRedisTier", "module_path": TIERKV, "url": url, "timeout": 0.5, **kw}


def test_redis_tier_answers_as_vllms_fs_tier_bit_exact(tmp_path: Path, server: Any) -> None:
    reference, ours, stats = side_by_side(tmp_path, redis_tier(server.url))
    assert ours.log == reference.log
    assert reference.mismatches == ours.mismatches == 0
    assert stats["redis_stored"] == 24 and stats["redis_hits"] >= 24
    assert stats["redis_corrupt"] == 0
    assert stats["jobs_failed"] == 0 and stats["jobs_done"] >= 6 + 24


def test_redis_stopped_and_restarted_mid_sequence(server: Any) -> None:
    """Down: stores fail and lookups miss (no exception into vLLM); back up (empty, as after a
    crash): the tier reconnects by itself and new chunks are stored and served again."""
    s = Script(build([redis_tier(server.url)], cpu_chunks=4))
    tier = s.manager.secondary_tiers[0]
    assert isinstance(tier, TierKVRedisTier)
    before = [key(i) for i in range(8)]
    during = [key(100 + i) for i in range(8)]
    after = [key(200 + i) for i in range(8)]
    # no backoff between reconnection attempts (its timing is RedisTier's, tested there): the
    # first store after the restart reconnects
    tier.redis.backoff_base = tier.redis.backoff_cap = 0.0
    try:
        stores(s, before, "a")
        server.kill()
        stores(s, during, "b")  # cascades fail: vLLM is told, nothing raises
        # evicted from the 4-chunk primary, and Redis is gone: misses
        assert s.lookup("r1", before[:4]) == ["MISS"] * 4
        s.end("r1")
        s.settle()
        assert tier.tierkv_stats()["redis_available"] == 0
        server.restart()
        failed = tier.tierkv_stats()["jobs_failed"]
        assert failed >= 2  # the cascades of `during`
        stores(s, after, "c")
        assert tier.tierkv_stats()["jobs_failed"] == failed
        assert s.lookup("r2", after[:4]) == ["HIT"] * 4
        s.end("r2")
        s.settle()
        assert s.mismatches == 0
        assert tier.tierkv_stats()["redis_reconnects"] >= 1
    finally:
        s.close()


def test_a_prefix_stored_by_one_process_is_a_hit_for_another(server: Any) -> None:
    check_shared(
        {"type": "TierKVRedisTier", "module_path": TIERKV, "url": server.url},
        redis_tier(server.url),
    )


def test_redis_config_is_checked_and_an_unreachable_server_is_no_startup_error() -> None:
    with pytest.raises(VllmTierTypeError, match="timeout"):
        build([redis_tier("redis://127.0.0.1:1/0", timeout="1s")])
    check_unreachable(redis_tier("redis://127.0.0.1:1/0"))  # nothing listens there


def test_a_load_that_finds_the_value_gone_is_a_miss_not_a_livelock(server: Any) -> None:
    """A request's cached HIT whose value has since left Redis (evicted, flushed): the load
    fails, the tier marks the key a miss, and the request's next lookup answers MISS instead
    of promoting the same key forever."""
    import redis

    check_gone_after_a_hit(redis_tier(server.url), redis.Redis.from_url(server.url).flushall)
