"""One error tree: every error the library defines is a TierKVError, each name defined once, and
the exported pieces (page table, serving engine) raise typed errors."""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import warnings
from pathlib import Path

import pytest

import tierkv
from tierkv import errors as e
from tierkv import runtime, transports
from tierkv.page_table import PageTable
from tierkv.runtime.errors import PageLockError, RuntimeEngineError
from tierkv.serving import (
    Engine,
    EngineConfig,
    EngineNotOpenError,
    RequestError,
    SamplingParams,
    ServingError,
    TinyModel,
    http_status,
)


def _library_errors() -> dict[str, list[type[BaseException]]]:
    """Exception classes by name, over every module of the three packages that imports here."""
    found: dict[str, list[type[BaseException]]] = {}
    for pkg in (tierkv, runtime, transports):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    mod = importlib.import_module(info.name)
            except ImportError:  # an optional dependency (cupy, nixl, transformers) missing
                continue
            for obj in vars(mod).values():
                if (
                    isinstance(obj, type)
                    and issubclass(obj, BaseException)
                    and obj.__module__ == mod.__name__
                ):
                    found.setdefault(obj.__name__, [])
                    if obj not in found[obj.__name__]:
                        found[obj.__name__].append(obj)
    return found


ERRORS = _library_errors()


def test_every_error_of_the_library_is_a_tierkv_error() -> None:
    assert len(ERRORS) > 40  # the walk found the trees (tierkv, runtime, transports, remote)
    kinds = [k for ks in ERRORS.values() for k in ks]
    assert sorted(k.__qualname__ for k in kinds if not issubclass(k, e.TierKVError)) == []


def test_each_error_is_defined_once() -> None:
    twice = {n: [k.__module__ for k in kinds] for n, kinds in ERRORS.items() if len(kinds) > 1}
    assert twice == {}
    assert ERRORS["PinError"] == [e.PinError]


def test_the_root_lives_in_the_lowest_layer_and_is_re_exported() -> None:
    assert e.TierKVError.__module__ == "tierkv.transports.errors"
    assert tierkv.TierKVError is runtime.errors.TierKVError is e.TierKVError
    assert issubclass(transports.TransportError, e.TierKVError)
    assert issubclass(RuntimeEngineError, e.TierKVError)


def test_the_old_runtime_pin_error_is_a_deprecated_alias() -> None:
    from tierkv.runtime import cuda_arena

    with pytest.warns(DeprecationWarning, match="PageLockError"):
        assert cuda_arena.PinError is PageLockError  # type: ignore[attr-defined]
    assert not issubclass(PageLockError, e.PageTableError)  # not the page table's e.PinError


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: PageTable({}), e.InvalidInputError),
        (lambda: PageTable({"device": -1}), e.InvalidInputError),
        (lambda: PageTable({"device": 1.5}), e.InvalidInputError),  # type: ignore[dict-item]
        (lambda: PageTable({"device": 4}, "belady"), e.UnknownPolicyError),
        (lambda: PageTable({"device": 4}, {"device": "belady"}), e.UnknownPolicyError),
        (
            lambda: PageTable({"device": 4}).prepare_store([b"a"], "device", [None, None]),
            e.InvalidInputError,
        ),  # type: ignore[list-item]
        (lambda: PageTable({"device": 4}).prepare_evict("device", -1), e.InvalidInputError),
        (lambda: PageTable({"device": 4}).candidates("device", -1), e.InvalidInputError),
    ],
)
def test_the_page_table_raises_typed_errors(call: object, error: type[e.TierKVError]) -> None:
    with pytest.raises(error) as info:
        call()  # type: ignore[operator]
    assert isinstance(info.value, e.TierKVError) and isinstance(info.value, ValueError)


def test_a_request_error_is_a_tierkv_error_and_still_a_value_error() -> None:
    assert issubclass(RequestError, ServingError) and issubclass(RequestError, e.InvalidInputError)
    assert issubclass(RequestError, ValueError)
    with pytest.raises(e.InvalidInputError):
        SamplingParams(max_tokens=0)
    with pytest.raises(e.InvalidInputError):
        EngineConfig(max_running=0)


async def test_a_request_to_an_engine_not_open_is_typed() -> None:
    engine = Engine(TinyModel(), EngineConfig(max_running=1, max_context=64))
    with pytest.raises(EngineNotOpenError):
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
            pass


async def test_an_engine_closed_does_not_open_again() -> None:
    """open() after close() returned the closed engine as if open (its next request then said
    'not open'): the reopen itself is refused, typed."""
    engine = Engine(TinyModel(), EngineConfig(max_running=1, max_context=64))
    await engine.open()
    await engine.close()
    with pytest.raises(EngineNotOpenError, match="closed"):
        await engine.open()
    await engine.close()  # a second close is still a no-op


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (RequestError("too long"), 400),
        (e.InvalidInputError("bad"), 400),
        (e.SpecError("bad"), 400),
        (e.UnknownPolicyError("nope"), 400),
        (e.UnknownNameError("nope"), 400),
        (EngineNotOpenError("closed"), 503),
        (e.StoreClosedError("closed"), 503),
        (e.TierFullError("full"), 503),
        (e.StoreTimeoutError("slow"), 504),
        (e.TransferFailedError("copy"), 500),
        (e.TierKVError("other"), 500),
    ],
)
def test_http_status_of_each_kind(exc: e.TierKVError, status: int) -> None:
    assert http_status(exc) == status


ROOT = Path(__file__).resolve().parents[2]

# (file, built-in error) raised on purpose, each for its reason; anything else a module raises
# must be a TierKVError
BUILTIN_RAISES_ALLOWED = {
    ("tierkv/__init__.py", "AttributeError"): "module __getattr__ protocol",
    ("tierkv/remote/__init__.py", "AttributeError"): "module __getattr__ protocol",
    ("runtime/cuda_arena.py", "AttributeError"): "module __getattr__ protocol",
    ("tierkv/remote/sources/watch.py", "StopAsyncIteration"): "async iterator protocol",
    ("transports/named.py", "KeyError"): "Registry is a MutableMapping",
    ("tierkv/policies/history.py", "KeyError"): "internal: pop_oldest of an empty history",
    ("tierkv/sequence.py", "IndexError"): "internal: a block past the last one",
    ("runtime/cpu_copy.py", "IndexError"): "internal, as the C kernel's; streams map it",
    ("transports/crc32c_native.py", "IndexError"): "internal, as the C kernel's (crc32c_rows)",
    ("tierkv/replay.py", "RuntimeError"): "an invariant of a one-tier replay (cannot happen)",
    ("transports/session.py", "ConnectionResetError"): "an OSError the transports map",
    ("tierkv/integrations/smollm2_loader.py", "FileNotFoundError"): "an OSError: no weights",
    ("tierkv/cli/serve.py", "ImportError"): "the CLI's optional dependency check",
}


def _builtin_raises() -> set[tuple[str, str]]:
    builtin = {
        n
        for n in dir(builtins)
        if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)
    }
    found: set[tuple[str, str]] = set()
    for folder in ("tierkv", "runtime", "transports"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Raise) and node.exc is not None:
                    f = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                    if isinstance(f, ast.Name) and f.id in builtin:
                        found.add((rel.as_posix(), f.id))
    return found


def test_no_module_raises_a_plain_builtin_error() -> None:
    assert sorted(_builtin_raises() - set(BUILTIN_RAISES_ALLOWED)) == []
