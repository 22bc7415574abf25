"""Fixtures for the runtime tests. Every async test runs under asyncio (debug mode) and uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from runtime import CpuBackend, get_backend
from runtime.cuda_backend import cuda_available


def _asyncio_debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    return loop


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    factories: dict[str, Callable[[], Any]] = {"asyncio": _asyncio_debug_loop}
    try:
        import uvloop
    except ImportError:
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def backend() -> Iterator[CpuBackend]:
    b = get_backend("cpu")
    assert isinstance(b, CpuBackend)
    yield b
    b.close()
