"""The registry: register/create, and a third-party transport found through an entry point."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import tierkv.transports as transports
from tierkv.transports import TransferOp, TransportError

ROOT = Path(__file__).resolve().parents[2]

PLUGIN = '''
from tierkv.transports.loopback import LoopbackTransport

class PluginTransport(LoopbackTransport):
    """A third party's transport (a renamed loopback)."""
    kind = "plugin"
'''


@pytest.fixture
def plugin_on_path(tmp_path: Path) -> Iterator[None]:
    """A package `tkv_plugin` with a dist-info declaring a `tierkv.transports` entry point."""
    (tmp_path / "tkv_plugin.py").write_text(PLUGIN)
    dist = tmp_path / "tkv_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tkv-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [tierkv.transports]
            plugin = tkv_plugin:PluginTransport
            broken = tkv_plugin:DoesNotExist
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("tkv_plugin", None)
        transports.unregister("plugin")


async def test_entry_point_transport_is_found_and_used(plugin_on_path: None) -> None:
    assert "plugin" in transports.available()
    async with transports.create("plugin", name="p1") as a, transports.create("plugin") as b:
        assert type(a).__name__ == "PluginTransport"
        theirs = b.register_memory(bytearray(b"plugged!"))
        mine = a.allocate(8)
        await a.add_peer(b.metadata())
        await a.read([TransferOp(mine, 0, theirs.descriptor, 0, 8)])
        assert bytes(mine.view) == b"plugged!"
    with pytest.raises(TransportError):
        transports.create("broken")


def test_register_and_errors() -> None:
    def factory(**kw: object) -> object:
        return object()

    transports.register("not-a-transport", factory)  # type: ignore[arg-type]
    try:
        with pytest.raises(ValueError):
            transports.register("not-a-transport", factory)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            transports.register("tcp", factory)  # type: ignore[arg-type]
        with pytest.raises(TransportError):
            transports.create("not-a-transport")
    finally:
        transports.unregister("not-a-transport")
    with pytest.raises(TransportError):
        transports.create("no-such-transport")
    assert {"loopback", "shm", "tcp"} <= set(transports.available())


async def test_the_custom_transport_example() -> None:
    spec = importlib.util.spec_from_file_location(
        "custom_transport_example", ROOT / "examples" / "custom_transport.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        assert "queue" in transports.available()
        await module.main()
        async with transports.create("queue") as a:
            assert a.capabilities.one_sided == "emulated"
    finally:
        transports.unregister("queue")
