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
