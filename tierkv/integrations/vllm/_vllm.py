"""vLLM's tiering interface, imported by name so that this package imports without vLLM.

``tierkv.integrations.vllm`` must import in an install without vLLM (the wheel's own checks
import every module); its tier classes then raise `VllmUnavailableError` when constructed.
With vLLM 0.33 installed these names are vLLM's own classes.
"""

from __future__ import annotations

import importlib
from typing import Any

from tierkv.errors import TierKVError

__all__ = [
    "AVAILABLE",
    "AsyncLookupManager",
    "JobResult",
    "Locality",
    "LookupResult",
    "Medium",
    "RequestOffloadingContext",
    "SecondaryTierManager",
    "VllmUnavailableError",
    "why_unavailable",
]


class VllmUnavailableError(TierKVError, ImportError):
    """vLLM (0.33, with its tiering layer) is not importable here."""


def _load() -> tuple[dict[str, Any], str]:
    try:
        tiering = importlib.import_module("vllm.v1.kv_offload.tiering.base")
        lookup = importlib.import_module("vllm.v1.kv_offload.tiering.async_lookup")
        base = importlib.import_module("vllm.v1.kv_offload.base")
    except ImportError as exc:
        return {}, f"vllm's tiering layer cannot be imported: {exc}"
    names = {
        "SecondaryTierManager": tiering.SecondaryTierManager,
        "JobResult": tiering.JobResult,
        "AsyncLookupManager": lookup.AsyncLookupManager,
        "LookupResult": base.LookupResult,
        "Medium": base.Medium,
        "Locality": base.Locality,
        "RequestOffloadingContext": base.RequestOffloadingContext,
    }
    return names, ""


_NAMES, _WHY = _load()
AVAILABLE = not _WHY


def why_unavailable() -> str:
    """Why vLLM's tiering layer is not importable ("" when it is)."""
    return _WHY


class _Missing:
    """Stands in for a vLLM class where vLLM is not installed: constructing it raises."""

    medium: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise VllmUnavailableError(
            f"{_WHY}; install it with: pip install --no-deps vllm==0.33.0 "
            "(docs/vllm.md lists its other dependencies)"
        )


SecondaryTierManager: Any = _NAMES.get("SecondaryTierManager", _Missing)
AsyncLookupManager: Any = _NAMES.get("AsyncLookupManager", _Missing)
JobResult: Any = _NAMES.get("JobResult", _Missing)
LookupResult: Any = _NAMES.get("LookupResult")
Medium: Any = _NAMES.get("Medium")
Locality: Any = _NAMES.get("Locality")
RequestOffloadingContext: Any = _NAMES.get("RequestOffloadingContext", _Missing)
