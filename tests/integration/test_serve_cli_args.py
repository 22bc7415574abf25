"""``tierkv serve`` given arguments or a tenants file that cannot work: status 2 and a message
naming the flag before anything is opened; never a traceback, never a wait on a FIFO, never
a silent start without the tenants asked for."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli import main as cli_main
from tierkv.cli.tenants_file import MAX_BYTES, read_tenants

SECRET = "5e17e5"
BASE = ["serve", "--secret", SECRET, "--listen", "127.0.0.1:0"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--host-mb", "inf"], "--host-mb must be > 0 and finite"),  # OverflowError
        (["--lease-ttl", "inf"], "--lease-ttl must be > 0 and finite"),  # served
        (["--every", "inf"], "--every must be > 0 and finite"),
        (["--directory-ttl", "inf"], "--directory-ttl must be > 0 and finite"),
        (["--allow-uid", "-5"], "--allow-uid"),
        (["--tenants", ""], "--tenants is empty"),  # served without tenants
        (["--advertise", "foo"], "--advertise must be HOST:PORT"),  # registered as is
        (["--advertise", ":7600"], "--advertise must name the host"),
        (["--advertise", "h:0"], "--advertise must name the host"),
    ],
)
def test_bad_arguments_fail_before_serving(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[Any]
) -> None:
    assert cli_main([*BASE, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_secret_that_is_not_hex_names_the_flag(capsys: pytest.CaptureFixture[Any]) -> None:
    assert cli_main(["serve", "--secret", "a", "--listen", "127.0.0.1:0"]) == 2
    assert "--secret is not hex" in capsys.readouterr().err


def _file(tmp_path: Path, data: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "tenants"
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def test_a_fifo_is_refused_without_waiting_for_a_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[Any]
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    done: list[int] = []
    t = threading.Thread(
        target=lambda: done.append(cli_main([*BASE, "--tenants", str(fifo)])), daemon=True
    )
    t.start()
    t.join(30.0)  # (bounds a broken test only: the old open waited forever)
    if t.is_alive():
        with open(fifo, "wb"):  # let the old code's open return, so the thread ends
            pass
        t.join(30.0)
        pytest.fail("the tenants file's open waited for a writer")
    assert done == [2] and "not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"acme\xff\xfe 0011\n", "not UTF-8 text"),  # named no file
        (b"#" * (MAX_BYTES + 1), f"larger than {MAX_BYTES} bytes"),
    ],
)
def test_bad_tenants_files_name_the_file(
    tmp_path: Path, data: bytes, message: str, capsys: pytest.CaptureFixture[Any]
) -> None:
    path = _file(tmp_path, data)
    assert cli_main([*BASE, "--tenants", path]) == 2
    err = capsys.readouterr().err
    assert message in err and path in err


def test_a_byte_order_mark_is_no_part_of_the_first_name(tmp_path: Path) -> None:
    """A file saved by an editor that writes a BOM: the first tenant was refused as having
    characters outside the set (an invisible one)."""
    path = _file(tmp_path, "\ufeffacme 0011\nbeta 2233\n".encode())
    assert read_tenants(path) == {"acme": b"\x00\x11", "beta": b"\x22\x33"}


def test_a_link_is_followed_and_its_target_checked(tmp_path: Path) -> None:
    """Secret mounts (Kubernetes) are links: followed, the target's mode is what counts."""
    real = _file(tmp_path, b"acme 0011\n")
    link = tmp_path / "link"
    link.symlink_to(real)
    assert read_tenants(str(link)) == {"acme": b"\x00\x11"}
    Path(real).chmod(0o644)
    with pytest.raises(ValueError, match="group or others"):
        read_tenants(str(link))


@pytest.mark.parametrize("advertise", ["foo", ":7600", "h:0", "h:99999", "h:x", 7600])
def test_a_page_server_refuses_an_address_no_client_could_reach(advertise: object) -> None:
    """``PageServer(advertise=)`` (the library's --advertise) took any value and registered it
    in the directory as this node's address."""
    from tierkv import KVStore
    from tierkv.errors import InvalidInputError
    from tierkv.remote import PageServer
    from tierkv.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16)
    store = KVStore(spec, device_bytes=4 * spec.page_bytes, host_bytes=16 * spec.page_bytes)
    with pytest.raises(InvalidInputError, match="advertise"):
        PageServer(store, secret=b"s", advertise=advertise)  # type: ignore[arg-type]
    PageServer(store, secret=b"s", advertise="10.0.0.7:7600")  # (never started)
