"""What pip installs is what the tree has: the wheel and the sdist, built as a user would build
them, hold every module of the source tree, and the installed wheel works on its own.

Once per run (module fixture), from a clean copy of the checkout (no build/, egg-info or in-place
extensions to leak into the build):

- a wheel (``pip wheel --no-deps --no-build-isolation``) and an sdist (setuptools' PEP 517
  backend); the sdist holds every source file the build needs, and a wheel built from it holds
  the same files as the one built from the tree;
- the wheel installed into a fresh virtual environment under tmp, outside the checkout, that sees
  this interpreter's dependencies (torch, ...) but runs none of their .pth files (an editable
  tierkv's import hook would fill in what the wheel lacks): every module of the tree is there,
  imports from the wheel, and the ``tierkv`` command runs (``--help``, the tiny demo).
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUP: dict[str, Any] = runpy.run_path(str(ROOT / "setup.py"), run_name="tierkv_setup")
LAYOUT: dict[str, str] = SETUP["LAYOUT"]
SOURCE_MODULES: dict[str, Path] = SETUP["modules"]()
STUBS: dict[str, Path] = SETUP["modules"]((".pyi",))
EXTENSIONS: list[str] = [ext.name for ext in SETUP["extensions"]()]
HAS_COMPILER = shutil.which(os.environ.get("CC", "cc")) is not None
# what a clean clone has not: build outputs, caches, in-place extensions
NOT_SOURCE = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.so",
    "*.pyd",
    ".*_cache",
    ".venv",
    ".hypothesis",
    "out",
    "*.png",
)
TIMEOUT = 600


def _run(cwd: Path, *command: str | Path) -> str:
    """Run ``command`` in ``cwd`` without the checkout's PYTHONPATH; its stdout, or a failure
    with its output."""
    cmd = [str(part) for part in command]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    shown = " ".join(cmd)[:300]
    assert out.returncode == 0, f"{shown} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out.stdout


def _wheel(source: Path, out: Path) -> Path:
    options = ("--no-deps", "--no-build-isolation", "--no-index")
    _run(out.parent, sys.executable, "-m", "pip", "wheel", *options, "-w", out, source)
    (wheel,) = out.glob("tierkv_cache-*.whl")
    return wheel


def _see_dependencies(venv: Path) -> None:
    """Let ``venv`` import this interpreter's packages (torch, numpy, ...) without running their
    folders' .pth files: a path line in a .pth adds the folder, and an editable tierkv installed
    there (its import hook lives in a .pth) cannot fill in what the wheel lacks."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    folders = [p for p in sys.path if p and "-packages" in Path(p).name and Path(p).is_dir()]
    (venv / "lib" / version / "site-packages" / "_dependencies.pth").write_text(
        "".join(f"{folder}\n" for folder in folders)
    )


@dataclass(repr=False)  # a failure shows the field it checks, not all of them
class Built:
    wheel: Path
    sdist: Path
    sdist_wheel: Path
    venv: Path
    installed: dict[str, Any]  # what the venv's python reports (see _REPORT)


_REPORT = """
import importlib, importlib.util, json, sys
from pathlib import Path
spec = importlib.util.find_spec("tierkv")
package = Path(spec.origin).parent
files = sorted(str(p.relative_to(package.parent)) for p in package.rglob("*") if p.is_file())
failed, origins = {}, {}
for name in json.loads(sys.argv[1]):
    try:
        origins[name] = importlib.import_module(name).__file__
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps({
    "origins": origins,
    "installed": [f for f in files if "__pycache__" not in f],
    "failed": failed,
}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "src"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE)
    wheel = _wheel(source, tmp / "wheel")
    (tmp / "sdist").mkdir()
    backend = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    _run(source, sys.executable, "-c", backend, tmp / "sdist")
    (sdist,) = (tmp / "sdist").glob("tierkv_cache-*.tar.gz")
    with tarfile.open(sdist) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # 3.10.12+, 3.11.4+
        tar.extractall(tmp / "unpacked", **safe)
    (unpacked,) = (tmp / "unpacked").iterdir()
    sdist_wheel = _wheel(unpacked, tmp / "sdist-wheel")

    venv = tmp / "venv"
    _run(tmp, sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # pip >= 22.3 (the test extra) installs into another interpreter's environment: the bare venv
    install = ("install", "--no-deps", "--no-index", "--no-compile")
    _run(tmp, sys.executable, "-m", "pip", "--python", python, *install, wheel)
    _see_dependencies(venv)
    names = [m for m in SOURCE_MODULES if not m.endswith(".__main__")]  # __main__ runs the CLI
    report = _run(tmp, python, "-c", _REPORT, json.dumps(names))
    yield Built(wheel, sdist, sdist_wheel, venv, json.loads(report.splitlines()[-1]))


def _installed_modules(files: list[str]) -> dict[str, str]:
    """Module name -> file for the installed package's .py files and compiled extensions."""
    found = {}
    for file in files:
        path = Path(file)
        if path.suffix == ".py":
            parts = list(path.with_suffix("").parts)
        elif path.suffix in (".so", ".pyd"):
            parts = [*path.parts[:-1], path.name.split(".")[0]]
        else:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = file
    return found


def test_the_wheel_is_what_the_venv_imports(built: Built) -> None:
    """Every module comes from the venv: not from the checkout, and not from another install that
    the system site-packages can see (an editable one fills in what the wheel lacks)."""
    site = built.venv.resolve()
    origins = built.installed["origins"]
    assert set(LAYOUT) <= set(origins)
    elsewhere = {n: f for n, f in origins.items() if not Path(f).resolve().is_relative_to(site)}
    assert elsewhere == {}, "not imported from the wheel"


def test_the_wheel_holds_every_module_of_the_tree(built: Built) -> None:
    installed = _installed_modules(built.installed["installed"])
    expected = set(SOURCE_MODULES) | (set(EXTENSIONS) if HAS_COMPILER else set())
    missing, extra = sorted(expected - set(installed)), sorted(set(installed) - expected)
    assert missing == [], f"missing from the wheel: {missing}"
    assert extra == [], f"in the wheel but not in the tree: {extra}"
    stubs = {f for f in built.installed["installed"] if f.endswith(".pyi")}
    assert stubs == {f"{name.replace('.', '/')}.pyi" for name in STUBS}
    assert "tierkv/py.typed" in built.installed["installed"]
    assert not [f for f in built.installed["installed"] if f.endswith(".c")]


def test_every_module_imports_from_the_wheel(built: Built) -> None:
    assert built.installed["failed"] == {}


def test_the_installed_command_runs(built: Built, tmp_path: Path) -> None:
    bin_dir = built.venv / "bin"
    assert "demo" in _run(tmp_path, bin_dir / "tierkv", "--help")
    assert "demo" in _run(tmp_path, bin_dir / "python", "-m", "tierkv.cli", "--help")
    demo = ("demo", "--model", "tiny", "--generate", "4", "--repeat", "1", "--no-warmup")
    out = _run(tmp_path, bin_dir / "tierkv", *demo)
    assert "tokens identical to all-resident  yes" in out


def test_the_sdist_holds_every_source_file(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        held = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = [*SOURCE_MODULES.values(), *STUBS.values()]
    sources += [ROOT / src for ext in SETUP["extensions"]() for src in ext.sources]
    needed = {str(p.relative_to(ROOT)) for p in sources}
    needed |= {"setup.py", "pyproject.toml", "README.md", "tierkv/py.typed"}
    assert top.startswith("tierkv_cache-")
    assert sorted(needed - held) == []


def test_a_wheel_built_from_the_sdist_equals_the_trees(built: Built) -> None:
    def names(wheel: Path) -> set[str]:
        with zipfile.ZipFile(wheel) as z:
            return set(z.namelist())

    assert names(built.sdist_wheel) == names(built.wheel)
