"""Find transports by name: built-ins, `register()`ed factories, and the `tierkv.transports`
entry-point group, so a third-party package adds a transport without touching this one::

    # in the third party's pyproject.toml
    [project.entry-points."tierkv.transports"]
    mytransport = "my_pkg.transport:MyTransport"

`create(name, **kw)` calls the factory with `kw`; the result is not started (use ``async with``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from .base import Transport
from .errors import TransportError

__all__ = ["ENTRY_POINT_GROUP", "available", "create", "register", "unregister"]

ENTRY_POINT_GROUP = "tierkv.transports"
Factory = Callable[..., Transport]

_BUILTINS = {
    "loopback": "tierkv.transports.loopback:LoopbackTransport",
    "nixl": "tierkv.transports.nixl:NixlTransport",  # needs nixl-cu12; imported only when created
    "shm": "tierkv.transports.shm:ShmTransport",
    "tcp": "tierkv.transports.tcp:TcpTransport",
}
_factories: dict[str, Factory] = {}


def register(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make `factory` (a `Transport` subclass or any callable returning one) available as `name`.

    Raises ValueError if `name` is taken and `replace` is false.
    """
    if not replace and (name in _factories or name in _BUILTINS):
        raise ValueError(f"transport {name!r} is already registered")
    _factories[name] = factory


def unregister(name: str) -> None:
    """Forget a registered factory (built-ins stay). Missing names are ignored."""
    _factories.pop(name, None)


def available() -> list[str]:
    """Names `create` accepts: built-ins, registered factories and entry points."""
    names = set(_BUILTINS) | set(_factories)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def create(name: str, /, **kwargs: Any) -> Transport:
    """A new (unstarted) transport of kind `name`.

    Looks in registered factories, then built-ins, then the `tierkv.transports` entry points.
    Raises TransportError for an unknown name or a factory that returns something else.
    """
    factory = _factories.get(name) or _builtin(name) or _from_entry_points(name)
    if factory is None:
        raise TransportError(f"unknown transport {name!r}; available: {available()}")
    transport = factory(**kwargs)
    if not isinstance(transport, Transport):
        raise TransportError(f"factory for {name!r} returned {type(transport).__name__}")
    return transport


def _builtin(name: str) -> Factory | None:
    target = _BUILTINS.get(name)
    if target is None:
        return None
    module, _, attr = target.partition(":")
    factory: Factory = getattr(importlib.import_module(module), attr)
    return factory


def _from_entry_points(name: str) -> Factory | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                factory: Factory = ep.load()
            except Exception as exc:
                raise TransportError(f"entry point {ep.value!r} for {name!r} failed") from exc
            _factories.setdefault(name, factory)
            return factory
    return None
