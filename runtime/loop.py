"""The event loop: uvloop when it is installed, plain asyncio otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["has_uvloop", "new_event_loop", "run"]

T = TypeVar("T")


def has_uvloop() -> bool:
    """True when uvloop can be imported."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop(*, use_uvloop: bool | None = None) -> asyncio.AbstractEventLoop:
    """A fresh event loop: uvloop's when installed (or when `use_uvloop` is True), else asyncio's.

    Raises ImportError when `use_uvloop=True` and uvloop is missing.
    """
    if use_uvloop is None:
        use_uvloop = has_uvloop()
    if use_uvloop:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


def run(coro: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None, debug: bool = False) -> T:
    """Run `coro` to completion on a new loop (see `new_event_loop`) and close the loop."""
    loop = new_event_loop(use_uvloop=use_uvloop)
    loop.set_debug(debug)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
