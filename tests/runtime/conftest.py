"""Fixtures for the runtime tests (the asyncio / uvloop parametrization is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tierkv.runtime import CpuBackend, create_backend
from tierkv.runtime.cuda_backend import cuda_available


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def backend() -> Iterator[CpuBackend]:
    b = create_backend("cpu")
    assert isinstance(b, CpuBackend)
    yield b
    b.close()
