"""Prefill / decode sharing across processes: one process computes a long prompt's KV, two others
load it (through shm, then through tcp; or from Redis) instead of recomputing it, and decode on.

    python examples/prefill_decode.py [--prompt 1024] [--generate 32]
    python examples/prefill_decode.py --shared redis [--redis-url URL [--redis-cluster]]

    prefill process                                 decode process  (x2, in parallel)
    TinyLlama(prompt) -> KVStore -> PageServer      1. recompute: prompt -> tokens A (timed)
                       host tier  (shm + tcp)  ──>  2. shm: import_prefix (timed) -> tokens B
                                               ──>  3. tcp: import_prefix (timed) -> tokens C
                                                    A == B == C ?

With ``--shared redis`` the prefill process publishes the prompt's pages to Redis
(`publish_prefix` through a `RedisTier`) and exits its part; each decode process, a "node" with
its own device and host tiers, imports them from Redis (`import_prefix`) instead of steps 2-3.
Without ``--redis-url`` a private redis-server is started on a free loopback port; with one, the
pages go under a fresh random namespace (``--redis-cluster``: the URL is a cluster node).

Every wait is bounded; everything runs on loopback; the child processes, the shared-memory
segment and a private redis-server are cleaned up on exit (also on error or Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import select
import subprocess
import sys
import time
from typing import Any

import torch
from _redis_server import PrivateRedis

from tierkv import KVStore
from tierkv.demo.model import KVProvider, ModelConfig, TinyLlama
from tierkv.errors import TierKVError
from tierkv.remote import (
    PageServer,
    RedisTier,
    RemoteTier,
    import_prefix,
    prefix_pages,
    publish_prefix,
    stage_prefix,
)
from tierkv.runtime import new_event_loop

MODEL = ModelConfig(seed=0)  # the demo's TinyLlama: 4 layers, 256 wide, seeded weights
SECRET_ENV = "TIERKV_TRANSPORT_SECRET"
WAIT_S = 120.0  # bound of every wait on a child process
REDIS_TIMEOUT = 10.0  # bound of every Redis call (generous: a loaded machine)


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, MODEL.vocab, (n,), generator=g).tolist()


def _store(prompt: int, generate: int) -> KVStore:
    spec = MODEL.kv_spec("fp16", 16)
    pages = spec.blocks_for(prompt + generate) * spec.num_layers
    return KVStore(
        spec,
        device_bytes=(pages + 8) * spec.page_bytes,
        host_bytes=2 * (pages + 8) * spec.page_bytes,
        codec=None,  # cached prefixes stay exact (a lossy cold pool would change the tokens)
    )


async def _run(store: KVStore, model: TinyLlama, prompt: list[int], reused: int, n: int) -> Any:
    """Greedy tokens after ``prompt`` (its first ``reused`` tokens' KV already in the store),
    and the seconds of the first forward pass (the prompt's compute)."""
    out: list[int] = []
    feed, pos = prompt[reused:], reused
    first = 0.0
    while len(out) < n:
        t0 = time.perf_counter()
        async with store.lease(["s"]) as lease:

            async def gate(layer: int, lease: Any = lease) -> KVProvider:
                return lease

            logits = await model.forward("s", feed, pos, gate)
        if not out:
            first = time.perf_counter() - t0
        tok = int(logits.argmax())
        out.append(tok)
        store.add_tokens("s", [tok])
        pos, feed = pos + len(feed), [tok]
    return out, first


def _redis(args: argparse.Namespace, spec: Any) -> RedisTier:
    return RedisTier(
        args.redis_url,
        spec=spec,
        namespace=args.namespace,
        cluster=args.redis_cluster,
        ttl=args.redis_ttl,
        timeout=REDIS_TIMEOUT,
    )


# -- the processes -------------------------------------------------------------------------
async def prefill(args: argparse.Namespace) -> None:
    """Compute the prompt, serve its pages until told to quit on stdin."""
    if args.shared == "redis":
        return await prefill_redis(args)
    model = TinyLlama(MODEL)
    prompt = _prompt(args.prompt)
    store = _store(args.prompt, args.generate)
    async with store, PageServer(store, transports=["shm", "tcp"], lease_ttl=30.0) as server:
        await store.add_sequence("s", prompt)
        _, seconds = await _run(store, model, prompt, 0, 1)
        await store.release("s")  # full blocks keep their content keys: cached prefix
        await stage_prefix(store, prompt)  # whatever write-behind has not copied down yet
        staged = store.tiers.table.lookup(prefix_pages(store, prompt), "host")  # servable
        segment = server.shared["shm"].region.descriptor.handle
        print(
            json.dumps(
                {
                    "address": server.address,
                    "segment": segment,
                    "prefill_s": seconds,
                    "pages": staged,
                }
            ),
            flush=True,
        )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.readline)  # "quit" or EOF


async def prefill_redis(args: argparse.Namespace) -> None:
    """Compute the prompt, publish its pages to Redis, say so and wait for stdin to close."""
    model = TinyLlama(MODEL)
    prompt = _prompt(args.prompt)
    async with _store(args.prompt, args.generate) as store, _redis(args, store.spec) as redis:
        if not redis.available:
            raise SystemExit(f"prefill: Redis at {args.redis_url} is unreachable")
        await store.add_sequence("s", prompt)
        _, seconds = await _run(store, model, prompt, 0, 1)
        await store.release("s")
        await stage_prefix(store, prompt)
        t0 = time.perf_counter()
        published = await publish_prefix(store, redis, prompt)
        publish = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "address": args.redis_url,
                    "segment": "",
                    "prefill_s": seconds,
                    "publish_s": publish,
                    "pages": published,
                }
            ),
            flush=True,
        )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)


async def decode(args: argparse.Namespace) -> None:
    """Recompute the prompt, then load it through shm and tcp (or from Redis); print one JSON
    line per run."""
    model = TinyLlama(MODEL)
    prompt = _prompt(args.prompt)
    async with _store(args.prompt, args.generate) as store:  # warm-up: first calls are slow
        await store.add_sequence("s", prompt[:64])
        await _run(store, model, prompt[:64], 0, 2)
    async with _store(args.prompt, args.generate) as store:
        await store.add_sequence("s", prompt)
        want, recompute = await _run(store, model, prompt, 0, args.generate)
    for kind in ("redis",) if args.shared == "redis" else ("shm", "tcp"):
        async with _store(args.prompt, args.generate) as store:
            spec = store.spec
            peer: RedisTier | RemoteTier
            if kind == "redis":
                peer = _redis(args, spec)
            else:
                peer = RemoteTier(args.address, transport=kind, spec=spec, timeout=10.0)
            async with peer:
                t0 = time.perf_counter()
                cached = await import_prefix(store, peer, prompt)
                load = time.perf_counter() - t0
            reused = await store.add_sequence("s", prompt)
            got, rest = await _run(store, model, prompt, reused, args.generate)
            print(
                json.dumps(
                    {
                        "decoder": args.index,
                        "transport": kind,
                        "load_s": load,
                        "rest_s": rest,
                        "recompute_s": recompute,
                        "cached": cached,
                        "reused": reused,
                        "pages": cached // spec.page_tokens * spec.num_layers,
                        "identical": got == want,
                    }
                ),
                flush=True,
            )


# -- the driver ----------------------------------------------------------------------------
def _spawn(*argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))  # inherited by the children
    with contextlib.ExitStack() as stack:
        mode = ["--shared", args.shared]
        if args.shared == "redis":
            if args.redis_url is None:
                args.redis_url = stack.enter_context(PrivateRedis())
            mode += ["--redis-url", args.redis_url, "--namespace", args.namespace]
            mode += ["--redis-ttl", str(args.redis_ttl)]
            mode += ["--redis-cluster"] if args.redis_cluster else []
        try:
            rows = _drive(args, mode)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # (the child said why above)
            print(f"error: {exc}", file=sys.stderr)
            return 1
    kinds = ("redis",) if args.shared == "redis" else ("shm", "tcp")
    print(
        f"\n{'decoder':>7} {'via':>5} {'pages':>6} {'load ms':>9} {'recompute ms':>13} "
        f"{'ratio':>7}  tokens"
    )
    for r in rows:
        print(
            f"{r['decoder']:>7} {r['transport']:>5} {r['pages']:>6} {r['load_s'] * 1e3:>9.2f} "
            f"{r['recompute_s'] * 1e3:>13.1f} {r['recompute_s'] / r['load_s']:>6.0f}x  "
            f"{'identical' if r['identical'] else 'DIFFERENT'} ({r['reused']} reused)"
        )
    ok = len(rows) == 2 * len(kinds) and all(r["identical"] and r["reused"] for r in rows)
    print("\nall decoders match recomputing the prompt" if ok else "\nMISMATCH")
    return 0 if ok else 1


def _drive(args: argparse.Namespace, mode: list[str]) -> list[dict[str, Any]]:
    """Run the prefill process, then the two decode processes; their JSON rows."""
    size = ["--prompt", str(args.prompt), "--generate", str(args.generate), *mode]
    procs: list[subprocess.Popen[str]] = []
    segment = ""
    rows: list[dict[str, Any]] = []
    try:
        pre = _spawn("prefill", *size)
        procs.append(pre)
        assert pre.stdout is not None
        if not select.select([pre.stdout], [], [], WAIT_S)[0]:
            raise RuntimeError(f"the prefill process was not ready within {WAIT_S:g} s")
        line = pre.stdout.readline()
        if not line:
            raise RuntimeError("the prefill process exited before serving")
        ready = json.loads(line)
        segment = ready["segment"]
        where = "(shm + tcp)" if args.shared == "server" else "(redis)"
        verb = "served" if args.shared == "server" else "published"
        print(
            f"prefill: {args.prompt} prompt tokens in {ready['prefill_s'] * 1e3:.1f} ms, "
            f"{ready['pages']} pages {verb} at {ready['address']} {where}"
        )
        decs = [
            _spawn("decode", *size, "--address", ready["address"], "--index", str(i))
            for i in range(2)
        ]
        procs += decs
        for d in decs:
            out, _ = d.communicate(timeout=WAIT_S)
            if d.returncode:
                raise RuntimeError(f"a decode process failed (exit {d.returncode})")
            rows += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    finally:
        for p in procs:
            with contextlib.suppress(OSError, ValueError):
                if p.stdin is not None:
                    p.stdin.close()  # the prefill process quits on EOF
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if segment:  # gone already unless the prefill process died
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{segment}")
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("role", nargs="?", default="main", choices=["main", "prefill", "decode"])
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    p.add_argument("--generate", type=int, default=32, help="tokens each decoder generates")
    p.add_argument(
        "--shared",
        choices=["server", "redis"],
        default="server",
        help="how the prompt's KV is shared: the prefill process's page server (shm, tcp) or Redis",
    )
    p.add_argument("--redis-url", help="Redis to use (default: start a private redis-server)")
    p.add_argument(
        "--redis-cluster", action="store_true", help="--redis-url is a Redis Cluster node"
    )
    p.add_argument("--redis-ttl", type=float, default=600.0, help="seconds a published page lives")
    p.add_argument(
        "--namespace", default=f"prefill-decode-{secrets.token_hex(4)}", help=argparse.SUPPRESS
    )
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Exit 2 with one line for arguments that cannot run (each failed in a child process, and
    the driver printed a RuntimeError traceback: --prompt 0, --redis-ttl -1, a bad URL), before
    any process starts."""
    spawned = bool(os.environ.get(SECRET_ENV)) and (a.role == "prefill" or a.address is not None)
    if a.role != "main" and not spawned:
        p.error(f"the {a.role} role is the driver's child process: run the script without it")
    spec = MODEL.kv_spec("fp16", 16)
    if a.prompt < spec.page_tokens:  # (shorter: no full page to share, nothing reused)
        p.error(f"--prompt must be at least {spec.page_tokens} tokens, got {a.prompt}")
    if a.generate < 1:
        p.error(f"--generate must be at least 1, got {a.generate}")
    if a.shared != "redis" and (a.redis_url is not None or a.redis_cluster):
        p.error("--redis-url and --redis-cluster go with --shared redis")
    if a.redis_cluster and a.redis_url is None:
        p.error("--redis-cluster names the --redis-url of a cluster node: give it")
    if a.shared == "redis":
        url = a.redis_url or "redis://127.0.0.1:6379/0"  # (the private server's form)
        try:  # the tier checks the url, ttl and namespace; it connects to nothing yet
            RedisTier(url, spec=spec, cluster=a.redis_cluster, ttl=a.redis_ttl)
        except TierKVError as exc:
            p.error(f"--redis-url / --redis-ttl: {exc}")


if __name__ == "__main__":
    parser = _parser()
    a = parser.parse_args()
    _check(parser, a)
    if a.role == "main":
        sys.exit(main(a))
    loop = new_event_loop()
    try:
        loop.run_until_complete(prefill(a) if a.role == "prefill" else decode(a))
    finally:
        loop.close()
