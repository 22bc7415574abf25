"""The disk medium (tierkv.disk.DiskPages) against raw positional vectored I/O, and its faults.

    python benchmarks/disk.py [--quick] [--dir DIR] [--json FILE] [--threads 4] [--kills 100]
                              [--flips 1000]

Throughput (both sides O_DIRECT, on the same segment files, the same slots, the same host
arena rows, the same queue depth: `--threads` I/O threads, batches of `--batch` pages split
across them), for 256 KB and 16 KB pages:
  disk->host   DiskPages.submit_read (header + payload, key / generation / CRC-32C verified)
  host->disk   DiskPages.submit_write (CRC-32C, header + payload, commit)
against two raw references of os.preadv / os.pwritev:
  raw          the same file bytes with the same calls (runs of adjacent slots in one call,
               headers into a scratch buffer): what the I/O itself costs; the targets'
               reference: >= 0.8 (256 KB), >= 0.6 (16 KB)
  raw pages    one call per page, the payload bytes alone (a layout without headers)
The sides alternate batch by batch so that load from other processes falls on both alike;
GB/s over all rounds.

Faults: `--kills` child processes (forked) killed with SIGKILL while writing, the path reopened
after each and every page found read back; `--flips` bits flipped in live pages' header fields
and payloads (in rounds over closed files), the path reopened and every page read. Figures:
wrong pages served (target 0) and damaged pages counted (target: all).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, table, write_json
from tierkv.disk import DiskPages, StoreStatus
from tierkv.disk.io import MAX_RUN
from tierkv.disk.layout import ALIGN, HEADER_BYTES, segment_name
from tierkv.runtime.arena import allocate_host_buffer

KB, MB = 1 << 10, 1 << 20


def keys_for(n: int, salt: int = 0) -> list[bytes]:
    """`n` distinct 16-byte content keys."""
    return [(salt << 40 | i).to_bytes(16, "big") for i in range(n)]


def content(k: bytes, nbytes: int) -> np.ndarray:
    """The page of key `k` (a function of the key)."""
    return np.random.default_rng(int.from_bytes(k, "big") % (1 << 63)).integers(
        0, 256, nbytes, dtype=np.uint8
    )


class Raw:
    """os.preadv / os.pwritev of the same slots at the same queue depth, two ways:

    - ``runs``: the same file bytes as DiskPages moves, with the same calls (adjacent slots in
      one call, header and payload iovecs alternating; headers into a scratch buffer): the
      primary reference, what the I/O itself costs;
    - ``pages``: the payload bytes alone, one call per page (no headers at all).
    """

    def __init__(self, disk: DiskPages, threads: int) -> None:
        g = disk.geometry
        self.g = g
        self.fds = [
            os.open(os.path.join(disk.path, segment_name(s)), os.O_RDWR | os.O_DIRECT)
            for s in range(g.segments)
        ]
        self.pool = ThreadPoolExecutor(threads)
        self.threads = threads
        self.headers = [allocate_host_buffer(ALIGN * MAX_RUN) for _ in range(threads)]

    def run(self, slots: list[int], rows: list[memoryview], write: bool, runs: bool) -> None:
        """Move the pages of `slots` from or to `rows`, split across the threads."""
        n = len(slots)
        step = -(-n // min(self.threads, n))
        fn = os.pwritev if write else os.preadv
        g = self.g

        def chunk(t: int) -> None:
            lo, hi = t * step, min(n, (t + 1) * step)
            hdr = self.headers[t]
            i = lo
            while i < hi:
                j = i + 1
                if runs:
                    while (
                        j < hi
                        and j - i < MAX_RUN
                        and slots[j] == slots[j - 1] + 1
                        and g.place(slots[j])[0] == g.place(slots[i])[0]
                    ):
                        j += 1
                seg, off = g.place(slots[i])
                if runs:
                    iov: list[Any] = []
                    for k in range(i, j):
                        iov += (hdr[(k - i) * ALIGN : (k - i + 1) * ALIGN], rows[k])
                    assert fn(self.fds[seg], iov, off) == (j - i) * g.slot_bytes
                else:
                    assert fn(self.fds[seg], [rows[i]], off + ALIGN) == len(rows[i])
                i = j

        wait([self.pool.submit(chunk, t) for t in range(-(-n // step))])

    def close(self) -> None:
        """Release the threads and files."""
        self.pool.shutdown()
        for fd in self.fds:
            os.close(fd)


def throughput(
    root: Path, page: int, total: int, batch: int, threads: int, rounds: int
) -> dict[str, Any]:
    """GB/s of both sides in both directions for `total` bytes of `page` pages."""
    n = max(batch, total // page // batch * batch)
    path = root / f"tp-{page}"
    path.mkdir()
    disk = DiskPages.open(
        path,
        page_bytes=page,
        disk_bytes=n * (page + ALIGN),
        io_threads=threads,
        segment_bytes=256 * MB,
    )
    assert disk.io_mode == "direct", disk.stats().io_mode_reason
    arena = allocate_host_buffer(batch * page)
    rows = [memoryview(arena[i * page : (i + 1) * page]) for i in range(batch)]
    for i, k in enumerate(keys_for(batch)):
        arena[i * page : (i + 1) * page] = content(k, page)
    keys = keys_for(n, salt=1)
    raw = Raw(disk, threads)
    spent = {f"{who}_{d}": 0.0 for who in ("raw", "raw_pages", "disk") for d in ("read", "write")}

    def timed(name: str, fn: Callable[[], object]) -> None:
        t = time.perf_counter()
        fn()
        spent[name] += time.perf_counter() - t

    def disk_write(ks: list[bytes]) -> None:
        st = disk.submit_write(ks, rows).result()
        assert all(s is StoreStatus.STORED for s in st), st

    def disk_read(ks: list[bytes]) -> None:
        assert all(disk.submit_read(ks, rows).result())

    # The sides alternate batch by batch (a few ms each), so that load from other processes
    # falls on both alike; a round of writes leaves the slots to raw bytes, so ours are
    # written again (untimed) before the reads.
    for b in range(0, n, batch):  # untimed: the first write of a slot converts its extent
        disk_write(keys[b : b + batch])
    for _ in range(rounds):
        for b in range(0, n, batch):
            ks = keys[b : b + batch]
            disk.free(ks)
            timed("disk_write", lambda ks=ks: disk_write(ks))
            slots = [s for s in disk.lookup(ks) if s is not None]
            timed("raw_write", lambda s=slots: raw.run(s, rows, True, True))
            timed("raw_pages_write", lambda s=slots: raw.run(s, rows, True, False))
    disk.free(keys)
    for b in range(0, n, batch):
        disk_write(keys[b : b + batch])
    for _ in range(rounds):
        for b in range(0, n, batch):
            ks = keys[b : b + batch]
            slots = [s for s in disk.lookup(ks) if s is not None]
            timed("raw_read", lambda s=slots: raw.run(s, rows, False, True))
            timed("disk_read", lambda ks=ks: disk_read(ks))
            timed("raw_pages_read", lambda s=slots: raw.run(s, rows, False, False))
    st = disk.stats()
    assert st.corrupt_pages == 0 and st.hits == rounds * n
    raw.close()
    disk.close()
    shutil.rmtree(path)
    gbps = {k: rounds * n * page / v / 1e9 for k, v in spent.items()}
    return {"pages": n, "batch": batch, "threads": threads, "rounds": rounds, **gbps}


# -- faults -----------------------------------------------------------------------------------


def _open(path: Path, page: int, slots: int) -> DiskPages:
    return DiskPages.open(
        path, page_bytes=page, disk_bytes=slots * (page + ALIGN), segment_bytes=8 * (page + ALIGN)
    )


def _writer(path: Path, page: int, slots: int, first: int, ready: int) -> None:
    """In a forked child: write pages forever, evicting LRU pages when full; never returns."""
    try:
        disk = _open(path, page, slots)
        i = first
        while True:
            keys = keys_for(4, salt=i)
            disk.free(disk.victims(max(0, 4 - disk.stats().free)))
            disk.submit_write(keys, [content(k, page) for k in keys]).result()
            if i == first:
                os.write(ready, b"r")
            i += 1
    finally:
        os._exit(1)


def verify_all(disk: DiskPages) -> tuple[int, int, int]:
    """Read every page the index holds: (pages, hits, wrong pages served)."""
    keys = disk.victims(disk.stats().capacity)
    rows = [np.zeros(disk.page_bytes, np.uint8) for _ in keys]
    hits = disk.submit_read(keys, rows).result() if keys else []
    wrong = sum(
        1
        for k, h, r in zip(keys, hits, rows)
        if h and not np.array_equal(r, content(k, disk.page_bytes))
    )
    return len(keys), sum(hits), wrong


def kill_run(root: Path, kills: int, page: int = 16 * KB, slots: int = 64) -> dict[str, Any]:
    """`kills` children killed with SIGKILL mid-write; every page found after each verified."""
    path = root / "kill"
    path.mkdir()
    rng = random.Random(5)
    found = hits = wrong = corrupt = damaged = 0
    for run in range(kills):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _writer(path, page, slots, run * 1_000_000, w)
        os.close(w)
        assert os.read(r, 1) == b"r"
        os.close(r)
        time.sleep(rng.uniform(0, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with _open(path, page, slots) as disk:
            n, h, bad = verify_all(disk)
            st = disk.stats()
        found, hits, wrong = found + n, hits + h, wrong + bad
        corrupt, damaged = corrupt + st.corrupt_pages, damaged + st.damaged_at_open
        if (run + 1) % 10 == 0:
            print(f"  kill -9 {run + 1}/{kills}: {found} pages found, {wrong} wrong", flush=True)
    shutil.rmtree(path)
    return {
        "kills": kills,
        "pages_found": found,
        "hits": hits,
        "wrong_pages_served": wrong,
        "corrupt_pages_counted": corrupt,
        "damaged_headers_counted": damaged,
    }


def flip_run(root: Path, flips: int, page: int = 16 * KB, slots: int = 256) -> dict[str, Any]:
    """`flips` bits flipped in rounds of at most 100 over live pages; all counted, none served."""
    path = root / "flip"
    path.mkdir()
    rng = random.Random(9)
    slot_bytes = page + ALIGN
    done = damaged_total = counted = wrong = 0
    salt = 0
    while done < flips:
        with _open(path, page, slots) as disk:
            disk.free(disk.victims(slots))
            salt += 1
            keys = keys_for(slots, salt=salt)
            assert all(
                s.held for s in disk.submit_write(keys, [content(k, page) for k in keys]).result()
            )
            where = dict(zip(disk.lookup(keys), keys))
        n = min(100, flips - done)
        damaged: set[int] = set()
        for _ in range(n):
            slot = rng.randrange(slots)
            seg, i = divmod(slot, 8)
            off = i * slot_bytes + (
                rng.randrange(HEADER_BYTES) if rng.random() < 0.2 else ALIGN + rng.randrange(page)
            )
            with open(path / segment_name(seg), "r+b") as f:
                f.seek(off)
                b = f.read(1)[0]
                f.seek(off)
                f.write(bytes([b ^ (1 << rng.randrange(8))]))
            damaged.add(slot)
        with _open(path, page, slots) as disk:
            _, _, bad = verify_all(disk)
            st = disk.stats()
            lost = [s for s in range(slots) if disk.lookup([where[s]])[0] is None]
        assert set(lost) == damaged, "an undamaged page was lost or a damaged one kept"
        done += n
        damaged_total += len(damaged)
        counted += st.corrupt_pages + st.damaged_at_open
        wrong += bad
    shutil.rmtree(path)
    return {
        "bits_flipped": flips,
        "damaged_pages": damaged_total,
        "damaged_pages_counted": counted,
        "wrong_pages_served": wrong,
    }


def main() -> None:
    """Run the benchmark."""
    p = parser(__doc__)
    p.add_argument(
        "--dir", help="a directory on the disk to measure (default: a temporary one in .)"
    )
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--kills", type=int)
    p.add_argument("--flips", type=int)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tierkv-disk-bench-", dir=args.dir or "."))
    quick = args.quick
    figures: dict[str, Any] = {"dir": str(root), "direct_io": "both sides O_DIRECT"}
    ratios: dict[str, float] = {}
    rows = []
    try:
        for page, total in (
            (256 * KB, (64 if quick else 512) * MB),
            (16 * KB, (16 if quick else 128) * MB),
        ):
            f = throughput(root, page, total, args.batch, args.threads, 3 if quick else 5)
            name = f"{page // KB}KB"
            figures[name] = f
            for d in ("read", "write"):
                ratio = f[f"disk_{d}"] / f[f"raw_{d}"]
                pages = f[f"disk_{d}"] / f[f"raw_pages_{d}"]
                ratios[f"disk_{d}_{name}_vs_raw"] = round(ratio, 3)
                ratios[f"disk_{d}_{name}_vs_raw_pages"] = round(pages, 3)
                rows.append(
                    [name, d, f[f"raw_{d}"], f[f"raw_pages_{d}"], f[f"disk_{d}"], ratio, pages]
                )
        heads = ["page", "dir", "raw GB/s", "raw pages GB/s", "disk GB/s", "vs raw", "vs pages"]
        print(table(heads, [[c if isinstance(c, str) else f"{c:.2f}" for c in r] for r in rows]))
        logging.getLogger("tierkv.disk").setLevel(logging.ERROR)  # thousands of expected warnings
        kills = args.kills if args.kills is not None else (10 if quick else 100)
        flips = args.flips if args.flips is not None else (200 if quick else 1000)
        figures["kill"] = kill_run(root, kills)
        figures["flip"] = flip_run(root, flips)
        print(figures["kill"])
        print(figures["flip"])
        ratios["wrong_pages_served"] = (
            figures["kill"]["wrong_pages_served"] + figures["flip"]["wrong_pages_served"]
        )
        ratios["damaged_counted_of_damaged"] = round(
            figures["flip"]["damaged_pages_counted"] / max(1, figures["flip"]["damaged_pages"]), 3
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, figures, ratios)


if __name__ == "__main__":
    main()
