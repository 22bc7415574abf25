"""Every registry (transports, backends, policies, codecs) is one `Registry` with the same rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest

import tierkv
from tierkv import codecs, policies, runtime
from tierkv.errors import SpecError, TierKVError, UnknownNameError, UnknownPolicyError
from tierkv.runtime import BackendUnavailableError, CpuBackend
from tierkv.runtime import registry as backends
from tierkv.runtime.errors import UnknownBackendError
from tierkv.transports import TransportError
from tierkv.transports import registry as transports
from tierkv.transports.errors import UnknownTransportError
from tierkv.transports.loopback import LoopbackTransport
from tierkv.transports.named import Registry

# (registry, a built-in name, a factory of the right type, the kind's unknown-name error)
KINDS: list[tuple[Registry[Any], str, Callable[..., Any], type[Exception]]] = [
    (transports.TRANSPORTS, "loopback", LoopbackTransport, UnknownTransportError),
    (backends.BACKENDS, "cpu", CpuBackend, UnknownBackendError),
    (policies.POLICIES, "lru", policies.LRUPolicy, UnknownPolicyError),
    (codecs.CODECS, "fp16", codecs.Fp16Codec, codecs.UnknownCodecError),
]
# the kind's misuse error (options a factory does not take, a factory of the wrong type)
MISUSE = {
    "transport": TransportError,
    "backend": BackendUnavailableError,
    "eviction policy": SpecError,
    "codec": SpecError,
}
IDS = [r.kind for r, *_ in KINDS]


@pytest.mark.parametrize(("reg", "builtin", "factory", "error"), KINDS, ids=IDS)
def test_one_shape(
    reg: Registry[Any], builtin: str, factory: Callable[..., Any], error: type[Exception]
) -> None:
    assert builtin in reg.available() and builtin in reg
    with pytest.raises(ValueError, match="already registered"):
        reg.register(builtin, factory)  # a built-in is never shadowed silently
    reg.register("extra-one", factory)
    try:
        with pytest.raises(ValueError, match="already registered"):
            reg.register("extra-one", factory)
        reg.register("extra-one", factory, replace=True)
        assert isinstance(reg.create("extra-one"), factory)  # type: ignore[arg-type]
        assert "extra-one" in reg.available()
    finally:
        reg.unregister("extra-one")
    assert "extra-one" not in reg
    reg.unregister("never-there")  # ignored
    with pytest.raises(error, match="unknown"):
        reg.create("no-such-thing")
    with pytest.raises(TypeError):
        reg.register("not-callable", 42)  # type: ignore[arg-type]


@pytest.mark.parametrize(("reg", "builtin", "factory", "error"), KINDS, ids=IDS)
def test_replacing_a_builtin_then_unregistering_brings_it_back(
    reg: Registry[Any], builtin: str, factory: Callable[..., Any], error: type[Exception]
) -> None:
    original = reg.factory(builtin)
    reg.register(builtin, factory, replace=True)
    reg.unregister(builtin)
    assert reg.factory(builtin) is original


@pytest.mark.parametrize(("reg", "builtin", "factory", "error"), KINDS, ids=IDS)
def test_a_factory_of_the_wrong_type_is_a_typed_error(
    reg: Registry[Any], builtin: str, factory: Callable[..., Any], error: type[Exception]
) -> None:
    reg.register("wrong-type", lambda **_: object())
    try:
        with pytest.raises(MISUSE[reg.kind], match="returned object"):
            reg.create("wrong-type")
    finally:
        reg.unregister("wrong-type")


def test_patch_dict_works_and_restores() -> None:
    before = policies.POLICIES.available()
    with mock.patch.dict(policies.POLICIES, {"mine": policies.LRUPolicy}):
        assert isinstance(policies.create_policy("mine"), policies.LRUPolicy)
    assert policies.POLICIES.available() == before


def test_domain_helpers_keep_their_typed_errors() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        policies.create_policy("belady")
    assert isinstance(info.value, TierKVError) and isinstance(info.value, ValueError)
    with pytest.raises(codecs.UnknownCodecError):
        codecs.create_codec("zstd")
    assert isinstance(codecs.create_codec("FP16"), codecs.Fp16Codec)  # codec names fold case
    with pytest.raises(BackendUnavailableError):
        backends.create_backend("tpu")
    with pytest.raises(TransportError):
        transports.create("carrier-pigeon")
    with pytest.raises(TransportError):
        transports.TRANSPORTS.create(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(("reg", "builtin", "factory", "error"), KINDS, ids=IDS)
def test_options_a_factory_does_not_take_are_the_kinds_error(
    reg: Registry[Any], builtin: str, factory: Callable[..., Any], error: type[Exception]
) -> None:
    with pytest.raises(MISUSE[reg.kind], match="unexpected keyword"):
        reg.create(builtin, no_such_option=1)


# each unknown-name error keeps the base it had before it became an UnknownNameError
OLD_BASES = {
    "transport": TransportError,
    "backend": BackendUnavailableError,
    "eviction policy": ValueError,
    "codec": KeyError,
}


@pytest.mark.parametrize(("reg", "builtin", "factory", "error"), KINDS, ids=IDS)
def test_unknown_names_are_one_kind_of_error(
    reg: Registry[Any], builtin: str, factory: Callable[..., Any], error: type[Exception]
) -> None:
    with pytest.raises(UnknownNameError) as info:
        reg.create("no-such-thing")
    assert isinstance(info.value, error) and isinstance(info.value, OLD_BASES[reg.kind])
    assert isinstance(info.value, TierKVError) and isinstance(info.value, LookupError)
    assert "no-such-thing" in str(info.value) and builtin in str(info.value)  # says the choices
    assert not str(info.value).startswith("'")  # a KeyError's quotes do not leak into messages


def test_every_registry_verb_is_create_the_old_ones_warn() -> None:
    assert isinstance(runtime.create_backend("cpu"), CpuBackend)
    assert isinstance(tierkv.create_policy("lru"), policies.LRUPolicy)
    assert isinstance(codecs.create_codec("fp16"), codecs.Fp16Codec)
    old = [
        (runtime.get_backend, ("cpu",), CpuBackend),
        (backends.get_backend, ("cpu",), CpuBackend),
        (tierkv.make_policy, ("lru",), policies.LRUPolicy),
        (policies.make_policy, ("lru",), policies.LRUPolicy),
        (codecs.get_codec, ("fp16",), codecs.Fp16Codec),
    ]
    for alias, args, kind in old:
        with pytest.warns(DeprecationWarning, match=f"{alias.__name__} is deprecated; use create"):
            assert isinstance(alias(*args), kind)
    with pytest.warns(DeprecationWarning), pytest.raises(UnknownPolicyError):
        tierkv.make_policy("belady")  # the alias raises what the new name raises
