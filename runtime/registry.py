"""Backends by name: `create_backend("cpu" | "cuda" | "auto")`, one `Registry` like every other.

`get_backend` is the deprecated name of `create_backend` (every registry's verb is ``create``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierkv.transports.deprecation import deprecated_alias
from tierkv.transports.named import Registry

from .backend import Backend
from .cpu_backend import CpuBackend
from .errors import BackendUnavailableError, UnknownBackendError

__all__ = [
    "BACKENDS",
    "available_backends",
    "create_backend",
    "get_backend",
    "register_backend",
]


def _cuda(**kwargs: Any) -> Backend:
    from .cuda_backend import CudaBackend  # imports CuPy only when constructed

    return CudaBackend(**kwargs)


BACKENDS: Registry[Backend] = Registry(
    "backend",
    error=UnknownBackendError,
    misuse=BackendUnavailableError,
    builtins={"cpu": CpuBackend, "cuda": _cuda},
    result=Backend,
)
"""Backend factories by name; :func:`create_backend` adds "auto"."""


def register_backend(name: str, factory: Callable[..., Backend], *, replace: bool = False) -> None:
    """Make `create_backend(name)` call `factory(**kwargs)`.

    Raises ValueError if `name` is taken and `replace` is false.
    """
    BACKENDS.register(name, factory, replace=replace)


def available_backends() -> list[str]:
    """Registered backend names that can run on this machine."""
    from .cuda_backend import cuda_available

    return [n for n in BACKENDS.available() if n != "cuda" or cuda_available()]


def create_backend(name: str = "auto", **kwargs: Any) -> Backend:
    """A new backend by name. "auto" picks cuda when a CUDA device is usable, else cpu.

    Raises UnknownBackendError (a BackendUnavailableError and an UnknownNameError) for an unknown
    name; BackendUnavailableError for a backend that cannot run here.
    """
    if name == "auto":
        from .cuda_backend import CUDA_BACKEND_READY, cuda_available

        name = "cuda" if CUDA_BACKEND_READY and cuda_available() else "cpu"
    return BACKENDS.create(name, **kwargs)


get_backend = deprecated_alias(create_backend, "get_backend")
