"""The package layout and the optional native extensions; everything else about the
distribution (name, dependencies, scripts, tools) is in pyproject.toml.

Layout: one import package, ``tierkv``, from three folders (``LAYOUT``): the repository keeps
``runtime/`` and ``transports/`` at its top (the design's layout; docs/architecture.md) and they
install as ``tierkv.runtime`` and ``tierkv.transports``. Every package under each folder is
found by walking it (`packages()`), so no hand-kept list can miss one; tests/test_packaging.py
builds the wheel and the sdist and checks they hold every module of the tree.

Native extensions, built at install time (`pip install .` and `pip install -e .`). Four small
C modules:

- ``tierkv.runtime._copy`` (runtime/_copy.c): the cpu backend's batch copy;
- ``tierkv.transports._crc32c`` (transports/_crc32c.c): CRC-32C for the tcp transport;
- ``tierkv.policies._kvaware`` (tierkv/policies/_kvaware.c): the default policy's inner loops;
- ``tierkv.codecs._dequant`` (tierkv/codecs/_dequant.c): int8 cold pages decoded in one pass.

All are optional: where no C compiler (or no Python headers) is found, the install still
succeeds with a warning and the library uses its fallbacks (numpy copy kernels; the ``crc32c``
package, else zlib's CRC-32; kvaware's loops in Python, tierkv/policies/kvaware_loops.py).
``TIERKV_NO_EXTENSIONS=1`` skips the build on purpose.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# import package -> the repository folder it is built from (setuptools ``package_dir``).
LAYOUT = {"tierkv": "tierkv", "tierkv.runtime": "runtime", "tierkv.transports": "transports"}
ROOT = Path(__file__).resolve().parent


def packages() -> list[str]:
    """Every package of ``LAYOUT``'s folders (each folder with an ``__init__.py``), named as it
    installs: ``transports/`` -> ``tierkv.transports``, ``tierkv/remote/server`` ->
    ``tierkv.remote.server``."""
    found = set(LAYOUT)
    for name, folder in LAYOUT.items():
        found.update(f"{name}.{sub}" for sub in find_packages(ROOT / folder))
    return sorted(found)


def modules(suffixes: tuple[str, ...] = (".py",)) -> dict[str, Path]:
    """Every module file of ``LAYOUT``'s folders by the name it installs as (``runtime/arena.py``
    -> ``tierkv.runtime.arena``; ``.pyi`` in ``suffixes`` adds the extensions' stubs). The tests
    (import rules, the wheel's contents) and .ci/typecheck read the tree through this."""
    found: dict[str, Path] = {}
    for name, folder in LAYOUT.items():
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in suffixes or "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


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
        Extension("tierkv.codecs._dequant", ["tierkv/codecs/_dequant.c"]),
        Extension("tierkv._tally", ["tierkv/_tally.c"]),
    ]


# setuptools runs this file as __main__; importing it (the tests, .ci/typecheck) builds nothing.
if __name__ == "__main__":
    setup(
        package_dir=LAYOUT,
        packages=packages(),
        # the extensions' type stubs and the PEP 561 marker (tierkv is typed, subpackages included)
        package_data={"tierkv": ["py.typed"], "": ["*.pyi"]},
        exclude_package_data={"": ["*.c"]},  # the C sources go in the sdist, not the wheel
        ext_modules=extensions(),
        cmdclass={"build_ext": OptionalBuildExt},
    )
