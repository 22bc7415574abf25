"""Backend registry: `get_backend("cpu" | "cuda" | "auto")`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .backend import Backend
from .cpu_backend import CpuBackend
from .errors import BackendUnavailableError

__all__ = ["available_backends", "get_backend", "register_backend"]


def _cuda(**kwargs: Any) -> Backend:
    from .cuda_backend import CudaBackend  # imports CuPy only when constructed

    return CudaBackend(**kwargs)


_FACTORIES: dict[str, Callable[..., Backend]] = {"cpu": CpuBackend, "cuda": _cuda}


def register_backend(name: str, factory: Callable[..., Backend]) -> None:
    """Make `get_backend(name)` call `factory(**kwargs)`. Replaces an existing entry."""
    _FACTORIES[name] = factory


def available_backends() -> list[str]:
    """Registered backend names that can run on this machine."""
    from .cuda_backend import cuda_available

    return [n for n in _FACTORIES if n != "cuda" or cuda_available()]


def get_backend(name: str = "auto", **kwargs: Any) -> Backend:
    """A new backend by name. "auto" picks cuda when a CUDA device is usable, else cpu.

    Raises BackendUnavailableError for an unknown name or a backend that cannot run here.
    """
    if name == "auto":
        from .cuda_backend import CUDA_BACKEND_READY, cuda_available

        name = "cuda" if CUDA_BACKEND_READY and cuda_available() else "cpu"
    factory = _FACTORIES.get(name)
    if factory is None:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; known: {', '.join(sorted(_FACTORIES))}"
        )
    return factory(**kwargs)
