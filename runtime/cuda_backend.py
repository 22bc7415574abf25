"""The cuda backend seam (CuPy streams and events, device and pinned host arenas).

Only the availability gate lives here for now; the backend itself is the next issue. Importing
this module never imports CuPy; constructing `CudaBackend` does, and explains what is missing.
"""

from __future__ import annotations

from typing import Any

from .errors import BackendUnavailableError

__all__ = ["CUDA_BACKEND_READY", "CudaBackend", "cuda_available"]

#: False until the cuda backend is implemented; `get_backend("auto")` then stays on cpu.
CUDA_BACKEND_READY = False


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # a broken driver install reports in many ways
        return False


class CudaBackend:
    """Placeholder for the CuPy backend. Raises BackendUnavailableError when CUDA is missing,
    NotImplementedError otherwise (until the cuda backend issue lands)."""

    name = "cuda"

    def __init__(self, device: int = 0, **_: Any) -> None:
        try:
            import cupy
        except ImportError as exc:
            raise BackendUnavailableError(
                "the cuda backend needs CuPy: pip install 'tierkv[cuda]' (cupy-cuda12x)"
            ) from exc
        try:
            ok = bool(cupy.cuda.is_available())
        except Exception as exc:
            raise BackendUnavailableError(f"CuPy cannot reach a CUDA driver: {exc}") from exc
        if not ok:
            raise BackendUnavailableError("CuPy is installed but sees no CUDA device")
        raise NotImplementedError("the cuda backend is not implemented yet (see issue 4)")
