"""The cluster directory in Redis (issue 30): 16 node processes, 10^6 content keys.

    python benchmarks/directory.py [--quick] [--nodes 16] [--keys 1000000] [--cycles 1000]
                                   [--ttl 1.0] [--json FILE] [--locate-only]

A redis-server of its own (free loopback port, as the tests start one). Each node is a process
running the page server's `DirectoryAgent` (registration, refresh, publish of what it holds,
sweeps) over a set of keys it holds; the driver locates and publishes through a
`RedisDirectory` of its own. Phases:

1. fill: every node publishes its share of ``--keys`` (one holder per key), one after another;
2. locate: 1,000 random held keys per call, ``--locates`` calls (p50, p99);
3. publish: 10^4 new keys by a registered node, ``--publishes`` times (median, max);
4. memory: the server's used_memory growth over the fill, and MEMORY USAGE summed over the
   bucket hashes, per (key, node) entry;
5. churn: each node's share is cut to ``--churn-keys``; ``--cycles`` crash / restart cycles of
   random nodes, ``--workers`` at a time: a crash drops the agent without leaving (what a
   SIGKILL leaves in Redis), the restart registers the same address again; meanwhile a checker
   locates a sample of every node's keys without pause. Counted: answers (to requests sent)
   later than ttl after a crash that name the crashed number (target 0), and the time from a
   crash to the last answer naming it (target < ttl); plus ``--kills`` real SIGKILLs of node
   processes, respawned.

What fits 2 shared cores: the node processes run the directory side of a page server (its
agent), not a store and transports; the churn runs at ``--churn-keys`` keys per node (a restart
republishes them) and ttl 2 s (1 s lapsed live nodes here: a node process starved of the CPU
for a second by the other jobs on the box), so 1,000 cycles take minutes, not hours.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))


def keys_for(node: int, n: int, generation: int = 0) -> list[bytes]:
    """The ``n`` content keys node ``node`` holds (generation: a fresh set)."""
    out = []
    for i in range(n):
        d = bytearray(hashlib.blake2b(f"{generation}:{node}:{i}".encode(), digest_size=16).digest())
        d[0] &= 0x7F  # content keys: top bit clear
        out.append(bytes(d))
    return out


# -- a node process -------------------------------------------------------------------------
async def node_main(index: int, url: str, ttl: float) -> None:
    """Commands on stdin: fill N GEN, crash, restart, quit. Answers on stdout."""
    from tierkv.remote.membership.agent import DirectoryAgent
    from tierkv.remote.membership.redis_directory import RedisDirectory

    address = f"127.0.0.1:{17000 + index}"
    held: set[bytes] = set()
    loop = asyncio.get_running_loop()

    async def up() -> DirectoryAgent:
        d = RedisDirectory(url, ttl=ttl, timeout=5.0)  # (a contended box: slow replies)
        return await DirectoryAgent(d, address, lambda: set(held), linger=0).start()

    async def synced(agent: DirectoryAgent, limit: float = 120.0) -> None:
        agent.changed()
        deadline = time.perf_counter() + limit  # a node that never syncs says so, not hangs
        while not (agent.registered and agent.published == held):
            if time.perf_counter() > deadline:
                print(
                    f"STUCK node {index}: registered {agent.registered}, published "
                    f"{len(agent.published)} of {len(held)} held, number {agent.number}",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(3)
            await asyncio.sleep(0.005)  # (the benchmark watches the agent from outside)

    agent = await up()
    print("READY", agent.number, flush=True)
    while True:
        words = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not words or words[0] == "quit":
            await agent.aclose()
            return
        if words[0] == "fill":
            held = set(keys_for(index, int(words[1]), int(words[2])))
            gc.collect()
            gc.freeze()
            t = time.perf_counter()
            await synced(agent)
            print("FILLED", agent.number, time.perf_counter() - t, flush=True)
        elif words[0] == "crash":  # as SIGKILL leaves it: no leave, the connection dropped
            await agent.halt()
            print("CRASHED", agent.number, flush=True)
        elif words[0] == "restart":
            t = time.perf_counter()
            agent = await up()
            await synced(agent)
            print("UP", agent.number, time.perf_counter() - t, flush=True)


class Node:
    """One node process, driven over stdin/stdout."""

    def __init__(self, index: int, url: str, ttl: float) -> None:
        self.index, self.url, self.ttl = index, url, ttl
        self.number = 0
        self.spawn()

    def spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--node", str(self.index), self.url, str(self.ttl)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def expect(self, word: str) -> list[str]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline().split()
        if not line or line[0] != word:
            raise SystemExit(f"node {self.index} said {line!r}, expected {word}")
        return line[1:]

    def send(self, cmd: str) -> None:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(cmd + "\n")
        stdin.flush()

    def ready(self) -> None:
        self.number = int(self.expect("READY")[0])

    def command(self, cmd: str, answer: str) -> list[str]:
        self.send(cmd)
        return self.expect(answer)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def say(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- the driver -----------------------------------------------------------------------------
async def churn(d: Any, nodes: list[Node], args: Any, share: int, gen: int) -> dict[str, Any]:
    """Crash / restart cycles with a checker locating all the while."""
    ttl = args.ttl
    crashed_at: dict[int, float] = {}  # number -> when its crash was confirmed
    sample = {n.index: keys_for(n.index, share, gen)[:50] for n in nodes}
    probe = [k for ks in sample.values() for k in ks]
    stats = {"answers": 0, "dead_answers": 0, "checks": 0, "gone_s": []}
    stop = asyncio.Event()

    async def checker() -> None:
        while not stop.is_set():
            sent = time.monotonic()
            holders, _ = await d.holders(probe)
            stats["checks"] += 1
            for ns in holders:
                for n in ns:
                    stats["answers"] += 1
                    t = crashed_at.get(n)
                    if t is not None and sent > t + ttl:
                        stats["dead_answers"] += 1
            await asyncio.sleep(0)

    async def gone(old: int, keys: list[bytes], t0: float) -> float:
        """Seconds from the crash to the last answer (by its request's send time) that still
        named the crashed number: the node was out of every answer sent after that."""
        last = t0
        while True:
            sent = time.monotonic()
            holders, _ = await d.holders(keys)
            if all(old not in ns for ns in holders):
                return last - t0
            last = sent
            await asyncio.sleep(0.005)

    busy: set[int] = set()
    lock = asyncio.Lock()
    done = 0

    async def cycle(rng: random.Random) -> None:
        nonlocal done
        while done < args.cycles:
            async with lock:
                free = [n for n in nodes if n.index not in busy]
                node = rng.choice(free)
                busy.add(node.index)
                done += 1
                if done % 100 == 0:
                    say(f"{done} cycles")
            try:
                old = int((await asyncio.to_thread(node.command, "crash", "CRASHED"))[0])
                t0 = time.monotonic()
                crashed_at[old] = t0
                stats["gone_s"].append(await gone(old, sample[node.index], t0))
                words = await asyncio.to_thread(node.command, "restart", "UP")
                node.number = int(words[0])
            finally:
                busy.discard(node.index)

    check = asyncio.ensure_future(checker())
    t = time.perf_counter()
    await asyncio.gather(*(cycle(random.Random(w)) for w in range(args.workers)))
    elapsed = time.perf_counter() - t
    # real SIGKILLs: the process dies, a new one starts on the same address
    for i in range(args.kills):
        node = nodes[i % len(nodes)]
        old = node.number
        node.proc.kill()
        node.proc.wait()
        t0 = time.monotonic()
        crashed_at[old] = t0
        stats["gone_s"].append(await gone(old, sample[node.index], t0))
        node.spawn()
        await asyncio.to_thread(node.ready)
        await asyncio.to_thread(node.command, f"fill {share} {gen}", "FILLED")
    stop.set()
    await check
    gone: list[float] = stats.pop("gone_s")  # type: ignore[assignment]
    return {
        "cycles": args.cycles,
        "sigkills": args.kills,
        "elapsed_s": round(elapsed, 1),
        "checks": stats["checks"],
        "answers_checked": stats["answers"],
        "answers_naming_a_dead_node": stats["dead_answers"],
        "gone_max_s": round(max(gone), 3),
        "gone_p50_s": round(statistics.median(gone), 3),
    }


async def drive(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    from redis_server import RedisServer

    from tierkv.remote.membership.redis_directory import RedisDirectory

    figures: dict[str, Any] = {"nodes": args.nodes, "keys": args.keys, "ttl_s": args.ttl}
    with RedisServer() as srv:
        d = await RedisDirectory(srv.url, ttl=args.ttl, timeout=5.0).connect()
        client = d.client
        nodes = [Node(i, srv.url, args.ttl) for i in range(args.nodes)]
        try:
            for n in nodes:
                await asyncio.to_thread(n.ready)
            say("nodes up")
            base = (await client.info("memory"))["used_memory"]
            share = args.keys // args.nodes
            fill_s = []
            for n in nodes:  # one after another: a fill is the biggest publish there is
                words = await asyncio.to_thread(n.command, f"fill {share} 0", "FILLED")
                fill_s.append(float(words[1]))
            entries = share * len(nodes)
            say(f"filled {entries} keys")
            used = (await client.info("memory"))["used_memory"] - base
            usage = 0
            names = [k async for k in client.scan_iter(match=f"{d.namespace}:{{s*", count=1000)]
            for lo in range(0, len(names), 1000):
                pipe = client.pipeline(transaction=False)
                for k in names[lo : lo + 1000]:
                    pipe.memory_usage(k, samples=0)
                usage += sum(await pipe.execute())
            figures["fill_s_per_node_median"] = round(statistics.median(fill_s), 3)
            figures["memory_used_bytes_per_entry"] = round(used / entries, 1)
            figures["memory_usage_bytes_per_entry"] = round(usage / entries, 1)

            gc.collect()
            gc.freeze()  # 10^6 keys and tuples held here: no full collection inside a timing
            rng = random.Random(7)
            held = [(i, j) for i in range(len(nodes)) for j in range(share)]
            await client.config_resetstat()
            cpu0 = _cpu_s(srv.proc.pid if srv.proc else 0)
            lat = []
            wrong = 0
            for _ in range(args.locates):
                pick = rng.sample(held, 1000)
                keys = [_key(i, j) for i, j in pick]
                t = time.perf_counter()
                got = await d.locate(keys)
                lat.append((time.perf_counter() - t) * 1000)
                wrong += sum(g != (f"127.0.0.1:{17000 + i}",) for g, (i, _) in zip(got, pick))
            figures["locate_1000_p50_ms"] = round(pct(lat, 0.5), 3)
            figures["locate_1000_p99_ms"] = round(pct(lat, 0.99), 3)
            figures["locate_wrong_answers"] = wrong
            cpu = _cpu_s(srv.proc.pid if srv.proc else 0) - cpu0
            stats = await client.info("commandstats")
            # the node processes' refreshes are in there too: a few us each, a few per second
            usec = sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in _LOCATE_COMMANDS)
            figures["locate_1000_server_ms_per_call"] = round(usec / 1000 / args.locates, 3)
            # commandstats count command execution only (not parsing nor replying): the
            # server process's CPU time over the phase, per locate, counts everything
            figures["locate_1000_server_cpu_ms_per_call"] = round(cpu * 1000 / args.locates, 3)
            say(f"locate p50 {figures['locate_1000_p50_ms']} ms")
            figures["load_average_1m"] = round(os.getloadavg()[0], 2)
            if args.locate_only:  # --locate-only: the fill and the locate phase, no more
                return figures, _locate_ratios(figures)

            me = await d.register("127.0.0.1:16999")
            pub = []
            for r in range(args.publishes):
                fresh = keys_for(10_000 + r, 10_000, 1)
                t = time.perf_counter()
                assert await d.publish(me, fresh) == 10_000
                pub.append((time.perf_counter() - t) * 1000)
            await d.leave(me, "127.0.0.1:16999")
            figures["publish_10000_median_ms"] = round(statistics.median(pub), 3)
            figures["publish_10000_max_ms"] = round(max(pub), 3)

            say(f"publish median {figures['publish_10000_median_ms']} ms")
            small = min(args.churn_keys, share)
            for n in nodes:  # the churn at a size a restart can republish quickly
                await asyncio.to_thread(n.command, f"fill {small} 2", "FILLED")
            figures["churn"] = await churn(d, nodes, args, small, 2)
            figures["churn"]["keys_per_node"] = small
            for n in nodes:  # all stop (leave): every entry left is now a dead node's
                n.stop()
            while await client.exists(d.layout.sweep_lock):  # noqa: ASYNC110 - an agent sweeps
                await asyncio.sleep(0.1)
            figures["swept_after_churn"] = await d.sweep()
            names = [k async for k in client.scan_iter(match=f"{d.namespace}:{{s*", count=1000)]
            figures["entries_left_after_final_sweep"] = len(names) and sum(
                [await client.hlen(k) for k in names]
            )
        finally:
            for n in nodes:
                n.stop()
            await d.aclose()
    c = figures["churn"]
    ratios = {
        **_locate_ratios(figures),
        "publish 10^4 keys (median) / 50 ms": round(figures["publish_10000_median_ms"] / 50, 3),
        "publish 10^4 keys (max) / 50 ms": round(figures["publish_10000_max_ms"] / 50, 3),
        "Redis bytes per entry (used_memory) / 64": round(
            figures["memory_used_bytes_per_entry"] / 64, 3
        ),
        "Redis bytes per entry (MEMORY USAGE) / 64": round(
            figures["memory_usage_bytes_per_entry"] / 64, 3
        ),
        "crashed node last answered (max) / ttl": round(c["gone_max_s"] / args.ttl, 3),
        "answers naming a dead node (target 0)": c["answers_naming_a_dead_node"],
        "wrong locate answers (target 0)": figures["locate_wrong_answers"],
        "entries left after every node left and a sweep (target 0)": figures[
            "entries_left_after_final_sweep"
        ],
    }
    return figures, ratios


def _locate_ratios(figures: dict[str, Any]) -> dict[str, float]:
    return {
        "locate 1000 keys p50 / 2 ms": round(figures["locate_1000_p50_ms"] / 2.0, 3),
        "locate 1000 keys p99 / 10 ms": round(figures["locate_1000_p99_ms"] / 10.0, 3),
    }


_LOCATE_COMMANDS = ("eval", "evalsha", "hget")
"""What a locate runs on the server: the live set (EVAL), one HGET per key (standalone), or
the scripts (EVALSHA; a Cluster)."""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_KEYS: dict[int, list[bytes]] = {}


def _key(node: int, j: int) -> bytes:
    ks = _KEYS.get(node)
    if ks is None:
        ks = _KEYS[node] = keys_for(node, _SHARE[0])
    return ks[j]


_SHARE = [0]


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 with one line for sizes that cannot run, before redis-server starts (--nodes 0
    was a ZeroDivisionError, --ttl 0 or nan a DirectoryURLError traceback after the server
    had started, --keys under --nodes a share of no key per node)."""
    least = {"nodes": 1, "locates": 1, "publishes": 1, "workers": 1, "churn_keys": 1}
    least |= {"cycles": 0, "kills": 0, "keys": args.nodes}
    for name, low in least.items():
        if getattr(args, name) < low:
            flag = "--" + name.replace("_", "-")
            p.error(f"{flag} must be at least {low}, got {getattr(args, name)}")
    if not 0.05 <= args.ttl <= 3600:  # (the directory's bounds; NaN fails them too)
        p.error(f"--ttl must be in [0.05, 3600] s, got {args.ttl}")


def main() -> None:
    if sys.argv[1:2] == ["--node"]:
        asyncio.run(node_main(int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
        return
    from benchmarks._common import parser, write_json

    p = parser(__doc__)
    p.add_argument("--nodes", type=int, default=16, help="node processes (>= 1)")
    p.add_argument("--keys", type=int, default=1_000_000, help="keys filled, shared by the nodes")
    p.add_argument("--locates", type=int, default=2000, help="locate calls of 1,000 keys")
    p.add_argument("--publishes", type=int, default=20, help="publishes of 10^4 new keys")
    p.add_argument("--cycles", type=int, default=1000, help="crash / restart cycles of the churn")
    p.add_argument("--workers", type=int, default=12, help="crash / restart cycles at a time")
    p.add_argument("--kills", type=int, default=4, help="real SIGKILLs of node processes")
    p.add_argument("--churn-keys", type=int, default=2000, help="keys per node in the churn")
    p.add_argument("--ttl", type=float, default=2.0, help="the directory's ttl, s [0.05, 3600]")
    p.add_argument("--locate-only", action="store_true", help="the fill and the locate phase only")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.keys, args.locates, args.publishes = 4, 40_000, 200, 5
        args.cycles, args.workers, args.kills, args.churn_keys = 20, 2, 1, 500
    _check(p, args)
    _SHARE[0] = args.keys // args.nodes
    figures, ratios = asyncio.run(drive(args))
    for k, v in figures.items():
        print(f"{k:40s} {v}")
    for k, v in ratios.items():
        print(f"{k:48s} {v}")
    write_json(args.json, figures, ratios)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
