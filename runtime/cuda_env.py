"""The CUDA gate: whether CuPy and a device are usable, and CuPy imported with a clear error.

Importing this module never imports CuPy; `import_cupy()` does, and maps every way of failing
(no CuPy, no driver, no device) to BackendUnavailableError.
"""

from __future__ import annotations

from typing import Any

from .errors import BackendUnavailableError

__all__ = ["cuda_available", "import_cupy", "unavailable_reason"]

_INSTALL_HINT = "pip install 'tierkv-cache[cuda]' (cupy-cuda12x)"


def unavailable_reason() -> str | None:
    """Why the cuda backend cannot run here, or None when it can."""
    try:
        import cupy
    except ImportError as exc:
        return f"the cuda backend needs CuPy ({exc}): {_INSTALL_HINT}"
    except Exception as exc:  # a broken install fails at import in many ways
        return f"CuPy failed to import: {exc!r}"
    try:
        ok = bool(cupy.cuda.is_available())
    except Exception as exc:
        return f"CuPy cannot reach a CUDA driver: {exc!r}"
    if not ok:
        return "CuPy is installed but sees no CUDA device (cupy.cuda.is_available() is False)"
    return None


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return unavailable_reason() is None


def import_cupy() -> Any:
    """The `cupy` module. Raises BackendUnavailableError (with the reason) when CUDA is unusable."""
    reason = unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(reason)
    import cupy

    return cupy
