"""tierkv's cold pool inside vLLM 0.33's tiering manager: lossless by default (the fs reference
script side by side, bit-exact), a lossy codec only when named and then within its stated error
bound, eviction, a slot that fails its checksum, config checks at startup. Skipped where vLLM
is not installed."""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import vllm_driver as drv  # (skips this module where vLLM is not installed)
from vllm_driver import TIERKV, Script, build, key

from tierkv.codecs import create_codec
from tierkv.integrations.vllm import TierKVColdTier, VllmTierConfigError, VllmTierTypeError
from tierkv.integrations.vllm.cold import chunk_spec

CHUNK = 512 << 10
ENCODED = CHUNK  # codec none: the bytes as they are


def cold_tier(chunks: int = 64, **kw: Any) -> dict[str, Any]:
    return {"type": "TierKVColdTier", "module_path": TIERKV, "cold_bytes": chunks * ENCODED,
            "threads": 2, **kw}  # fmt: skip


def test_cold_tier_answers_as_vllms_fs_tier_bit_exact(tmp_path: Path) -> None:
    """The default codec is lossless: random chunk bytes (NaN and inf patterns among them as
    fp16) come back bit for bit."""
    reference, ours, stats = drv.side_by_side(tmp_path, cold_tier())
    assert ours.log == reference.log
    assert reference.mismatches == ours.mismatches == 0
    assert stats["cold_codec"] == "none" and stats["cold_lossless"]
    assert stats["stored"] == 24 and stats["corrupt"] == 0
    assert stats["jobs_failed"] == 0 and stats["jobs_done"] >= 6 + 24


def fp16_chunk(k: bytes, nbytes: int) -> np.ndarray:
    """Finite fp16 KV-like values (a scale per chunk), as the chunk's bytes."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(k).digest()[:8], "little"))
    scale = float(rng.uniform(0.01, 30.0))
    return (rng.standard_normal(nbytes // 2) * scale).astype(np.float16).view(np.uint8)


@pytest.mark.parametrize("codec", ["int8", "int8-group", "bf16"])
def test_a_named_lossy_codec_keeps_its_error_bound(codec: str) -> None:
    """Every element of every chunk loaded is within the codec's stated bound
    (`Codec.error_bound`, docs/codecs.md), and the codec is really lossy here."""
    c = create_codec(codec)
    spec = chunk_spec(c, CHUNK, "float16", 128)
    exact = [0]

    def within(k: bytes, row: np.ndarray) -> bool:
        want = torch.from_numpy(fp16_chunk(k, CHUNK).copy()).view(torch.float16)
        got = torch.from_numpy(row.copy()).view(torch.float16)
        pages = want.view(1, *spec.page_shape)
        bound = c.error_bound(pages, spec).broadcast_to(pages.shape).reshape(-1)
        exact[0] += bool(torch.equal(got, want))
        return bool(((got.double() - want.double()).abs() <= bound).all())

    s = Script(build([cold_tier(codec=codec)], cpu_chunks=4), make=fp16_chunk, same=within)
    keys = [key(700 + i) for i in range(12)]
    try:
        drv.stores(s, keys, "a")
        assert s.lookup("r", keys) == ["HIT"] * 12  # 8 of them from the cold pool
        stats = s.manager.secondary_tiers[0].tierkv_stats()
        s.end("r")
        s.settle()
    finally:
        s.close()
    assert s.mismatches == 0
    assert exact[0] < 12  # lossy: some chunk came back changed (within its bound)
    assert not stats["cold_lossless"] and stats["cold_codec"] == codec
    assert stats["cold_ratio"] == pytest.approx(CHUNK / c.encoded_bytes(spec))


def test_a_chunk_a_lossy_codec_cannot_take_is_a_failed_store() -> None:
    """NaN in a chunk: int8 refuses it (NonFiniteError); the store fails, nothing is kept,
    its slot is free again; the other chunks of the run are stored."""

    def with_nan(k: bytes, nbytes: int) -> np.ndarray:
        row = fp16_chunk(k, nbytes)
        if k == key(801):
            row.view(np.float16)[7] = np.nan
        return row

    s = Script(build([cold_tier(chunks=8, codec="int8")], cpu_chunks=4), make=with_nan)
    tier = s.manager.secondary_tiers[0]
    assert isinstance(tier, TierKVColdTier)
    try:
        for i in range(8):  # a job per chunk
            drv.stores(s, [key(800 + i)], f"w{i}")
        st = tier.tierkv_stats()
        assert st["jobs_failed"] == 1 and st["stored"] == 7 and st["cold_chunks"] == 7
        assert s.lookup("r", [key(801)]) == ["MISS"]  # left the primary, not in the pool
        s.end("r")
        s.settle()
    finally:
        s.close()


def test_the_pool_evicts_least_recently_used_chunks() -> None:
    s = Script(build([cold_tier(chunks=4)], cpu_chunks=4))
    keys = [key(900 + i) for i in range(12)]
    try:
        drv.stores(s, keys[:4], "a")
        assert s.lookup("r0", keys[:1]) == ["HIT"]  # keys[0] used again: kept longest
        s.end("r0")
        drv.stores(s, keys[4:7], "b")
        st = s.manager.secondary_tiers[0].tierkv_stats()
        assert st["cold_chunks"] == 4 and st["evicted"] == 3
        drv.stores(s, keys[7:11], "c")  # the primary now holds keys[7:11] only
        assert s.lookup("r", keys[:1] + keys[1:4]) == ["MISS"] * 4
        assert s.lookup("r2", keys[7:11]) == ["HIT"] * 4
        assert s.mismatches == 0
        s.end("r")
        s.end("r2")
        s.settle()
    finally:
        s.close()


def test_a_slot_that_fails_its_checksum_is_a_miss_never_served() -> None:
    s = Script(build([cold_tier(chunks=8)], cpu_chunks=4))
    tier = s.manager.secondary_tiers[0]
    assert isinstance(tier, TierKVColdTier)
    keys = [key(1000 + i) for i in range(8)]
    try:
        drv.stores(s, keys, "a")  # keys[:4] left the primary: in the pool only
        tier.pool[:, 4096] ^= 0xFF  # every slot's bytes changed under the tier
        assert s.lookup("r", keys[:4]) == ["MISS"] * 4
        assert tier.tierkv_stats()["corrupt"] >= 1
        assert s.mismatches == 0
        s.end("r")
        s.settle()
        drv.stores(s, [key(1100 + i) for i in range(8)], "b")  # the freed slots are reused
        assert tier.tierkv_stats()["jobs_failed"] <= 4  # (the failed loads only)
    finally:
        s.close()


@pytest.mark.parametrize(
    ("fields", "kw", "error", "words"),
    [
        ({"colour": "blue"}, {}, VllmTierConfigError, "unknown config field"),
        ({"cold_bytes": "16GB"}, {}, VllmTierTypeError, "cold_bytes"),
        ({"cold_bytes": 1024}, {}, VllmTierConfigError, "holds no chunk"),
        ({"cold_bytes": 1 << 62}, {}, VllmTierConfigError, "cannot be allocated"),  # MemoryError
        ({"drain_timeout": float("nan")}, {}, VllmTierConfigError, "drain_timeout"),  # taken
        ({"codec": "zip"}, {}, VllmTierConfigError, "zip"),
        ({"codec": "int8-group", "codec_options": {"group_size": 48}}, {}, VllmTierConfigError,
         "group"),
        ({"codec": "int8", "codec_options": {"colour": 1}}, {}, VllmTierConfigError, "colour"),
        ({"codec": "head-sparse"}, {}, VllmTierConfigError, "head-sparse"),
        ({"codec": "int8"}, {"dtype": "fp8_e4m3"}, VllmTierConfigError, "fp8_e4m3"),
        ({"codec": "int8", "head_dim": 96}, {}, VllmTierConfigError, "head_dim 96"),
        ({"threads": 0}, {}, VllmTierConfigError, "threads"),
    ],
)  # fmt: skip
def test_a_bad_config_is_a_typed_error_at_startup(
    fields: dict[str, Any], kw: dict[str, Any], error: type[Exception], words: str
) -> None:
    threads = threading.active_count()
    engine = f"tierkv-cold-bad-{os.getpid()}"
    with pytest.raises(error, match=words):
        build([cold_tier(**fields)], engine=engine, **kw)
    assert threading.active_count() == threads
    assert glob.glob(f"/dev/shm/vllm_offload_{engine}*") == []
