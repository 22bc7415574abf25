"""The disk tier's Prometheus metrics (issue 25): every figure the issue names (hits, bytes
read and written, read and write latency histograms, corrupt pages, the I/O mode and why it is
buffered) is exported and equals the store's own statistics."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tierkv.metrics import render

from .test_store_disk import cached_kv, fill_many, store


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _one(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    got = [v for (n, _), v in samples.items() if n == name]
    assert len(got) == 1, (name, got)
    return got[0]


async def _scrape(
    path: Path,
) -> tuple[dict[str, object], dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
    async with store(path) as s:
        await fill_many(s, range(8))  # host evictions write to disk
        assert await cached_kv(s, 0) == 8  # read back from it
        return s.stats()["disk"], _samples(render(s).decode())


async def test_the_disk_metrics_equal_the_store_statistics(tmp_path: Path) -> None:
    d, m = await _scrape(tmp_path)
    assert d["hits"] > 0 and d["pages_written"] > 0
    for key in ("hits", "misses", "corrupt_pages", "bytes_read", "bytes_written"):
        assert _one(m, f"tierkv_disk_{key}_total") == d[key], key
    for op in ("read", "write"):
        h = d[f"{op}_latency"]
        assert _one(m, f"tierkv_disk_{op}_seconds_count") == h.count > 0  # type: ignore[attr-defined]
        assert _one(m, f"tierkv_disk_{op}_seconds_sum") == pytest.approx(h.total_s)  # type: ignore[attr-defined]
        inf = [
            v
            for (n, lb), v in m.items()
            if n == f"tierkv_disk_{op}_seconds_bucket" and ("le", "+Inf") in lb
        ]
        assert inf == [h.count]  # type: ignore[attr-defined]
    modes = {lb: v for (n, lb), v in m.items() if n == "tierkv_disk_io_mode"}
    assert modes == {(("mode", d["io_mode"]), ("reason", d["io_mode_reason"])): 1.0}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
async def test_a_buffered_disk_says_why_in_the_metrics() -> None:
    path = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        d, m = await _scrape(path)
    finally:
        shutil.rmtree(path)
    assert d["io_mode"] == "buffered" and "tmpfs" in str(d["io_mode_reason"])
    modes = [lb for (n, lb), _ in m.items() if n == "tierkv_disk_io_mode"]
    assert modes == [(("mode", "buffered"), ("reason", d["io_mode_reason"]))]
