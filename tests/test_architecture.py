"""The house rules that hold for the source tree as a whole (docs/architecture.md):

- one top-level import package: the repository's runtime/ and transports/ are tierkv.runtime and
  tierkv.transports (setup.py's LAYOUT, read here too), and imports run one way: tierkv core ->
  tierkv.runtime -> tierkv.transports;
- one path per file: no link doubles a file or a folder of the repository;
- no import cycle between modules, counting imports inside functions and under TYPE_CHECKING
  (a cycle that only the type checker sees still stands for two modules that know each other);
- no module uses another module's underscore names: not by importing them, not by reaching an
  attribute that its own module never defines (assigning ``other._x`` does not count as
  defining ``_x``: only ``self._x`` / ``cls._x`` do);
- a file over 400 lines says at its top why it stays whole.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import runpy
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
LONG_FILE = 400


# setup.py's LAYOUT (import package -> folder) and its walk of the tree; importing it builds nothing
SETUP: dict[str, Any] = runpy.run_path(str(ROOT / "setup.py"), run_name="tierkv_setup")
MODULES: dict[str, Path] = SETUP["modules"]()


def _target(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> Iterator[tuple[str, str | None]]:
    """(imported module, name imported from it or None) for every import in ``module``."""
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            target = _target(module, node)
            for alias in node.names:
                if f"{target}.{alias.name}" in MODULES:
                    yield f"{target}.{alias.name}", None
                else:
                    yield target, alias.name


def _graph() -> dict[str, set[str]]:
    """Module -> the modules importing it runs: the imported module and the ``__init__`` of
    each package above it (but the importer's own packages, already running)."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        deps: set[str] = set()
        for target, _ in _imports(module):
            parts = target.split(".")
            for i in range(2, len(parts) + 1):
                t = ".".join(parts[:i])
                if t in MODULES and t != module and not module.startswith(t + "."):
                    deps.add(t)
        graph[module] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


@pytest.mark.parametrize(
    ("layer", "may_import"),
    [
        ("tierkv.runtime", ("tierkv.runtime", "tierkv.transports")),
        ("tierkv.transports", ("tierkv.transports",)),
    ],
)
def test_imports_run_one_way(layer: str, may_import: tuple[str, ...]) -> None:
    wrong = [
        (m, t)
        for m in MODULES
        if m == layer or m.startswith(layer + ".")
        for t, _ in _imports(m)
        if (t == "tierkv" or t.startswith("tierkv.")) and not t.startswith(may_import)
    ]
    assert wrong == [], "\n".join(map(str, wrong))


def _defined_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)  # only its own objects' attributes: ``other._x = ...`` is not
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries, setattr/getattr names
    return names


def _foreign_underscores(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each use, read or write, of an underscore attribute that the module
    does not define itself, on anything but ``self`` / ``cls``."""
    own = _defined_names(tree)
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and node.attr not in own
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]


def test_the_underscore_check_catches_writes_into_another_object() -> None:
    code = """
class Mine:
    def __init__(self):
        self._mine = 1

def setup(arena, other: Mine):
    arena._free = []  # another class's private state: caught
    other._mine = 2  # a name this module defines: allowed
    return arena._busy  # caught
"""
    assert _foreign_underscores(ast.parse(code)) == [(7, "_free"), (9, "_busy")]


def test_no_module_uses_another_modules_underscore_names() -> None:
    wrong = []
    for module, path in MODULES.items():
        for target, name in _imports(module):
            if name and name.startswith("_") and not name.startswith("__"):
                wrong.append(f"{module}: from {target} import {name}")
        for line, attr in _foreign_underscores(ast.parse(path.read_text())):
            wrong.append(f"{path.relative_to(ROOT)}:{line}: .{attr}")
    assert wrong == [], "\n".join(map(str, wrong))


def test_long_files_say_why_they_stay_whole() -> None:
    why = re.compile(r"stays? whole|kept whole|one file|in one piece", re.IGNORECASE)
    wrong = []
    for path in sorted(set(MODULES.values())):
        text = path.read_text()
        if text.count("\n") > LONG_FILE:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not why.search(doc):
                wrong.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert wrong == [], "\n".join(map(str, wrong))


def test_one_top_level_import_package(tmp_path: Path) -> None:
    """Installed (editable here), the project adds `tierkv` and nothing else: `runtime` and
    `transports` are only reachable as tierkv.runtime and tierkv.transports."""
    assert SETUP["LAYOUT"] == {
        "tierkv": "tierkv",
        "tierkv.runtime": "runtime",
        "tierkv.transports": "transports",
    }
    assert all(p == "tierkv" or p.startswith("tierkv.") for p in SETUP["packages"]())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def works(code: str) -> bool:
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, check=False)
        return run.returncode == 0

    assert works("import tierkv.runtime, tierkv.transports, tierkv")
    assert not works("import runtime")
    assert not works("import transports")


def test_the_tree_under_test_is_this_checkout() -> None:
    """tierkv, tierkv.runtime and tierkv.transports all come from this checkout's folders: an
    editable install of another checkout (or a PYTHONPATH beside it) would mix two trees."""
    for name, folder in SETUP["LAYOUT"].items():
        module = importlib.import_module(name)
        assert module.__file__ is not None
        assert Path(module.__file__).resolve() == ROOT / folder / "__init__.py", name


def _repository_files() -> list[Path]:
    """What the repository holds: git's tracked and untracked-but-not-ignored files in a checkout,
    every file below the root elsewhere (an unpacked sdist)."""
    if (ROOT / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        return [ROOT / os.fsdecode(p) for p in out.split(b"\0") if p]
    found = []
    for folder, dirs, files in os.walk(ROOT):  # does not follow links: a linked folder is listed
        found += [Path(folder, name) for name in [*dirs, *files]]
    return found


def test_no_file_is_reachable_by_two_paths() -> None:
    """One path per file: no symbolic link (to a file or a folder) and no second hard link in the
    repository, so grep -r, grep -R, editors, mypy and checkouts without links see one tree."""
    files = _repository_files()
    assert files
    links = [str(p.relative_to(ROOT)) for p in files if p.is_symlink()]
    assert links == [], f"symbolic links: {links}"
    doubled = [str(p.relative_to(ROOT)) for p in files if p.is_file() and os.stat(p).st_nlink > 1]
    assert doubled == [], f"files with more than one hard link: {doubled}"


# issue 25: the tier core split by concern, one class each, none with more than 25 public members
MAX_PUBLIC = 25
CORE_CLASSES = {
    "tierkv.tiers": "TierSet",  # placement of pages on the device, the core's composition
    "tierkv.device_loads": "DeviceLoads",  # moves into the device
    "tierkv.device_room": "DeviceRoom",  # room on the device, wait errors
    "tierkv.ownership": "Ownership",  # owners, doomed pages, renames
    "tierkv.owners": "Owners",  # owner counts and owners' pins
    "tierkv.lease_pages": "LeasePages",  # a lease's views and writes
    "tierkv.remote_glue": "RemoteGlue",  # the host tier for the remote tier and page server
    "tierkv.prefault": "Prefaulter",  # the prefault thread
    "tierkv.eviction": "DeviceEviction",  # room on the device, write-back, write-behind
    "tierkv.lower_tiers": "ColdStorage",  # host room, compression, the codec's moves
    "tierkv.departures": "Departures",  # who hears of pages leaving the host
    "tierkv.chain": "LowerChain",  # the tiers below the host
    "tierkv.prefetch": "Prefetcher",  # prefetch and schedule
    "tierkv.arena_tier": "ArenaTier",  # one arena of the core as a Tier
}
ORCHESTRATION = "tierkv.tiers"  # the file holding the chain's orchestration
ORCHESTRATION_LINES = 400


def _public_members(cls: ast.ClassDef) -> set[str]:
    """Public names a class defines: methods, properties and class attributes in its body, and
    the attributes its methods assign on ``self``."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
            for sub in ast.walk(node):
                targets: list[ast.expr] = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                    targets = [sub.target]
                for t in targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    ):
                        names.add(t.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def _class(module: str, name: str) -> ast.ClassDef:
    tree = ast.parse(MODULES[module].read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def test_the_member_count_counts_methods_properties_and_attributes() -> None:
    cls = ast.parse(
        "class C:\n"
        "    x: int = 0\n"
        "    def __init__(self):\n        self.a = 1\n        self._b = 2\n"
        "        self.c: int = 3\n"
        "    @property\n    def p(self): return 1\n"
        "    async def m(self): self.a += 1\n"
        "    def _private(self): self.d = 4\n"
    ).body[0]
    assert isinstance(cls, ast.ClassDef)
    assert _public_members(cls) == {"x", "a", "c", "p", "m", "d"}


@pytest.mark.parametrize(("module", "name"), sorted(CORE_CLASSES.items()))
def test_no_core_class_has_over_25_public_members(module: str, name: str) -> None:
    members = _public_members(_class(module, name))
    assert len(members) <= MAX_PUBLIC, f"{name}: {len(members)} public members: {sorted(members)}"


def test_the_chain_orchestration_fits_in_400_lines() -> None:
    lines = MODULES[ORCHESTRATION].read_text().count("\n")
    assert lines <= ORCHESTRATION_LINES, f"{ORCHESTRATION}: {lines} lines"
