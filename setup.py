"""Optional native extensions, built at install time (`pip install .` and `pip install -e .`).

Everything else about the distribution is in pyproject.toml. Three small C modules:

- ``tierkv.runtime._copy`` (runtime/_copy.c): the cpu backend's batch copy;
- ``tierkv.transports._crc32c`` (transports/_crc32c.c): CRC-32C for the tcp transport;
- ``tierkv.policies._kvaware`` (tierkv/policies/_kvaware.c): the default policy's inner loops.

All are optional: where no C compiler (or no Python headers) is found, the install still
succeeds with a warning and the library uses its fallbacks (numpy copy kernels; the ``crc32c``
package, else zlib's CRC-32; kvaware's loops in Python, tierkv/policies/kvaware_loops.py).
``TIERKV_NO_EXTENSIONS=1`` skips the build on purpose.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: a missing compiler costs speed, not the install.

    The CRC-32C module is retried without its carry-less-multiply lane when the compiler does not
    know VPCLMULQDQ (older compilers)."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all (setuptools raises from several layers)
            self._skip("all native extensions", exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
            return
        except Exception as exc:
            first = exc
        if ext.name.endswith("_crc32c"):
            ext.define_macros = [*ext.define_macros, ("TIERKV_NO_FOLD", "1")]
            try:
                super().build_extension(ext)
                return
            except Exception:
                pass
        self._skip(ext.name, first)

    def _skip(self, what: str, exc: BaseException) -> None:
        print(
            f"WARNING: tierkv: not building {what} ({exc}); the pure-Python/numpy fallbacks "
            "will be used (slower)",
            file=sys.stderr,
        )


def extensions() -> list[Extension]:
    """The extensions to build. Their x86 vector paths are picked at run time (target attributes,
    CPU feature checks), so a module built here runs on any x86-64 CPU."""
    if os.environ.get("TIERKV_NO_EXTENSIONS") == "1":
        return []
    return [
        Extension("tierkv.runtime._copy", ["runtime/_copy.c"]),
        Extension("tierkv.transports._crc32c", ["transports/_crc32c.c"]),
        Extension("tierkv.policies._kvaware", ["tierkv/policies/_kvaware.c"]),
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
