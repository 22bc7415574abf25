"""A child process for the store-level disk fault tests: ``python store_disk_child.py PATH
FIRST``: a KVStore with a disk tier on PATH fills sequences FIRST, FIRST+1, ... forever (each
one's KV a function of its number, its prefix pages spilled to disk as the small host tier
evicts them), printing each finished sequence's number; the parent kills it with SIGKILL."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from test_store_disk import fill, store


async def main(path: str, first: int) -> None:
    """Fill sequences from ``first`` on until killed."""
    async with store(Path(path)) as s:
        i = first
        while True:
            await fill(s, f"s{i}", i)
            print(i, flush=True)
            i += 1


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
