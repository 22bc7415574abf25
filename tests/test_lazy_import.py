"""The top package loads lazily (PEP 562): `import tierkv` runs no submodule, and a lower layer
costs only itself: `import tierkv.transports` loads neither torch nor the store. Each check runs
in a fresh interpreter, where sys.modules shows what an import really ran."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import tierkv

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> list[str]:
    """The modules a fresh interpreter holds after ``code``, sorted (stdout's last line)."""
    run = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    loaded: list[str] = json.loads(run.stdout.splitlines()[-1])
    return loaded


def _ours(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m == "tierkv" or m.startswith("tierkv.")]


def test_import_tierkv_runs_no_submodule() -> None:
    loaded = _fresh("import tierkv")
    assert _ours(loaded) == ["tierkv"]
    assert "torch" not in loaded


def test_transports_import_neither_torch_nor_the_store() -> None:
    loaded = _fresh("import tierkv.transports, tierkv.transports.named")
    assert "torch" not in loaded
    assert [m for m in _ours(loaded) if not m.startswith("tierkv.transports")] == ["tierkv"]


def test_runtime_imports_no_module_of_the_core() -> None:
    loaded = _fresh("import tierkv.runtime")
    assert [
        m for m in _ours(loaded) if not m.startswith(("tierkv.runtime", "tierkv.transports"))
    ] == ["tierkv"]


def test_a_name_loads_its_module_on_first_use() -> None:
    loaded = _fresh("import sys, tierkv\nassert 'tierkv.spec' not in sys.modules\ntierkv.KVSpec")
    assert "tierkv.spec" in loaded
    assert "tierkv.store" not in loaded


def test_every_public_name_resolves_to_its_modules_object() -> None:
    lazy: dict[str, str] = tierkv._LAZY  # type: ignore[attr-defined]
    assert sorted([*lazy, "__version__"]) == sorted(tierkv.__all__)
    for name, module in lazy.items():
        assert getattr(tierkv, name) is getattr(sys.modules[module], name), name
    assert set(tierkv.__all__) <= set(dir(tierkv))


def test_star_import_and_submodules_work_from_a_fresh_interpreter() -> None:
    code = "from tierkv import *\nimport tierkv\nassert KVStore is tierkv.KVStore\ntierkv.runtime"
    assert "tierkv.runtime" in _fresh(code)


def test_an_unknown_name_is_an_attribute_error() -> None:
    for name in ("no_such_name", "_private", "__wrapped__", "no.such", "runtime.no_such"):
        assert not hasattr(tierkv, name)


def test_the_type_checker_sees_the_same_names() -> None:
    """The ``if TYPE_CHECKING:`` imports name exactly the lazy table's names and modules."""
    tree = ast.parse((ROOT / "tierkv" / "__init__.py").read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    seen = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == tierkv._LAZY  # type: ignore[attr-defined]


def test_importtime_of_transports_shows_no_torch() -> None:
    """The issue's own check: ``python -X importtime -c "import tierkv.transports"``."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import tierkv.transports"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=120,
    )
    imported = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()]
    assert "tierkv.transports" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
