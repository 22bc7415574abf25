"""tierkv's tiers for vLLM against vLLM's own ``fs`` tier, inside vLLM 0.33's manager.

    python benchmarks/vllm_tier.py [--quick] [--dir DIR] [--json FILE] [--rounds 6]
                                   [--batch 32] [--fs-threads 16] [--io-threads 8]
                                   [--check-chunks N]

Both tiers are built by vLLM's spec and tier factory into one `TieringOffloadingManager` (no
GPU: the primary tier is vLLM's shared region in /dev/shm), over the same primary rows, with
their files under the same directory (``DIR/tierkv``, ``DIR/fs``). For chunk sizes vLLM uses
(0.5, 1 and 2 MB): each round fills the primary rows with fresh random bytes and fresh keys,
and each side (order alternating by round) stores a batch of `--batch` chunks (vLLM's
submit_store, then drain_jobs) and loads them back into zeroed rows (submit_load, drain_jobs),
every byte compared. GB/s over all rounds. Lookup cost per chunk: tierkv answers on the
scheduler thread from its index; the fs tier's cost is its scheduler-thread calls (lookup,
flush) plus its lookup thread's batch_lookup (faccessat per chunk), and a RETRY (one engine
step) before the answer, which this figure does not count.

`--check-chunks N`: N more chunks (1 MB) stored and loaded through the tierkv tier, every byte
compared: the mismatch count over many chunks (issue 27 asks 0 over 10^5).

The same rounds run on tierkv's page-server tier (``peer``: a ``tierkv serve`` process on
loopback, tcp, its page one chunk) and its cold pool (``cold``: host RAM, codec ``none``),
each a tier of the same manager; their throughput is reported against the fs tier's, and the
page-server tier's against a `RemoteCluster` alone on the same server and chunks (the limit:
what the server and its transport allow here), ``peer_raw`` (``--also`` picks them).

Ratios: tierkv / fs throughput (target >= 1.0 for the disk tier), fs / tierkv lookup cost
(target >= 1.0).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from benchmarks._common import table, write_json

MB = 1 << 20


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds, 16 chunks a batch")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--dir", default=None, help="where both tiers keep files (default: a temp dir)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--fs-threads", type=int, default=16, help="vLLM's default: 16 + 16")
    p.add_argument(
        "--io-threads", type=int, default=8, help="tierkv disk I/O threads (its default)"
    )
    p.add_argument("--check-chunks", type=int, default=0)
    p.add_argument("--also", default="peer,cold", help="tiers run beside disk and fs: peer, cold")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.batch = 3, 16
    return a


def setup(
    root: Path, chunk: int, batch: int, a: argparse.Namespace, disk_chunks: int, peer: str
) -> Any:
    from page_server_proc import SECRET
    from vllm_driver import TIERKV, build

    (root / "tierkv").mkdir(parents=True)
    (root / "fs").mkdir(parents=True)
    tiers = [
        {"type": "TierKVDiskTier", "module_path": TIERKV, "path": str(root / "tierkv"),
         "disk_bytes": disk_chunks * (chunk + 8192), "io_threads": a.io_threads},
        {"type": "fs", "root_dir": str(root / "fs"), "n_read_threads": a.fs_threads,
         "n_write_threads": a.fs_threads},
        {"type": "TierKVPeerTier", "module_path": TIERKV, "peers": [peer], "secret": SECRET,
         "timeout": 30.0},
        {"type": "TierKVColdTier", "module_path": TIERKV, "cold_bytes": 2 * batch * chunk},
    ]  # fmt: skip
    block = chunk // 8
    return build(tiers, cpu_chunks=batch, block_bytes=block, blocks_per_chunk=8)


def job(job_id: int, keys: list[bytes], promotion: bool) -> Any:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    return TransferJob(
        job_id=job_id,
        keys=keys,
        chunk_ids=np.arange(len(keys), dtype=np.int32),
        is_promotion=promotion,
        req_context=ReqContext(req_id=f"bench-{job_id}"),
    )


def timed(tier: Any, submit: Any, jb: Any) -> float:
    t0 = time.perf_counter()
    submit(jb)
    tier.drain_jobs()
    dt = time.perf_counter() - t0
    (res,) = list(tier.get_finished_jobs())
    if not res.success:
        raise RuntimeError(f"{tier.tier_type}: job {jb.job_id} failed")
    return dt


def measure(chunk: int, a: argparse.Namespace, root: Path, ids: Any) -> dict[str, Any]:
    from page_server_proc import PageServerProc
    from vllm_driver import key

    server = PageServerProc(chunk, pages=2 * a.batch)
    manager = setup(
        root, chunk, a.batch, a, (a.rounds + 1) * a.batch + 64, server.address
    )  # check frees as it goes
    ours, fs, peer, cold = manager.secondary_tiers
    tiers = {"ours": ours, "fs": fs, "peer": peer, "cold": cold}
    names = ["ours", "fs", *(n for n in a.also.split(",") if n in ("peer", "cold"))]
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.frombuffer(view, dtype=np.uint8).reshape(view.shape[0], -1)[: a.batch]
    rng = np.random.default_rng(chunk)
    t = {n: [0.0, 0.0] for n in names}
    mismatches = dict.fromkeys(names, 0)
    try:
        for r in range(a.rounds):
            data = rng.integers(0, 256, rows.shape, dtype=np.uint8)
            turn = r % len(names)
            sides = [(n, tiers[n]) for n in names[turn:] + names[:turn]]  # first by turns
            for name, tier in sides:
                keys = [key(i, f"{chunk}-{r}-{name}".encode()) for i in range(a.batch)]
                rows[:] = data
                t[name][0] += timed(tier, tier.submit_store, job(next(ids), keys, False))
                rows[:] = 0
                t[name][1] += timed(tier, tier.submit_load, job(next(ids), keys, True))
                mismatches[name] += int(np.sum(np.any(rows != data, axis=1)))
        # lookup cost per chunk, over the keys of the last round
        n = a.batch
        ctx = job(next(ids), [], False).req_context
        keys_ours = [key(i, f"{chunk}-{a.rounds - 1}-ours".encode()) for i in range(n)]
        keys_fs = [key(i, f"{chunk}-{a.rounds - 1}-fs".encode()) for i in range(n)]
        t0 = time.perf_counter()
        answers = [ours.lookup(k, ctx).name for k in keys_ours]
        lookup_ours = (time.perf_counter() - t0) / n
        assert answers == ["HIT"] * n, answers
        t0 = time.perf_counter()
        for k in keys_fs:
            fs.lookup(k, ctx)  # RETRY: queued for fs's lookup thread
        fs._lookup_manager.flush()
        t1 = time.perf_counter()
        found = list(fs._lookup_manager.batch_lookup(keys_fs, ctx))  # its thread's work
        lookup_fs = (t1 - t0 + time.perf_counter() - t1) / n
        assert all(found)
        fs.on_request_finished(ctx)
        ours.on_request_finished(ctx)
        checked = check(ours, rows, a.check_chunks, chunk, ids) if chunk == MB else None
        if "peer" in names:  # the limit: RemoteCluster alone, the same server and chunks
            t["peer_raw"] = raw_peer(server.address, rows, a.rounds, chunk)
    finally:
        del rows
        manager.shutdown()
        server.kill()
    total = a.rounds * a.batch * chunk / 1e9
    out = {
        "chunk_bytes": chunk,
        "chunks_per_side": a.rounds * a.batch,
        "store_gbps": {k: total / v[0] for k, v in t.items()},
        "load_gbps": {k: total / v[1] for k, v in t.items()},
        "lookup_us_per_chunk": {"ours": lookup_ours * 1e6, "fs": lookup_fs * 1e6},
        "peer_address": server.address,
        "mismatched_chunks": mismatches,
        "io_mode": ours.disk.io_mode if not ours.disk._closed else None,
    }
    if checked is not None:
        out["check"] = checked
    return out


def raw_peer(address: str, rows: Any, rounds: int, chunk: int) -> list[float]:
    """Seconds to publish and load ``rounds`` batches of ``rows`` with a `RemoteCluster` of
    its own (no vLLM, no tier): what the page server and its transport allow here."""
    import asyncio

    from page_server_proc import SECRET
    from vllm_driver import key

    from tierkv.integrations.vllm.keys import PageKeys

    pk = PageKeys(b"raw-peer-%d" % chunk)
    slots = list(range(len(rows)))

    async def go() -> list[float]:
        from tierkv.remote import RemoteCluster

        c = RemoteCluster([address], secret=bytes.fromhex(SECRET), timeout=30.0)
        spent = [0.0, 0.0]
        try:
            for r in range(rounds):
                keys = pk.many(key(i, b"raw-%d" % r) for i in slots)
                t0 = time.perf_counter()
                await c.publish(keys, rows, slots)
                t1 = time.perf_counter()
                if await c.load(keys, rows, slots) != len(keys):
                    raise RuntimeError("raw peer load came back short")
                spent[0] += t1 - t0
                spent[1] += time.perf_counter() - t1
        finally:
            await c.aclose()
        return spent

    return asyncio.run(go())


def check(tier: Any, rows: Any, n: int, chunk: int, ids: Any) -> dict[str, int]:
    """`n` chunks stored and loaded through the tierkv tier, every byte compared."""
    from vllm_driver import key

    rng = np.random.default_rng(7)
    bad = done = 0
    while done < n:
        m = min(len(rows), n - done)
        data = rng.integers(0, 256, (m, rows.shape[1]), dtype=np.uint8)
        keys = [key(done + i, b"check") for i in range(m)]
        rows[:m] = data
        timed(tier, tier.submit_store, job(next(ids), keys, False))
        rows[:m] = 0
        timed(tier, tier.submit_load, job(next(ids), keys, True))
        bad += int(np.sum(np.any(rows[:m] != data, axis=1)))
        tier.disk.free([tier.keys(k) for k in keys])  # room for the next batch
        done += m
    return {"chunks": done, "mismatched": bad}


def main() -> None:
    a = args()
    logging.basicConfig(level=logging.ERROR)
    import itertools

    ids = itertools.count()
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="vllm-tier-", dir="/var/tmp"))
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    rows: list[list[Any]] = []
    peers: list[list[Any]] = []
    try:
        for chunk in (MB // 2, MB, 2 * MB):
            root = base / f"c{chunk}"
            try:
                f = measure(chunk, a, root, ids)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            name = f"{chunk // 1024}KB"
            figures[name] = f
            ratios[name] = {
                "store_vs_fs": f["store_gbps"]["ours"] / f["store_gbps"]["fs"],
                "load_vs_fs": f["load_gbps"]["ours"] / f["load_gbps"]["fs"],
                "lookup_fs_over_ours": f["lookup_us_per_chunk"]["fs"]
                / f["lookup_us_per_chunk"]["ours"],
            }
            for side in ("peer", "cold"):
                if side in f["store_gbps"]:
                    ratios[name][f"{side}_store_vs_fs"] = (
                        f["store_gbps"][side] / f["store_gbps"]["fs"]
                    )
                    ratios[name][f"{side}_load_vs_fs"] = f["load_gbps"][side] / f["load_gbps"]["fs"]
                    if side == "peer" and "peer_raw" in f["store_gbps"]:
                        for way in ("store", "load"):
                            ratios[name][f"peer_{way}_vs_remote_cluster"] = (
                                f[f"{way}_gbps"]["peer"] / f[f"{way}_gbps"]["peer_raw"]
                            )
                    r = ratios[name]
                    peers.append([
                        name, side, f["store_gbps"][side], r[f"{side}_store_vs_fs"],
                        r.get(f"{side}_store_vs_remote_cluster", ""), f["load_gbps"][side],
                        r[f"{side}_load_vs_fs"], r.get(f"{side}_load_vs_remote_cluster", ""),
                        f["mismatched_chunks"][side],
                    ])  # fmt: skip
            rows.append([
                name, f["store_gbps"]["ours"], f["store_gbps"]["fs"], ratios[name]["store_vs_fs"],
                f["load_gbps"]["ours"], f["load_gbps"]["fs"], ratios[name]["load_vs_fs"],
                f["lookup_us_per_chunk"]["ours"], f["lookup_us_per_chunk"]["fs"],
                f["mismatched_chunks"]["ours"] + f["mismatched_chunks"]["fs"],
            ])  # fmt: skip
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(table(
        ["chunk", "store GB/s tierkv", "fs", "ratio (>=1)", "load GB/s tierkv", "fs",
         "ratio (>=1)", "lookup us tierkv", "fs", "mismatches"], rows,
    ))  # fmt: skip
    if peers:
        print(table(
            ["chunk", "tier", "store GB/s", "vs fs", "vs RemoteCluster", "load GB/s", "vs fs",
             "vs RemoteCluster", "mismatches"], peers,
        ))  # fmt: skip
    if "check" in figures.get("1024KB", {}):
        print("check:", figures["1024KB"]["check"])
    write_json(a.json, figures, ratios)


if __name__ == "__main__":
    main()
