"""Tenant names and salts are checked at entry with typed errors."""

from __future__ import annotations

import pytest

from tierkv import InvalidTypeError, TenantError
from tierkv.tenant_names import MAX_SALT_BYTES, MAX_TENANT_CHARS, check_salt, check_tenant


@pytest.mark.parametrize("name", ["a", "acme", "acme-1.prod_2", "9" * MAX_TENANT_CHARS])
def test_good_tenant_names_pass_unchanged(name: str) -> None:
    assert check_tenant(name) == name


@pytest.mark.parametrize(
    "name", ["", "a" * (MAX_TENANT_CHARS + 1), "a b", "-a", ".a", "a/b", "a:b", "é", "a\n"]
)
def test_bad_tenant_names_are_tenant_errors(name: str) -> None:
    with pytest.raises(TenantError):
        check_tenant(name)


@pytest.mark.parametrize("name", [None, 1, b"acme", ["acme"], 1.5])
def test_tenant_of_wrong_type_is_a_type_error_too(name: object) -> None:
    with pytest.raises(TenantError) as info:
        check_tenant(name)
    assert isinstance(info.value, InvalidTypeError) and isinstance(info.value, TypeError)


def test_salts() -> None:
    assert check_salt(None) is None
    assert check_salt("abc") == b"abc"
    assert check_salt(b"\x00\xff") == b"\x00\xff"
    assert check_salt("é") == "é".encode()
    assert check_salt(b"x" * MAX_SALT_BYTES) == b"x" * MAX_SALT_BYTES
    for bad in ("", b"", b"x" * (MAX_SALT_BYTES + 1), "é" * (MAX_SALT_BYTES // 2 + 1)):
        with pytest.raises(TenantError):
            check_salt(bad)
    for wrong in (1, 1.0, bytearray(b"x"), ["x"]):
        with pytest.raises(InvalidTypeError):
            check_salt(wrong)


def test_tenants_that_differ_only_in_case_are_refused_and_an_unknown_one_gets_a_hint() -> None:
    """Names are exact matches everywhere; ``acme`` and ``Acme`` configured side by side is a
    typo splitting one customer in two (found by the last probe): refused at construction,
    and a request naming ``ACME`` is told which name it may have meant."""
    from tierkv import Quota
    from tierkv.errors import UnknownTenantError
    from tierkv.remote.protocol.tenancy import check_secrets
    from tierkv.tenants import Tenants

    with pytest.raises(TenantError, match="differ only in case"):
        Tenants({"acme": Quota(), "Acme": Quota()}, {"host": 1}, {"host": 4})
    with pytest.raises(TenantError, match="differ only in case"):
        check_secrets({"acme": b"s1", "ACME": b"s2"}, b"default-secret")
    t = Tenants({"acme": Quota(), "bob": Quota()}, {"host": 1}, {"host": 4})
    with pytest.raises(UnknownTenantError, match="did you mean 'acme'"):
        t.tenant("ACME")
    with pytest.raises(UnknownTenantError) as err:
        t.tenant("carol")
    assert "did you mean" not in str(err.value)


def test_a_short_secret_is_taken_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A 1-byte secret (the server's or a tenant's) lets a peer guess it in 256 tries: taken
    (tests and old setups use short ones), with a warning naming whose it is (found by the
    probe: it was silent)."""
    import logging

    from tierkv.remote.protocol.exposure import MIN_SECRET_BYTES, resolve_secret
    from tierkv.remote.protocol.tenancy import check_secrets

    with caplog.at_level(logging.WARNING):
        assert resolve_secret(b"x") == b"x"
        check_secrets({"acme": b"y"}, b"z" * MIN_SECRET_BYTES)
    got = [r.getMessage() for r in caplog.records]
    assert any("the shared secret has 1 bytes" in m for m in got), got
    assert any("tenant 'acme'" in m and "1 bytes" in m for m in got), got
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        resolve_secret(b"k" * MIN_SECRET_BYTES)
        check_secrets({"acme": b"a" * 32}, b"z" * MIN_SECRET_BYTES)
    assert not caplog.records
