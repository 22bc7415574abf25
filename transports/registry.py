"""Find transports by name: built-ins, `register()`ed factories, and the `tierkv.transports`
entry-point group, so a third-party package adds a transport without touching this one::

    # in the third party's pyproject.toml
    [project.entry-points."tierkv.transports"]
    mytransport = "my_pkg.transport:MyTransport"

`create(name, **kw)` calls the factory with `kw`; the result is not started (use ``async with``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Transport
from .errors import TransportError, UnknownTransportError
from .named import Registry

__all__ = ["ENTRY_POINT_GROUP", "TRANSPORTS", "available", "create", "register", "unregister"]

ENTRY_POINT_GROUP = "tierkv.transports"
Factory = Callable[..., Transport]

TRANSPORTS: Registry[Transport] = Registry(
    "transport",
    error=UnknownTransportError,
    misuse=TransportError,
    builtins={
        "loopback": "tierkv.transports.loopback:LoopbackTransport",
        "nixl": "tierkv.transports.nixl:NixlTransport",  # needs nixl-cu12; imported when created
        "shm": "tierkv.transports.shm:ShmTransport",
        "tcp": "tierkv.transports.tcp:TcpTransport",
    },
    result=Transport,
    group=ENTRY_POINT_GROUP,
)
"""Transports by name: built-ins, `register()`ed factories, then the entry-point group."""


def register(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make `factory` (a `Transport` subclass or any callable returning one) available as `name`.

    Raises ValueError if `name` is taken and `replace` is false.
    """
    TRANSPORTS.register(name, factory, replace=replace)


def unregister(name: str) -> None:
    """Forget a registered factory. Missing names are ignored."""
    TRANSPORTS.unregister(name)


def available() -> list[str]:
    """Names `create` accepts: built-ins, registered factories and entry points."""
    return TRANSPORTS.available()


def create(name: str, /, **kwargs: Any) -> Transport:
    """A new (unstarted) transport of kind `name`.

    Raises UnknownTransportError (a TransportError and an UnknownNameError) for an unknown name;
    TransportError for options the factory does not take or a factory that returns something
    else.
    """
    return TRANSPORTS.create(name, **kwargs)
