"""A remote tier in a dict, for tests (a :class:`~tierkv.page_source.PageSource`)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np


class DictSource:
    """A remote tier in a dict (a :class:`~tierkv.remote.PageSource`); yields once per call so
    that its calls interleave with the store's other work."""

    def __init__(self) -> None:
        self.pages: dict[bytes, bytes] = {}

    async def lookup(self, keys: list[bytes]) -> int:
        await asyncio.sleep(0)
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    async def load(self, keys: list[bytes], array: Any, slots: list[int]) -> int:
        await asyncio.sleep(0)
        n = 0
        for k, s in zip(keys, slots):
            page = self.pages.get(k)
            if page is None:
                break
            array[s] = np.frombuffer(page, dtype=np.uint8)
            n += 1
        return n

    async def publish(self, keys: list[bytes], array: Any, slots: list[int]) -> int:
        await asyncio.sleep(0)
        new = [k for k in keys if k not in self.pages]
        for k, s in zip(keys, slots):
            self.pages[k] = array[s].tobytes()
        return len(new)
