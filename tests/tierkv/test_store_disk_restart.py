"""The store's disk tier across process ends (issue 25): a store closing persists every cached
prefix page it holds, wherever it is (the device tier included), and a process killed with
SIGKILL while its store writes to disk leaves nothing that a new store on the path serves
wrong: every prefix page read back is bit-exact or a counted miss."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tierkv.store import KVStore

from .test_store_disk import PAGE, SLOT, SPEC, cached_kv, fill, store, tokens

CHILD = Path(__file__).with_name("store_disk_child.py")
ROOT = Path(__file__).resolve().parents[2]


async def test_pages_held_only_by_the_device_tier_persist_at_close(tmp_path: Path) -> None:
    """Regression: close persisted the host tier's pages only; a prefix whose pages were still
    on the device alone (write-behind not yet run, or off) was lost at a restart although the
    closing store's lookup found it."""
    for write_behind in (True, False):
        path = tmp_path / f"wb-{write_behind}"
        path.mkdir()
        kw: dict[str, object] = dict(
            codec=None, disk_path=path, disk_bytes=64 * SLOT, write_behind=write_behind
        )
        async with KVStore(SPEC, device_bytes=32 * PAGE, host_bytes=32 * PAGE, **kw) as s:
            await fill(s, "a", 0)  # no drain: the pages may be on the device only
            assert s.lookup(tokens(0)) == 8
        async with KVStore(SPEC, device_bytes=32 * PAGE, host_bytes=32 * PAGE, **kw) as s:
            assert s.lookup(tokens(0)) == 8, write_behind
            assert await cached_kv(s, 0) == 8  # bit-exact (checked inside)
            assert s.stats()["disk"]["corrupt_pages"] == 0


def _spawn(path: Path, first: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(path), str(first)],
        cwd=CHILD.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _kill_while_writing(path: Path, first: int, rng: random.Random) -> int:
    """Start a child filling sequences from ``first``; SIGKILL it at a random moment after it
    finished a few; returns one past the last sequence it may have touched."""
    proc = _spawn(path, first)
    assert proc.stdout is not None and proc.stderr is not None
    last = first
    try:
        for _ in range(4 + rng.randrange(8)):  # sequences finished (evictions, disk writes)
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            last = int(line)
        time.sleep(rng.random() * 0.05)  # somewhere inside a later fill's writes
    finally:
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    last = max([last, *map(int, out.split())])
    return last + 2  # the sequence in progress may have pages on disk too


async def test_kill_9_while_writing_serves_nothing_wrong(tmp_path: Path) -> None:
    rng = random.Random(25)
    first, reused, asked = 0, 0, 0
    for _ in range(4):
        end = _kill_while_writing(tmp_path, first, rng)
        async with store(tmp_path) as s:  # the kernel dropped the dead child's lock
            assert s.stats()["disk"]["recovered"] > 0
            for i in range(end):
                found = s.lookup(tokens(i))
                asked += found
                reused += await cached_kv(s, i)  # every token reused is bit-exact
            d = s.stats()["disk"]
            # every page the index offered and the read did not deliver is a counted miss
            assert d["import_missed"] == d["corrupt_pages"] + d["read_errors"], d
            s.check()
        first = end
    assert reused > 0 and reused <= asked
