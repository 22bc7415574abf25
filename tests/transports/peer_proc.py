"""A peer in its own process, driven by the transport tests over stdin/stdout.

    python peer_proc.py BACKEND SIZE SEED [SECRET_HEX]

Registers one region of SIZE bytes filled with `random.Random(SEED).randbytes(SIZE)`, prints
``READY <metadata hex> <descriptor hex>``, then answers one command per stdin line:
``note`` (wait for a notification; prints ``NOTE <data hex> <crc32 of the region>``),
``crc`` (prints ``CRC <crc32>``), ``quit``.
"""

from __future__ import annotations

import asyncio
import random
import sys
import zlib
from typing import Any

import tierkv.transports as transports


async def main(backend: str, size: int, seed: int, secret: str | None) -> None:
    kw: dict[str, Any] = {"timeout": 5.0}
    if secret is not None:
        kw["secret"] = bytes.fromhex(secret)
    async with transports.create(backend, **kw) as t:
        region = t.allocate(size)
        region.view[:] = random.Random(seed).randbytes(size)
        print("READY", t.metadata().hex(), region.descriptor.pack().hex(), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line in ("", "quit"):
                return
            if line == "note":
                note = await t.get_notification(timeout=5.0)
                print("NOTE", note.data.hex(), zlib.crc32(region.view), flush=True)
            elif line == "crc":
                print("CRC", zlib.crc32(region.view), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0], int(args[1]), int(args[2]), args[3] if len(args) > 3 else None))
