"""tierkv.progress: a tqdm bar on a terminal, a plain line per tenth elsewhere."""

from __future__ import annotations

import io
import sys
import threading

import pytest

from tierkv.progress import Progress


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Progress(20, "replay lru", stream=out) as p:
        for _ in range(20):
            p.update()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10  # one per tenth, never a carriage return
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("replay lru:") and " 20/20 " in lines[-1]


def test_tqdm_bar_on_a_terminal_without_a_monitor_thread() -> None:
    pytest.importorskip("tqdm")
    out = _Tty()
    before = {t.ident for t in threading.enumerate()}
    with Progress(5, "demo", stream=out) as p:
        p.update(5)
        started = [t for t in threading.enumerate() if t.ident not in before]
    assert started == []  # a monitor thread would run inside the demos' timed passes
    text = out.getvalue()
    assert "demo" in text and "5/5" in text and "\r" in text


def test_plain_lines_on_a_terminal_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    out = _Tty()
    with Progress(10, "x", stream=out) as p:
        p.update(10)
    assert out.getvalue() == out.getvalue().replace("\r", "")
    assert out.getvalue().splitlines()[-1].startswith("x: 100.0% 10/10")


def test_disabled_prints_nothing_but_counts() -> None:
    out = _Tty()
    with Progress(3, "quiet", enabled=False, stream=out) as p:
        p.update(3)
    assert out.getvalue() == "" and p.done == 3
