"""docs/configuration.md cannot rot: every constructor option and every CLI flag has a row with
its default, and every row names a real option.

A section is a ``### `Name``` heading up to the next heading; a row is a table line whose first
cell is the option in backticks and whose second cell is its default (``required`` when it has
none, ``—`` for ``**kwargs``; Python defaults as ``repr``, CLI defaults as typed, ``off`` for a
switch, ``—`` when unset). Adding an option means adding its row.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tierkv
from tierkv import KVStore, SyncKVStore
from tierkv.cli import build_parser
from tierkv.remote import PageServer, RemoteTier
from tierkv.runtime import TransferEngine
from tierkv.tiers import TierSet
from tierkv.timeline import Timeline

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
NONE = "—"


def _optional(module: str, name: str) -> Callable[[], Any]:
    def load() -> Any:
        mod = pytest.importorskip(module)
        return getattr(mod, name)

    return load


CLASSES: dict[str, Callable[[], Any]] = {
    "KVStore": lambda: KVStore,
    "SyncKVStore": lambda: SyncKVStore,
    "TierSet": lambda: TierSet,
    "TransferEngine": lambda: TransferEngine,
    "PageServer": lambda: PageServer,
    "RemoteTier": lambda: RemoteTier,
    "RemoteCluster": _optional("tierkv.remote.sources.cluster", "RemoteCluster"),
    "RedisTier": _optional("tierkv.remote.sources.redis_tier", "RedisTier"),
    "TieredCache": _optional("tierkv.integrations.hf", "TieredCache"),
    "EngineConfig": _optional("tierkv.serving", "EngineConfig"),
    "Timeline": lambda: Timeline,
    "Device": lambda: tierkv.Device,
    "Host": lambda: tierkv.Host,
    "Cold": lambda: tierkv.Cold,
    "Disk": lambda: tierkv.Disk,
    "Remote": lambda: tierkv.Remote,
}


def sections(text: str | None = None) -> dict[str, dict[str, str]]:
    """``{section title: {option: default cell}}`` of the document (or of ``text``)."""
    out: dict[str, dict[str, str]] = {}
    rows: dict[str, str] | None = None
    if text is None:
        text = DOC.read_text(encoding="utf-8")
    for line in text.splitlines():
        head = re.match(r"#{2,3} `([^`]+)`", line)
        if line.startswith("#"):
            rows = out.setdefault(head.group(1), {}) if head else None
            continue
        if rows is None or not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        name = cells[0].split("`")[1]
        assert name not in rows, f"{name} documented twice"
        rows[name] = cells[1].strip("`")
    return out


def python_default(p: inspect.Parameter) -> str:
    if p.kind is p.VAR_KEYWORD:
        return NONE
    return "required" if p.default is p.empty else repr(p.default)


def python_options(cls: Any) -> dict[str, str]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # no self
    return {
        (f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name): python_default(p) for p in params
    }


def cli_default(a: argparse.Action) -> str:
    if not a.option_strings or a.required:
        return "required"
    if isinstance(a, argparse._StoreTrueAction):
        return "off"
    return NONE if a.default is None else str(a.default)


def cli_commands() -> dict[str, dict[str, str]]:
    """``{"tierkv demo": {flag: default}}`` for every subcommand of the CLI."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, dict[str, str]] = {}
    for name, sp in sub.choices.items():
        flags: dict[str, str] = {}
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            key = max(a.option_strings, key=len) if a.option_strings else a.dest.upper()
            flags[key] = cli_default(a)
        out[f"tierkv {name}"] = flags
    return out


@pytest.mark.parametrize("title", sorted(CLASSES))
def test_every_constructor_option_is_documented(title: str) -> None:
    want = python_options(CLASSES[title]())
    got = sections().get(title)
    assert got is not None, f"docs/configuration.md has no ### `{title}` section"
    assert sorted(set(want) - set(got)) == [], f"{title}: options missing from the doc"
    assert sorted(set(got) - set(want)) == [], f"{title}: the doc lists options that are gone"
    wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    assert wrong == {}, f"{title}: documented default != signature (doc, code)"


def test_every_cli_flag_is_documented() -> None:
    docs = sections()
    for title, want in cli_commands().items():
        got = docs.get(title)
        assert got is not None, f"docs/configuration.md has no ### `{title}` section"
        assert sorted(set(want) - set(got)) == [], f"{title}: flags missing from the doc"
        assert sorted(set(got) - set(want)) == [], f"{title}: the doc lists flags that are gone"
        wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
        assert wrong == {}, f"{title}: documented default != argparse default (doc, code)"


def test_the_checker_sees_a_missing_row_and_a_wrong_default() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert sections(text)["KVStore"]["max_inflight"] == "4"
    dropped = sections(re.sub(r"^\| `max_inflight` .*\n", "", text, flags=re.M))
    assert "max_inflight" not in dropped["KVStore"]
    assert "max_inflight" not in dropped["TransferEngine"]
    changed = sections(text.replace("| `--every` | `10.0` |", "| `--every` | `5.0` |"))
    assert changed["tierkv serve"]["--every"] == "5.0"


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    ci = (root / ".ci" / "run").read_text(encoding="utf-8")
    started = readme.index("# 2. install and run the tests")
    command = next(
        line for line in readme[started:].splitlines()[1:] if line and not line.startswith("#")
    )
    assert command in ci.splitlines()
    assert command in (root / "docs" / "getting_started.md").read_text(encoding="utf-8")
