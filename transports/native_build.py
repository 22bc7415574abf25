"""Build small C helpers once per source version and machine, into a cache directory.

Used by the transports' CRC32C helper and by the runtime's batch-copy kernel. The library goes
to ``$TIERKV_CACHE_DIR`` (default ``$XDG_CACHE_HOME/tierkv`` or ``~/.cache/tierkv``), named by a
hash of the source and the machine type, compiled with ``$CC`` (default ``cc``). The file
appears atomically, so processes that build the same library at once never load half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build_library", "cache_dir"]


def cache_dir() -> Path:
    """Where compiled helpers are kept."""
    env = os.environ.get("TIERKV_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tierkv"


def build_library(
    name: str, source: bytes, variants: Sequence[Sequence[str]] = ((),)
) -> ctypes.CDLL:
    """The shared library compiled from C ``source``, built on first use.

    ``variants`` are extra compiler flags tried in order until one compiles (for example a
    fallback for compilers that lack an instruction set). Raises OSError or
    subprocess.SubprocessError when no variant builds or the library cannot be loaded.
    """
    tag = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    cache = cache_dir()
    lib_path = cache / f"{name}-{tag}.so"
    if not lib_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            c_file = Path(tmp) / f"{name}.c"
            c_file.write_bytes(source)
            out = Path(tmp) / f"{name}.so"
            cmd = [os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", "-o", str(out)]
            for i, flags in enumerate(variants):
                try:
                    subprocess.run(
                        [*cmd, *flags, str(c_file)], check=True, capture_output=True, timeout=60
                    )
                    break
                except subprocess.CalledProcessError:
                    if i == len(variants) - 1:
                        raise
            os.replace(out, lib_path)  # atomic: concurrent builders never see half a file
    return ctypes.CDLL(str(lib_path))  # calls through CDLL release the GIL
