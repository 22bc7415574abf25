"""``tierkv replay --disk``: a trace replayed through the RAM tier's page table with a real disk
medium below it. An unbounded disk reaches the infinite-capacity hit rate; a second replay on
the same path finds the first one's blocks at open; damaged pages are counted misses, never
hits; bad arguments are refused before anything is created."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.disk.layout import ALIGN
from tierkv.replay import replay, replay_infinite
from tierkv.replay_disk import replay_with_disk
from tierkv.traces import synthetic_trace

PAGE = 4096
SLOT = ALIGN + PAGE


def _trace() -> list[list[int]]:
    return synthetic_trace("zipf", 300, seed=3)


@pytest.mark.parametrize("policy", ["lru", "kvaware"])
def test_an_unbounded_disk_reaches_the_infinite_hit_rate(tmp_path: Path, policy: str) -> None:
    trace = _trace()
    blocks = len({b for ids in trace for b in ids})
    r = replay_with_disk(trace, 20, tmp_path, blocks, policy=policy)
    inf = replay_infinite(trace)
    assert r.ram_hits + r.disk_hits == inf.hits  # every block seen before comes back
    assert r.disk_hits > 0 and r.disk.hits == r.disk_hits and r.disk.corrupt_pages == 0
    assert r.hit_rate > replay(trace, 20, policy).hit_rate
    assert r.disk.bytes_read == r.disk_hits * PAGE


def test_a_small_disk_helps_less_and_evicts(tmp_path: Path) -> None:
    trace = _trace()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    small = replay_with_disk(trace, 20, tmp_path / "a", 10)
    big = replay_with_disk(trace, 20, tmp_path / "b", 400)
    assert 0 < small.disk_hits < big.disk_hits
    assert small.disk.used == 10 and small.disk.pages_written > 10  # pages were evicted


def test_a_second_replay_on_the_path_finds_the_first_ones_blocks(tmp_path: Path) -> None:
    trace = _trace()
    first = replay_with_disk(trace, 20, tmp_path, 400)
    again = replay_with_disk(trace, 20, tmp_path, 400)
    assert first.disk.recovered == 0 and again.disk.recovered == first.disk.used
    assert again.disk_hits > first.disk_hits  # the first requests hit the disk at once


def test_damaged_pages_are_counted_misses_never_hits(tmp_path: Path) -> None:
    trace = _trace()
    clean = replay_with_disk(trace, 20, tmp_path, 400)
    rng = random.Random(7)
    flipped = 0
    for seg in sorted(tmp_path.glob("segment-*")):
        data = bytearray(seg.read_bytes())
        for off in range(0, len(data), SLOT):
            if any(data[off : off + 8]) and rng.random() < 0.5:  # a written slot
                data[off + ALIGN + rng.randrange(PAGE)] ^= 1 << rng.randrange(8)
                flipped += 1
        seg.write_bytes(data)
    assert flipped > 0
    again = replay_with_disk(trace, 20, tmp_path, 400)  # a wrong page would raise
    assert 0 < again.disk.corrupt_pages <= flipped
    assert again.disk.misses >= again.disk.corrupt_pages
    assert clean.disk.corrupt_pages == 0


def _write_trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": ids}) + "\n" for ids in _trace()))
    return path


def test_cli_replay_shows_the_disk_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    base = ["replay", str(trace), "--capacity-tokens", str(20 * 512), "--quiet"]
    assert main([*base, "--policy", "lru", "--disk", str(disk), "--disk-tokens", "204800"]) == 0
    out = capsys.readouterr().out
    for text in ("lru with a disk tier of 400 blocks", "I/O ", "disk hits", "corrupt"):
        assert text in out, text
    assert main([*base, "--disk", str(disk), "--disk-tokens", "204800", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["disk"]
    assert doc["policy"] == "kvaware" and doc["recovered"] > 0 and doc["disk_hits"] > 0
    assert doc["io_mode"] in ("direct", "buffered") and doc["corrupt_pages"] == 0


def test_cli_replay_refuses_bad_disk_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path)
    base = ["replay", str(trace), "--capacity-tokens", "10240", "--quiet"]
    assert main([*base, "--disk", str(tmp_path)]) == 2  # no --disk-tokens
    assert main([*base, "--disk-tokens", "10240"]) == 2
    missing = tmp_path / "nope"
    assert main([*base, "--disk", str(missing), "--disk-tokens", "10240"]) == 2
    assert not missing.exists()
    assert "error: --disk" in capsys.readouterr().err
