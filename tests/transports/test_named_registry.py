"""Every registry (transports, backends, policies, codecs) is one `Registry` with the same rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest

from tierkv import codecs, policies
from tierkv.errors import TierKVError, UnknownPolicyError
from tierkv.runtime import BackendUnavailableError, CpuBackend
from tierkv.runtime import registry as backends
from tierkv.transports import TransportError
from tierkv.transports import registry as transports
from tierkv.transports.loopback import LoopbackTransport
from tierkv.transports.named import Registry

# (registry, a built-in name, a factory of the right type, the kind's unknown-name error)
KINDS: list[tuple[Registry[Any], str, Callable[..., Any], type[Exception]]] = [
    (transports.TRANSPORTS, "loopback", LoopbackTransport, TransportError),
    (backends.BACKENDS, "cpu", CpuBackend, BackendUnavailableError),
    (policies.POLICIES, "lru", policies.LRUPolicy, UnknownPolicyError),
    (codecs.CODECS, "fp16", codecs.Fp16Codec, codecs.UnknownCodecError),
]
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
        with pytest.raises(error, match="returned object"):
            reg.create("wrong-type")
    finally:
        reg.unregister("wrong-type")


def test_patch_dict_works_and_restores() -> None:
    before = policies.POLICIES.available()
    with mock.patch.dict(policies.POLICIES, {"mine": policies.LRUPolicy}):
        assert isinstance(policies.make_policy("mine"), policies.LRUPolicy)
    assert policies.POLICIES.available() == before


def test_domain_helpers_keep_their_typed_errors() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        policies.make_policy("belady")
    assert isinstance(info.value, TierKVError) and isinstance(info.value, ValueError)
    with pytest.raises(codecs.UnknownCodecError):
        codecs.get_codec("zstd")
    assert isinstance(codecs.get_codec("FP16"), codecs.Fp16Codec)  # codec names fold case
    with pytest.raises(BackendUnavailableError):
        backends.get_backend("tpu")
    with pytest.raises(TransportError):
        transports.create("carrier-pigeon")
    with pytest.raises(TransportError):
        transports.TRANSPORTS.create(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(("reg", "builtin", "factory", "error"), KINDS, ids=IDS)
def test_options_a_factory_does_not_take_are_the_kinds_error(
    reg: Registry[Any], builtin: str, factory: Callable[..., Any], error: type[Exception]
) -> None:
    with pytest.raises(error, match="unexpected keyword"):
        reg.create(builtin, no_such_option=1)
