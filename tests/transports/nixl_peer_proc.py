"""A nixl peer in its own process, driven by the nixl tests over stdin/stdout.

    python nixl_peer_proc.py SIZE SEED

Registers one region of SIZE bytes filled with `random.Random(SEED).randbytes(SIZE)`, prints
``READY <metadata hex> <descriptor hex>``, then answers one command per stdin line:
``note`` (wait for a notification; prints ``NOTE <data hex> <crc32 of the first region>``),
``region SIZE SEED`` (register another seeded region now, after the metadata went out; prints
``DESC <descriptor hex>``), ``quit``. Lines that do not start with a reply word are not ours
(UCX may log to stdout); the tests skip them.
"""

from __future__ import annotations

import asyncio
import random
import sys
import zlib

from tierkv.transports.nixl import NixlTransport


async def main(size: int, seed: int) -> None:
    async with NixlTransport(timeout=5.0) as t:
        region = t.allocate(size)
        region.view[:] = random.Random(seed).randbytes(size)
        print("READY", t.metadata().hex(), region.descriptor.pack().hex(), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            words = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not words or words[0] == "quit":
                return
            if words[0] == "note":
                note = await t.get_notification(timeout=5.0)
                print("NOTE", note.data.hex() or "-", zlib.crc32(region.view), flush=True)
            elif words[0] == "region":
                extra = t.allocate(int(words[1]))
                extra.view[:] = random.Random(int(words[2])).randbytes(extra.size)
                print("DESC", extra.descriptor.pack().hex(), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
