"""A reader/writer in its own process, against a target serving one region (see peer_proc.py).

    python rw_worker.py BACKEND TARGET_META_HEX TARGET_DESC_HEX TARGET_SEED LANE [SECRET_HEX]

The target's region starts as `random.Random(TARGET_SEED).randbytes(size)`. Its first half is
read-only "static" data; the second half is cut into 4 lanes and this worker writes only lane
LANE (odd lanes run under uvloop). Prints ``READY <metadata hex>``, then answers one command
per stdin line:

``rounds R``  R rounds of: write lane_bytes(seed, lane, r) to the lane, read it back and read 16
              random static pages, all compared bit-exact; prints ``OK <bytes moved>`` or
              ``BAD <what>``.
``spin``      reads batches of static pages until the process dies or a transfer fails; prints
              ``SPINNING`` once the first batch has landed, then ``ERR <error type> <seconds from
              the failed transfer's start to its error>`` when one fails.
``quit``
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Any

import tierkv.transports as transports
from tierkv.transports import RegionDescriptor, TransferOp, TransportError

PAGE = 64 << 10
LANES = 4


def lane_bytes(target_seed: int, lane: int, round_no: int, size: int) -> bytes:
    """What `rounds` writes to `lane` in round `round_no`."""
    return random.Random(f"{target_seed}-{lane}-{round_no}").randbytes(size)


def lane_span(size: int, lane: int) -> tuple[int, int]:
    """(offset, length) of a lane in a target region of `size` bytes."""
    length = size // 2 // LANES
    return size // 2 + lane * length, length


async def rounds(
    t: transports.Transport, desc: RegionDescriptor, expected: bytes, seed: int, lane: int, n: int
) -> str:
    off, length = lane_span(desc.size, lane)
    mine = t.allocate(length + 16 * PAGE)
    moved = 0
    rng = random.Random(f"{seed}-{lane}")
    for r in range(n):
        data = lane_bytes(seed, lane, r, length)
        mine.view[:length] = data
        await t.write([TransferOp(mine, 0, desc, off, length)])
        mine.view[:length] = bytes(length)
        pages = rng.sample(range(desc.size // 2 // PAGE), 16)
        ops = [TransferOp(mine, 0, desc, off, length)]
        ops += [
            TransferOp(mine, length + i * PAGE, desc, p * PAGE, PAGE) for i, p in enumerate(pages)
        ]
        await t.read(ops)
        if mine.view[:length] != data:
            return f"BAD lane {lane} round {r} read back differs"
        for i, p in enumerate(pages):
            got = mine.view[length + i * PAGE : length + (i + 1) * PAGE]
            if got != expected[p * PAGE : (p + 1) * PAGE]:
                return f"BAD static page {p} differs"
        moved += 2 * length + 16 * PAGE
    return f"OK {moved}"


async def spin(t: transports.Transport, desc: RegionDescriptor) -> str:
    pages = desc.size // 2 // PAGE
    mine = t.allocate(pages * PAGE)
    ops = [TransferOp(mine, i * PAGE, desc, i * PAGE, PAGE) for i in range(pages)]
    first = True
    while True:
        start = time.monotonic()
        try:
            await t.read(ops)
        except TransportError as exc:
            return f"ERR {type(exc).__name__} {time.monotonic() - start:.3f}"
        if first:
            print("SPINNING", flush=True)
            first = False


async def main(argv: list[str]) -> None:
    backend, meta, desc_hex, seed, lane = argv[:5]
    kw: dict[str, Any] = {"timeout": 5.0}
    if len(argv) > 5:
        kw["secret"] = bytes.fromhex(argv[5])
    desc = RegionDescriptor.unpack(bytes.fromhex(desc_hex))
    expected = random.Random(int(seed)).randbytes(desc.size)
    async with transports.create(backend, **kw) as t:
        await t.add_peer(bytes.fromhex(meta))
        print("READY", t.metadata().hex(), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            words = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not words or words[0] == "quit":
                return
            if words[0] == "rounds":
                reply = await rounds(t, desc, expected, int(seed), int(lane), int(words[1]))
            else:
                reply = await spin(t, desc)
            print(reply, flush=True)


if __name__ == "__main__":
    try:  # odd lanes run under uvloop, so that a test mixes both loops across processes
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None and int(sys.argv[5]) % 2:
        uvloop.run(main(sys.argv[1:]))
    else:
        asyncio.run(main(sys.argv[1:]))
