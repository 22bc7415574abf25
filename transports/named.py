"""`Registry`: named factories of one kind, the one shape every tierkv registry has.

Transports, backends, eviction policies and codecs are each chosen by name. Each kind keeps one
`Registry`, and every registry behaves the same way:

- ``register(name, factory, replace=False)`` adds a factory; a taken name raises
  InvalidInputError (a ValueError) unless ``replace`` is true (built-ins included, so a typo
  never silently shadows one);
- ``unregister(name)`` forgets a registered factory (a built-in it replaced comes back);
- ``available()`` lists the names ``create`` accepts;
- ``create(name, **kwargs)`` calls the factory; an unknown name raises the kind's typed error (an
  ``UnknownNameError``), options the factory does not take raise the kind's misuse error;
- it is a mutable mapping of name -> factory, so ``name in registry``, ``sorted(registry)`` and
  ``unittest.mock.patch.dict(registry, ...)`` work.

Built-ins may be given as ``"module:attr"`` strings, imported on first use (a transport that needs
an optional package costs nothing until it is created). A registry with an entry-point group also
finds factories that installed distributions declare there.

It lives in the lowest layer (transports) so that all three layers can use it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from .errors import InvalidInputError, InvalidTypeError

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(MutableMapping[str, Callable[..., T]], Generic[T]):
    """Named factories producing ``T`` (see the module docstring for the rules).

    Args:
        kind: what the names stand for, used in messages ("transport", "backend", ...).
        error: the exception type an unknown name raises (the kind's ``UnknownNameError``).
        misuse: what ``create`` raises for options the factory does not take or a factory
            returning something else (default: ``error``).
        builtins: name -> factory or ``"module:attr"``.
        result: when given, ``create`` checks the factory returned an instance of it.
        group: an entry-point group to search after the registered names.
        fold_case: names are case-insensitive (stored lower-case).
    """

    def __init__(
        self,
        kind: str,
        *,
        error: type[Exception],
        misuse: type[Exception] | None = None,
        builtins: Mapping[str, Callable[..., T] | str] | None = None,
        result: type | None = None,
        group: str | None = None,
        fold_case: bool = False,
    ) -> None:
        self.kind = kind
        self.group = group
        self._error = error
        self._misuse = misuse or error
        self._result = result
        self._fold = fold_case
        self._builtins = {self._key(n): f for n, f in (builtins or {}).items()}
        self._entries: dict[str, Callable[..., T] | str] = dict(self._builtins)

    def _key(self, name: object) -> str:
        if not isinstance(name, str):
            raise self._error(f"{self.kind} name must be a str, got {type(name).__name__}")
        return name.lower() if self._fold else name

    # -- the four verbs ---------------------------------------------------------------------
    def register(self, name: str, factory: Callable[..., T], *, replace: bool = False) -> None:
        """Make ``create(name, **kw)`` call ``factory(**kw)``.

        Raises:
            InvalidInputError: ``name`` is taken (a built-in, registered or entry-point name) and
                ``replace`` is false.
            InvalidTypeError: ``factory`` is not callable.
        """
        key = self._key(name)
        if not callable(factory):
            raise InvalidTypeError(f"{self.kind} factory for {name!r} is not callable")
        if not replace and key in self:
            raise InvalidInputError(
                f"{self.kind} {name!r} is already registered; pass replace=True"
            )
        self._entries[key] = factory

    def unregister(self, name: str) -> None:
        """Forget a registered ``name`` (a built-in it replaced comes back); a missing name is
        ignored."""
        key = self._key(name)
        self._entries.pop(key, None)
        if key in self._builtins:
            self._entries[key] = self._builtins[key]

    def available(self) -> list[str]:
        """Every name ``create`` accepts, sorted."""
        names = set(self._entries)
        names.update(self._entry_point_names())
        return sorted(names)

    def create(self, name: str, /, **kwargs: Any) -> T:
        """A new ``T`` from the factory named ``name``, called with ``kwargs``.

        Raises:
            the kind's error: an unknown name.
            the kind's misuse error: options the factory does not take (checked against its
                signature before it is called), or a factory that returned something else.
        """
        factory = self.factory(name)
        try:
            signature = inspect.signature(factory)
        except (TypeError, ValueError):  # no signature to check (some builtins)
            signature = None
        if signature is not None:
            try:
                signature.bind(**kwargs)
            except TypeError as exc:
                raise self._misuse(f"{self.kind} {name!r}: {exc}") from exc
        made = factory(**kwargs)
        if self._result is not None and not isinstance(made, self._result):
            raise self._misuse(
                f"{self.kind} factory for {name!r} returned {type(made).__name__}, "
                f"not {self._result.__name__}"
            )
        return made

    def factory(self, name: str) -> Callable[..., T]:
        """The factory for ``name`` (imported on first use). Raises the kind's error if unknown."""
        key = self._key(name)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._from_entry_points(key)
        if entry is None:
            raise self._error(f"unknown {self.kind} {name!r}; choose from {self.available()}")
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            self._entries[key] = entry
        return entry

    # -- entry points -----------------------------------------------------------------------
    def _entry_point_names(self) -> set[str]:
        if self.group is None:
            return set()
        return {self._key(ep.name) for ep in entry_points(group=self.group)}

    def _from_entry_points(self, key: str) -> Callable[..., T] | None:
        if self.group is None:
            return None
        for ep in entry_points(group=self.group):
            if self._key(ep.name) == key:
                try:
                    loaded: Callable[..., T] = ep.load()
                except Exception as exc:
                    raise self._error(
                        f"entry point {ep.value!r} for {self.kind} {key!r} failed to load"
                    ) from exc
                self._entries[key] = loaded
                return loaded
        return None

    # -- the mapping ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Callable[..., T]:
        try:
            return self.factory(name)
        except self._error as exc:
            raise KeyError(name) from exc

    def __setitem__(self, name: str, factory: Callable[..., T]) -> None:
        self.register(name, factory, replace=True)

    def __delitem__(self, name: str) -> None:
        key = self._key(name)
        if key not in self._entries:
            raise KeyError(name)
        del self._entries[key]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = self._key(name)
        return key in self._entries or key in self._entry_point_names()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._entries)})"
