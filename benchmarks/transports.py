"""Transports against the limits they chase, measured in one run.

    python benchmarks/transports.py [--quick] [--json FILE]

Every figure comes from a peer in a second process (this script re-run with --serve):
  shm bulk     reads of batches of 64 random 256 KB pages from the peer's segment, against a
               single-thread np.copyto of the same bytes (64 x 256 KB at random offsets, local
               buffers of the same size). Target ratio >= 0.8.
  tcp bulk     the same batches over tcp on loopback (with and without checksums: CRC32C, or
               zlib CRC32 where the native helper is unavailable), against a raw blocking-socket
               pair: the peer sendall()s the batch's bytes, we recv_into() them.
               Target ratio >= 0.7.
  nixl bulk    the same batches through NixlTransport against NIXL's own API driven by hand in
               this process (a second agent without a progress thread: descriptor lists,
               initialize_xfer, transfer, a busy check_xfer_state loop, release) reading the
               same peer region. Target ratio >= 0.85. Run twice: UCX's own choice of wire
               (cross-memory attach on one host) and UCX_TLS=tcp, each with the default
               transport and with progress_thread=False ("no-pthr", an initiator-only agent
               like the raw reader); the default is also set against raw NIXL with a progress
               thread paced as ours ("raw NIXL +pthr", the same configuration on both sides).
               Skipped without NIXL.
  16-page      one read of 16 x 256 KB pages: time of the raw copy / raw socket over the
               transport's time (so >= 0.5 means "within 2x"); for nixl also against raw NIXL.
Rounds alternate reference and transport so that load from other processes hits both alike;
ratios are of medians. Nothing here asserts on time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tierkv.transports as transports
from benchmarks._common import parser, phase, start_trace, table, write_json, write_trace
from tierkv.transports import TransferOp
from tierkv.transports.base import METADATA_LIMITS
from tierkv.transports.nixl_engine import new_agent
from tierkv.transports.session import decode

KB, MB = 1 << 10, 1 << 20
PAGE = 256 * KB
SECRET = b"bench"


async def serve(backend: str, size: int) -> None:
    """Peer mode: register `size` bytes, print metadata + descriptor (+ raw port), serve."""
    kw: dict[str, Any] = {"secret": SECRET} if backend in ("tcp", "shm") else {}
    async with transports.create(backend, **kw) as t:
        region = t.allocate(size)
        np.frombuffer(region.view, np.uint8)[:] = np.random.default_rng(0).integers(0, 255, size)
        raw = socket.create_server(("127.0.0.1", 0))
        data = memoryview(bytes(region.view[: 64 * PAGE]))
        print(t.metadata().hex(), region.descriptor.pack().hex(), raw.getsockname()[1], flush=True)
        loop = asyncio.get_running_loop()
        raw_task = loop.run_in_executor(None, _raw_sender, raw, data)
        await loop.run_in_executor(None, sys.stdin.readline)  # until the parent is done
        raw.close()
        await asyncio.wait([raw_task], timeout=1)


def _raw_sender(server: socket.socket, data: memoryview) -> None:
    try:
        conn, _ = server.accept()
    except OSError:
        return
    with conn:
        while req := conn.recv(8, socket.MSG_WAITALL):
            conn.sendall(data[: int.from_bytes(req, "big")])


def raw_receive(sock: socket.socket, buf: memoryview, nbytes: int) -> float:
    """Seconds to ask the peer for `nbytes` and recv_into them (blocking sockets)."""
    t = time.perf_counter()
    sock.sendall(nbytes.to_bytes(8, "big"))
    got = 0
    while got < nbytes:
        got += sock.recv_into(buf[got:nbytes])
    return time.perf_counter() - t


def copy_time(src: np.ndarray, dst: np.ndarray, offs: list[tuple[int, int]]) -> float:
    """Seconds for single-thread np.copyto of one page per (src, dst) page offset."""
    t = time.perf_counter()
    for i, j in offs:
        np.copyto(dst[j * PAGE : (j + 1) * PAGE], src[i * PAGE : (i + 1) * PAGE])
    return time.perf_counter() - t


async def transfer_time(t: transports.Transport, ops: list[TransferOp]) -> float:
    start = time.perf_counter()
    await t.read(ops)
    return time.perf_counter() - start


def _peer(backend: str, size: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    script = [sys.executable, __file__, "--serve", backend, str(size)]
    # a plain Popen: the peer's start-up is outside every timed section
    return subprocess.Popen(
        script, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def _stop(peer: subprocess.Popen[str]) -> None:
    if peer.stdin is not None:
        peer.stdin.close()
    try:
        peer.wait(5)
    except subprocess.TimeoutExpired:
        peer.kill()
        peer.wait()


async def measure(backend: str, size: int, rounds: int, checksum: bool = True) -> dict[str, Any]:
    """Medians of bulk and 16-page seconds for `backend` and its reference."""
    peer = _peer(backend, size)
    try:
        assert peer.stdout is not None and peer.stdin is not None
        meta, desc_hex, port = peer.stdout.readline().split()
        kw: dict[str, Any] = {"secret": SECRET}  # authenticated sessions (tcp: tagged headers)
        if backend == "tcp":
            kw["checksum"] = checksum
        async with transports.create(backend, **kw) as t:
            await t.add_peer(bytes.fromhex(meta))
            desc = transports.RegionDescriptor.unpack(bytes.fromhex(desc_hex))
            mine = t.allocate(size)
            local_src = np.ones(size, np.uint8)
            dst = np.frombuffer(mine.view, np.uint8)
            dst[:] = 0  # fault every page in before timing
            sock = socket.create_connection(("127.0.0.1", int(port)))
            rng = np.random.default_rng(1)
            out: dict[str, list[float]] = {k: [] for k in ("bulk", "ref", "p16", "ref16")}
            for _ in range(rounds + 1):  # the first round warms up
                pages = size // PAGE
                offs = list(
                    zip(rng.permutation(pages)[:64].tolist(), rng.permutation(pages)[:64].tolist())
                )
                ops = [TransferOp(mine, j * PAGE, desc, i * PAGE, PAGE) for i, j in offs]
                if backend == "shm":
                    out["ref"].append(copy_time(local_src, dst, offs))
                    out["ref16"].append(copy_time(local_src, dst, offs[:16]))
                else:
                    out["ref"].append(raw_receive(sock, mine.view, 64 * PAGE))
                    out["ref16"].append(raw_receive(sock, mine.view, 16 * PAGE))
                out["bulk"].append(await transfer_time(t, ops))
                out["p16"].append(await transfer_time(t, ops[:16]))
            sock.close()
            del dst  # release the export before the region is unmapped
        return {k: statistics.median(v[1:]) for k, v in out.items()}
    finally:
        _stop(peer)


class RawNixl:
    """NIXL's own API driven by hand (a second agent in this process): the reference."""

    def __init__(self, api: Any, peer_meta: bytes, local: np.ndarray, thread: bool = False) -> None:
        # without a progress thread the busy check_xfer_state loop drives UCX itself. With one,
        # it polls as NixlTransport's default does (1 ms pthrDelay): NIXL's own default (0)
        # would spin a core for the whole run, slowing every other row
        config = api.nixl_agent_config(enable_prog_thread=thread, backends=["UCX"])
        name = f"raw{'-pthr' if thread else ''}-{os.getpid()}"
        self.agent = new_agent(api, name, config, 1000) if thread else api.nixl_agent(name, config)
        meta = decode(peer_meta, METADATA_LIMITS)  # a peer's bytes: bounded, as Transport does
        self.peer = self.agent.add_remote_agent(meta["nixl"]).decode()
        self.agent.make_connection(self.peer)
        self.local = local
        self.reg = self.agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")

    def read(self, remote_base: int, offs: list[tuple[int, int]]) -> float:
        """Seconds for one READ of a page per (remote page, local page) pair."""
        a = self.agent
        start = time.perf_counter()
        base = self.local.ctypes.data
        local = np.array([(base + j * PAGE, PAGE, 0) for _, j in offs], dtype=np.uint64)
        remote = np.array([(remote_base + i * PAGE, PAGE, 0) for i, _ in offs], dtype=np.uint64)
        h = a.initialize_xfer(
            "READ", a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"), self.peer
        )
        state = a.transfer(h)
        while state == "PROC":
            state = a.check_xfer_state(h)
        h.release()
        if state != "DONE":
            raise RuntimeError(f"raw NIXL read ended in {state}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)
        self.agent.remove_remote_agent(self.peer)


async def measure_nixl(api: Any, size: int, rounds: int, tls: str | None) -> dict[str, Any]:
    """Medians for NixlTransport and raw NIXL (bulk and 16-page) plus memcpy / raw socket."""
    env = dict(os.environ)
    if tls is not None:
        env["UCX_TLS"] = tls
    saved = os.environ.get("UCX_TLS")
    os.environ.update({"UCX_TLS": tls} if tls else {})
    peer = _peer("nixl", size, env)
    try:
        assert peer.stdout is not None
        meta_hex, desc_hex, port = peer.stdout.readline().split()
        meta = bytes.fromhex(meta_hex)
        async with (
            transports.create("nixl") as t,
            transports.create("nixl", progress_thread=False) as t0,
        ):
            await t.add_peer(meta)
            await t0.add_peer(meta)
            desc = transports.RegionDescriptor.unpack(bytes.fromhex(desc_hex))
            remote_base = int(desc.handle.split(":")[0], 16)
            mine, mine0 = t.allocate(size), t0.allocate(size)
            np.frombuffer(mine.view, np.uint8)[:] = 0  # fault every page in before timing
            np.frombuffer(mine0.view, np.uint8)[:] = 0
            raw_local = np.zeros(size, np.uint8)
            raw = RawNixl(api, meta, raw_local)
            raw_t = RawNixl(api, meta, np.zeros(size, np.uint8), thread=True)
            local_src = np.ones(size, np.uint8)
            sock = socket.create_connection(("127.0.0.1", int(port)))
            sock_buf = memoryview(bytearray(16 * PAGE))
            rng = np.random.default_rng(1)
            keys = ("bulk", "bulk0", "raw", "raw_t", "p16", "p16_0", "raw16", "copy16", "sock16")
            out: dict[str, list[float]] = {k: [] for k in keys}
            for _ in range(rounds + 1):  # the first round warms up
                pages = size // PAGE
                offs = list(
                    zip(rng.permutation(pages)[:64].tolist(), rng.permutation(pages)[:64].tolist())
                )
                ops = [TransferOp(mine, j * PAGE, desc, i * PAGE, PAGE) for i, j in offs]
                ops0 = [TransferOp(mine0, j * PAGE, desc, i * PAGE, PAGE) for i, j in offs]
                out["raw"].append(raw.read(remote_base, offs))
                out["raw_t"].append(raw_t.read(remote_base, offs))
                out["bulk"].append(await transfer_time(t, ops))
                out["bulk0"].append(await transfer_time(t0, ops0))
                out["raw16"].append(raw.read(remote_base, offs[:16]))
                out["p16"].append(await transfer_time(t, ops[:16]))
                out["p16_0"].append(await transfer_time(t0, ops0[:16]))
                out["copy16"].append(copy_time(local_src, raw_local, offs[:16]))
                out["sock16"].append(raw_receive(sock, sock_buf, 16 * PAGE))
            sock.close()
            raw.close()
            raw_t.close()
        return {k: statistics.median(v[1:]) for k, v in out.items()}
    finally:
        _stop(peer)
        if saved is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = saved


def nixl_api() -> Any | None:
    """NIXL's Python API, or None when it is not installed."""
    try:
        from tierkv.transports.nixl import load_nixl

        return load_nixl()
    except transports.TransportError:
        return None


async def main(quick: bool, json_path: str | None) -> None:
    size, rounds = (64 * MB, 5) if quick else (256 * MB, 15)
    figures: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    rows = []
    cases = [("shm", "shm", True), ("tcp", "tcp+crc32c", True), ("tcp", "tcp", False)]
    for backend, label, crc in cases:
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        with phase(label, size=size):
            m = await measure(backend, size, rounds, crc)
        ref = "memcpy" if backend == "shm" else "raw socket"
        gbs = {k: (64 if k in ("bulk", "ref") else 16) * PAGE / v / 1e9 for k, v in m.items()}
        figures[label] = {"seconds": m, "GB/s": gbs}
        ratios[f"{label} bulk / {ref}"] = m["ref"] / m["bulk"]
        ratios[f"{label} 16-page: {ref} time / transport time"] = m["ref16"] / m["p16"]
        target = 0.8 if backend == "shm" else 0.7
        rows.append(
            [f"{label} bulk 64x256KB", gbs["bulk"], gbs["ref"], ref, m["ref"] / m["bulk"], target]
        )
        rows.append(
            [f"{label} 16x256KB read", gbs["p16"], gbs["ref16"], ref, m["ref16"] / m["p16"], 0.5]
        )
    api = nixl_api()
    if api is None:
        print(
            "nixl: not installed, rows skipped (pip install --no-deps nixl-cu12)", file=sys.stderr
        )
    for tls, label in ((None, "nixl"), ("tcp", "nixl/ucx-tcp")) if api is not None else ():
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        with phase(label, size=size):
            m = await measure_nixl(api, size, rounds, tls)
        bulk_keys = ("bulk", "bulk0", "raw", "raw_t")
        gbs = {k: (64 if k in bulk_keys else 16) * PAGE / v / 1e9 for k, v in m.items()}
        figures[label] = {"seconds": m, "GB/s": gbs}
        for bulk, p16, how in (("bulk", "p16", ""), ("bulk0", "p16_0", " no-pthr")):
            name, r = label + how, m["raw"] / m[bulk]
            ratios[f"{name} bulk / raw NIXL"] = r
            rows.append([f"{name} bulk 64x256KB", gbs[bulk], gbs["raw"], "raw NIXL", r, 0.85])
            if not how:  # the same configuration on both sides: a progress thread each
                r = m["raw_t"] / m[bulk]
                ratios[f"{name} bulk / raw NIXL with a progress thread"] = r
                rows.append(
                    [f"{name} bulk 64x256KB", gbs[bulk], gbs["raw_t"], "raw NIXL +pthr", r, 0.85]
                )
            refs = (("raw16", "raw NIXL"), ("copy16", "memcpy"), ("sock16", "raw socket"))
            for key, ref in refs if not how else refs[:1]:
                r = m[key] / m[p16]
                ratios[f"{name} 16-page: {ref} time / transport time"] = r
                rows.append([f"{name} 16x256KB read", gbs[p16], gbs[key], ref, r, 0.5])
    print(table(["case", "GB/s", "ref GB/s", "ref", "ratio", "target"], rows))
    write_json(json_path, figures, ratios)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        asyncio.run(serve(sys.argv[2], int(sys.argv[3])))
    else:
        args = parser(__doc__.splitlines()[0]).parse_args()
        start_trace(args.trace)
        try:
            import uvloop

            uvloop.run(main(args.quick, args.json))
        except ImportError:
            asyncio.run(main(args.quick, args.json))
        write_trace(args.trace)
