"""Hostile load against a page server (issue 14), measured in one run. One file (~590 lines):
the child server, the flood process and the fuzzer are this script re-run in other modes.

    python benchmarks/fuzz_server.py [--quick] [--frames N] [--repeat R] [--json FILE]
                                     [--plot FILE.png]

The page server runs in a child process (this script re-run with ``--serve``) that reports its
RSS, peak RSS (VmHWM) and traced Python memory on request, so the client's memory never counts.

  pre-auth memory  C connections each send a hello prefix announcing the largest hello (4 KiB)
                   and all of it but one byte, then stay (the most an unauthenticated
                   connection can make the server hold until its deadline); also C that send
                   4 KiB plus 1 MiB of garbage at once. Per connection: the server's traced
                   Python memory (tracemalloc) and RSS growth. Target <= 64 KiB.
  flood            an authenticated lookup of 64 keys timed quiet, then while a flood process
                   keeps 100 unauthenticated connections sending maximum-size garbage (an 8 MiB
                   length and 64 KiB of junk, reconnecting whenever dropped or after 5 s without
                   an answer; from an address of its own, 127.0.0.<3+r> in repetition r, as an
                   attacker's would be, so each repetition meets a server that has not penalized
                   it yet). R repetitions (default 5) on one server; the figure is the median of
                   the repetitions' ratios (flood median / quiet median). Target: <= 2x. Also
                   timed: a fresh connection (handshake and one lookup). The machine's load
                   average is reported before and after (the ratio follows it on a shared box).
                   Then the same with an impatient flood: each connection closes right after
                   its garbage and reconnects at once (from 127.0.0.<30+r>).
  fuzz             N frames (default 10^5; --frames 1000000 for the issue's figure): 1% to
                   unauthenticated connections, one each (random bytes; truncated, oversized,
                   deeply nested frames; hellos with bad proofs), the rest tagged on
                   authenticated connections (random ops and fields, pipelined in batches of
                   512; one batch in 64 ends in a connection-killing frame). Crashes: the server
                   must still answer (0 expected); its peak RSS is reported. The failed-handshake
                   penalty is off here and in the pre-auth memory phase (they come from one
                   address on purpose: they measure the parsers and what an admitted
                   connection costs); the flood phase runs with the defaults.
Nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import table, write_json
from tierkv import KVSpec
from tierkv.remote import PageServer
from tierkv.remote.protocol.control import Control
from tierkv.store import KVStore
from tierkv.transports.probe import Probe
from tierkv.transports.session import HELLO_MAX, PREFIX

SECRET = b"fuzz-bench"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="fp16", page_tokens=16)
KB = 1 << 10
WINDOW_S = 8.0  # each timed phase of the flood: longer than the server's 5 s hold of refusals
OPS = ["hello", "lookup", "acquire", "release", "reserve", "commit", "stats", "locate"]
OPS += ["watch", "unwatch", "hold", "zz", ""]


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                name, value = line.split(":")
                out[name] = int(value.split()[0]) * KB
    return out


async def serve(preauth_cap: int, trace: bool, penalty: bool) -> None:
    """Child mode: serve, print the address, answer "stats" lines on stdin until EOF."""
    if trace:
        tracemalloc.start()
    store = KVStore(SPEC, device_bytes=SPEC.page_bytes, host_bytes=64 * SPEC.page_bytes)
    async with (
        store,
        PageServer(
            store,
            secret=SECRET,
            timeout=5.0,
            max_preauth_per_peer=preauth_cap,
            max_preauth_failures=64 if penalty else None,
        ) as srv,
    ):
        print(srv.address, flush=True)
        loop = asyncio.get_running_loop()
        logging.getLogger("tierkv.security").setLevel(logging.ERROR)  # counted, not printed
        while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip():
            gc.collect()
            if line.strip() == "reset" and trace:
                tracemalloc.reset_peak()
            st = _status()
            traced, peak = tracemalloc.get_traced_memory() if trace else (0, 0)
            numeric = {k: v for k, v in srv.stats().items() if isinstance(v, int)}
            reply = {"rss": st["VmRSS"], "hwm": st["VmHWM"], "traced": traced, **numeric}
            reply["traced_peak"] = peak
            t = os.times()
            reply["cpu_us"] = int((t.user + t.system) * 1e6)
            reply["sessions"] = srv.control.sessions
            print(json.dumps(reply), flush=True)


class Child:
    """A page server in a child process."""

    def __init__(self, preauth_cap: int = 32, trace: bool = False, penalty: bool = True) -> None:
        args = [sys.executable, __file__, "--serve", str(preauth_cap), str(int(trace))]
        args.append(str(int(penalty)))
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        host, _, port = self.address.rpartition(":")
        self.host, self.port = host, int(port)

    def stats(self, command: str = "stats") -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the server died (exit {self.proc.poll()})")
        return dict(json.loads(line))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _settle(child: Child, seconds: float = 0.3) -> dict[str, Any]:
    time.sleep(seconds)
    return child.stats()


def preauth_memory(conns: int) -> dict[str, Any]:
    """Per connection: what an unauthenticated connection makes the server hold."""
    child = Child(preauth_cap=10 * conns, trace=True, penalty=False)
    out: dict[str, Any] = {}
    try:
        for label, blob in (
            ("incomplete hello", PREFIX.pack(HELLO_MAX) + bytes(HELLO_MAX - 1)),
            ("hello + 1 MiB garbage", PREFIX.pack(HELLO_MAX) + os.urandom(HELLO_MAX + (1 << 20))),
        ):
            time.sleep(0.5)
            base = child.stats("reset")
            socks = []
            for _ in range(conns):
                s = socket.create_connection((child.host, child.port))
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.send(blob)
                socks.append(s)
            held = _settle(child, 1.0)
            out[label] = {
                "traced_per_conn": (held["traced"] - base["traced"]) / conns,
                "traced_peak_per_conn": (held["traced_peak"] - base["traced"]) / conns,
                "rss_per_conn": max(0, held["rss"] - base["rss"]) / conns,
                "sessions": held["sessions"],
            }
            for s in socks:
                s.close()
            print(f"  {label}: {out[label]}", file=sys.stderr, flush=True)
    finally:
        child.close()
    return out


async def flood_main(host: str, port: int, conns: int, source: str, patient: bool) -> None:
    """Flood mode: ``conns`` connections sending maximum-size garbage, until killed; each
    waits (up to 5 s) for the server to end it when ``patient``, else closes and reconnects
    at once."""
    junk = PREFIX.pack(8 << 20) + os.urandom(64 * KB)
    sent = 0

    async def one() -> None:
        nonlocal sent
        while True:
            try:
                # from an address of its own (as an attacker's would be): the per-address
                # caps then stop it, not the legitimate client
                r, w = await asyncio.open_connection(host, port, local_addr=(source, 0))
                w.write(junk)
                await w.drain()
                sent += 1
                if patient:
                    await asyncio.wait_for(r.read(), 5)
                w.close()
            except (OSError, TimeoutError):
                await asyncio.sleep(0.001)

    async def report() -> None:
        await asyncio.sleep(0.5)
        print(f"flooding {sent}", flush=True)  # the parent starts timing from here

    await asyncio.gather(report(), *(one() for _ in range(conns)))


async def _lookups(address: str, n: int, seconds: float) -> tuple[list[float], list[float]]:
    """Lookups on one session (at least ``n``, and for at least ``seconds``: a flood's window
    must span the server's hold of refused connections, so reconnects fall in it), and fresh
    connections (handshake + one lookup)."""
    keys = [bytes([i % 256]) * 32 for i in range(64)]
    fresh = []
    for _ in range(max(1, n // 10)):
        t0 = time.perf_counter()
        ctl = Control(address, secret=SECRET, timeout=30)
        await ctl.open()
        await ctl.call("lookup", keys=keys)
        fresh.append(time.perf_counter() - t0)
        await ctl.aclose()
    ctl = Control(address, secret=SECRET, timeout=30)
    await ctl.open()
    out: list[float] = []
    end = time.perf_counter() + seconds
    try:
        while len(out) < n or time.perf_counter() < end:
            t0 = time.perf_counter()
            await ctl.call("lookup", keys=keys)
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.002)
    finally:
        await ctl.aclose()
    return out, fresh


def _flood_once(child: Child, conns: int, calls: int, source: str, patient: bool) -> dict[str, Any]:
    """One repetition: quiet lookups, then lookups while a flood process runs from ``source``."""
    base = child.stats()
    t0 = time.perf_counter()
    quiet, quiet_fresh = asyncio.run(_lookups(child.address, calls, WINDOW_S))
    quiet_cpu = (child.stats()["cpu_us"] - base["cpu_us"]) / 1e6 / (time.perf_counter() - t0)
    args = [sys.executable, __file__, "--flood", child.host, str(child.port), str(conns), source]
    args.append(str(int(patient)))
    flooder = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    try:
        assert flooder.stdout is not None
        flooder.stdout.readline()  # its connections are running
        time.sleep(0.5)
        base = child.stats()
        t0 = time.perf_counter()
        loud, loud_fresh = asyncio.run(_lookups(child.address, calls, WINDOW_S))
        dt = time.perf_counter() - t0
        after = child.stats()
    finally:
        flooder.kill()
        flooder.wait()
    refused = sum(after[k] - base[k] for k in ("protocol_error_total", "budget_hit_total"))
    cpu = (after["cpu_us"] - base["cpu_us"]) / 1e6
    q, f = statistics.median(quiet), statistics.median(loud)
    return {
        "quiet_ms": [x * 1e3 for x in quiet],
        "flood_ms": [x * 1e3 for x in loud],
        "quiet_median_ms": q * 1e3,
        "flood_median_ms": f * 1e3,
        "ratio": f / q,
        "quiet_p99_ms": sorted(quiet)[int(0.99 * len(quiet))] * 1e3,
        "flood_p99_ms": sorted(loud)[int(0.99 * len(loud))] * 1e3,
        "quiet_connect_median_ms": statistics.median(quiet_fresh) * 1e3,
        "flood_connect_median_ms": statistics.median(loud_fresh) * 1e3,
        "flood_connections_refused_per_s": refused / dt,
        # the server's CPU beyond the quiet phase's share, per connection it refused
        "server_cpu_us_per_flood_connection": max(0.0, cpu - quiet_cpu * dt)
        / max(1, refused)
        * 1e6,
        "server_cpu_share_during_flood": cpu / dt,
        "server_cpu_share_quiet": quiet_cpu,
        "refused_held": after["refused_held"],
        "server_rss_after_MB": after["rss"] / 2**20,
    }


def flood(conns: int, calls: int, repeat: int, patient: bool = True) -> dict[str, Any]:
    """``repeat`` repetitions on one server, each flooding from a new address; the figures
    are the medians over the repetitions (each repetition's own in ``runs``)."""
    child = Child()
    load_before = os.getloadavg()
    runs = []
    try:
        for r in range(repeat):
            source = f"127.0.0.{(3 if patient else 30) + r}"
            run = _flood_once(child, conns, calls, source, patient)
            runs.append(run)
            print(
                f"  flood {r + 1}/{repeat}: {run['quiet_median_ms']:.2f} -> "
                f"{run['flood_median_ms']:.2f} ms ({run['ratio']:.2f}x), server CPU "
                f"{run['server_cpu_share_during_flood']:.2f}, refused "
                f"{run['flood_connections_refused_per_s']:.0f}/s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        child.close()
    out: dict[str, Any] = {
        k: statistics.median(run[k] for run in runs)
        for k in runs[0]
        if not isinstance(runs[0][k], list)
    }
    out["ratios"] = [run["ratio"] for run in runs]
    out["quiet_ms"] = [x for run in runs for x in run["quiet_ms"]]
    out["flood_ms"] = [x for run in runs for x in run["flood_ms"]]
    out["runs"] = [{k: v for k, v in run.items() if not isinstance(v, list)} for run in runs]
    out["load_average_before"] = list(load_before)
    out["load_average_after"] = list(os.getloadavg())
    return out


# -- fuzzed frames ------------------------------------------------------------------------------


def _junk(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.randrange(-(2**63), 2**63)
    if kind == 1:
        return rng.randbytes(rng.randrange(0, 80))
    if kind == 2:
        return "".join(rng.choice("abc:0123.") for _ in range(rng.randrange(0, 30)))
    if kind == 3:
        return None
    if kind == 4:
        return rng.random() < 0.5
    if kind == 5:
        return rng.random()
    if kind == 6:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(0, 8))]
    if kind == 7:
        return [rng.randbytes(rng.choice((0, 16, 32, 64, 65))) for _ in range(rng.randrange(0, 40))]
    return {str(rng.randrange(5)): _junk(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def _request(rng: random.Random, rid: int) -> dict[str, Any]:
    msg: dict[str, Any] = {"op": rng.choice(OPS), "id": rid}
    for name in ("keys", "lease", "ok", "node", "add", "drop", "full", "slots"):
        if rng.random() < 0.4:
            msg[name] = _junk(rng)
    if rng.random() < 0.5:
        msg["keys"] = [rng.randbytes(32) for _ in range(rng.randrange(0, 64))]
    return msg


def _preauth_blob(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 512))
    if kind == 1:
        return PREFIX.pack(rng.randrange(2**32))
    if kind == 2:
        depth = rng.randrange(1, 5000)
        body = b"\x91" * depth + b"\xc0"
        return PREFIX.pack(len(body)) + body
    if kind == 3:
        body = msgpack.packb(_request(rng, 1))
        return (PREFIX.pack(len(body)) + body)[: rng.randrange(0, len(body) + 5)]
    if kind == 4:
        auth = {"op": "auth", "v": 3, "role": "client", "id": "x", "nonce": rng.randbytes(16)}
        body = msgpack.packb({**auth, "mac": rng.randbytes(32)})
        return PREFIX.pack(len(body)) + body
    body = msgpack.packb({"op": "auth", "junk": [_junk(rng) for _ in range(20)]})
    return PREFIX.pack(len(body)) + body


def fuzz(frames: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    child = Child(preauth_cap=64, penalty=False)
    sent = conns = closed = 0
    t0 = time.perf_counter()
    last = t0
    try:
        preauth = max(1, frames // 100)
        for _ in range(preauth):
            with Probe.connect(child.host, child.port) as p:
                p.recv()
                try:
                    p.sock.sendall(_preauth_blob(rng))
                    p.sock.shutdown(socket.SHUT_WR)
                    while p.sock.recv(1 << 16):
                        pass
                except OSError:
                    pass
            sent += 1
            conns += 1
            now = time.perf_counter()
            if now - last > 5:
                last = now
                print(f"  fuzz: {sent:,} unauthenticated frames", file=sys.stderr, flush=True)
        batch = 512
        while sent < frames:
            with Probe.connect(child.host, child.port, timeout=30) as p:
                p.handshake(SECRET)
                conns += 1
                for b in range(64):
                    n = min(batch, frames - sent)
                    if n <= 0:
                        break
                    blob = b"".join(p.frame(_request(rng, i)) for i in range(n))
                    killer = b == 63
                    if killer:
                        blob += _preauth_blob(rng)  # untagged: ends the session
                    sent += n + killer
                    try:
                        p.sock.sendall(blob)
                        answered = sum(p.recv() is not None for _ in range(n))
                    except OSError:
                        answered = -1
                    if answered < n:  # a frame over a decode limit: the server ended it
                        closed += 1
                        break
                    if killer:
                        break
                    now = time.perf_counter()
                    if now - last > 5:
                        last = now
                        print(f"  fuzz: {sent:,} frames", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - t0
        with Probe.connect(child.host, child.port) as p:
            p.handshake(SECRET)
            p.send({"op": "lookup", "id": 1, "keys": [b"k" * 32]})
            alive = p.recv() == {"id": 1, "n": 0}
        st = child.stats()
    finally:
        child.close()
    return {
        "frames": sent,
        "connections": conns,
        "seconds": elapsed,
        "frames_per_s": sent / elapsed,
        "sessions_ended_by_a_limit": closed,
        "server_alive": alive,
        "crashes": 0 if alive else 1,
        "peak_rss_MB": st["hwm"] / 2**20,
        "rss_MB": st["rss"] / 2**20,
        "protocol_errors": st["protocol_error_total"],
        "auth_refused": st["auth_refused_total"],
        "leases_left": st["leases"],
    }


def plot(fl: dict[str, Any], path: str) -> None:
    """Latency distributions of the legitimate lookup, quiet and under flood."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist([fl["quiet_ms"], fl["flood_ms"]], bins=40, label=["quiet", "100-connection flood"])
    ax.axvline(2 * fl["quiet_median_ms"], color="k", lw=0.8, label="2x quiet median")
    ax.set_xlabel("authenticated lookup of 64 keys, ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _flood_rows(label: str, fl: dict[str, Any]) -> list[list[str]]:
    """The table rows of one flood mode."""
    q, f = fl["quiet_connect_median_ms"], fl["flood_connect_median_ms"]
    return [
        [
            f"{label}: lookup median ms, quiet -> flood (median of {len(fl['ratios'])} runs)",
            f"{fl['quiet_median_ms']:.2f} -> {fl['flood_median_ms']:.2f}",
            "<= 2x",
            f"{fl['ratio']:.2f}x",
        ],
        [f"{label}: flood / quiet per run", " ".join(f"{r:.2f}" for r in fl["ratios"]), "", ""],
        [
            f"{label}: lookup p99 ms, quiet -> flood",
            f"{fl['quiet_p99_ms']:.2f} -> {fl['flood_p99_ms']:.2f}",
            "",
            f"{fl['flood_p99_ms'] / fl['quiet_p99_ms']:.2f}x",
        ],
        [f"{label}: connect + handshake + lookup median ms", f"{q:.2f} -> {f:.2f}", "", ""],
        [
            f"{label}: server CPU share of a core, quiet -> flood (us per refusal)",
            f"{fl['server_cpu_share_quiet']:.2f} -> {fl['server_cpu_share_during_flood']:.2f} "
            f"({fl['server_cpu_us_per_flood_connection']:.0f})",
            "",
            "",
        ],
        [
            f"{label}: connections refused per s",
            f"{fl['flood_connections_refused_per_s']:.0f}",
            "",
            "",
        ],
        [
            f"{label}: load average (1, 5, 15 min) before -> after",
            " ".join(f"{x:.2f}" for x in fl["load_average_before"])
            + " -> "
            + " ".join(f"{x:.2f}" for x in fl["load_average_after"]),
            "",
            "",
        ],
    ]


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer connections, calls, frames")
    ap.add_argument("--frames", type=int, help="fuzzed frames (default 10^5; 10^4 quick)")
    ap.add_argument("--repeat", type=int, help="flood repetitions (default 5; 3 quick)")
    ap.add_argument("--json", metavar="FILE", help="write {figures, ratios} here")
    ap.add_argument("--plot", metavar="PNG", help="draw the flood latencies (needs matplotlib)")
    args = ap.parse_args()
    conns, calls = (64, 100) if args.quick else (256, 400)
    frames = args.frames or (10_000 if args.quick else 100_000)
    print("measuring pre-auth memory ...", file=sys.stderr, flush=True)
    mem = preauth_memory(conns)
    print("measuring a legitimate request under a flood ...", file=sys.stderr, flush=True)
    repeat = args.repeat or (3 if args.quick else 5)
    fl = flood(100, calls, repeat)
    print("... and under a flood that reconnects at once ...", file=sys.stderr, flush=True)
    fi = flood(100, calls, repeat, patient=False)
    print(f"fuzzing {frames:,} frames ...", file=sys.stderr, flush=True)
    fz = fuzz(frames)
    worst = max(max(v["traced_per_conn"], v["rss_per_conn"]) for v in mem.values())
    rows = [
        [
            f"pre-auth: {k}, KiB per connection (held / peak traced / RSS)",
            f"{v['traced_per_conn'] / KB:.1f} / {v['traced_peak_per_conn'] / KB:.1f} / "
            f"{v['rss_per_conn'] / KB:.1f}",
            "<= 64",
            "",
        ]
        for k, v in mem.items()
    ]
    rows += _flood_rows("flood", fl) + _flood_rows("impatient flood", fi)
    rows.append(
        [
            f"fuzzed frames ({fz['frames']:,}, {fz['frames_per_s']:.0f}/s): crashes",
            str(fz["crashes"]),
            "0",
            "",
        ]
    )
    rows.append(["server peak RSS during the fuzz, MB", f"{fz['peak_rss_MB']:.0f}", "bounded", ""])
    print(table(["figure", "value", "target", "ratio"], rows))
    figures = {
        "preauth": mem,
        "flood": {k: v for k, v in fl.items() if k not in ("quiet_ms", "flood_ms")},
        "impatient_flood": {k: v for k, v in fi.items() if k not in ("quiet_ms", "flood_ms")},
        "fuzz": fz,
    }
    ratios = {
        "pre-auth KiB per connection / 64": worst / (64 * KB),
        "flood median / quiet median": fl["ratio"],
        "impatient flood median / quiet median": fi["ratio"],
    }
    write_json(args.json, figures, ratios)
    if args.plot:
        try:
            plot(fl, args.plot)
        except ImportError as exc:
            print(f"--plot needs matplotlib ({exc})", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        asyncio.run(serve(int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"))
    elif len(sys.argv) > 1 and sys.argv[1] == "--flood":
        argv = sys.argv
        asyncio.run(flood_main(argv[2], int(argv[3]), int(argv[4]), argv[5], argv[6] == "1"))
    else:
        sys.exit(main())
