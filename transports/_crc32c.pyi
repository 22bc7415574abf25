"""Type stub of the native CRC-32C (transports/_crc32c.c; built by setup.py where a compiler is)."""

from collections.abc import Sequence

from typing_extensions import Buffer

def crc32c(data: Buffer, crc: int = 0, /) -> int: ...
def init(fold: bool, /) -> int: ...
def crc32c_rows(data: Buffer, row_bytes: int, rows: Buffer, /) -> bytes: ...

# a run of disk slots (tierkv/disk/io.py): payloads, keys, generations and slots per page
_Pages = Sequence[Buffer]
_Ints = Sequence[int]

def check_slots(
    headers: Buffer, stride: int, payloads: _Pages, keys: Sequence[bytes], generations: _Ints,
    slots: _Ints, page_bytes: int, /,
) -> bytes: ...  # fmt: skip
def pack_slots(
    headers: Buffer, stride: int, payloads: _Pages, keys: Sequence[bytes], generations: _Ints,
    slots: _Ints, flags: _Ints, page_bytes: int, /,
) -> None: ...  # fmt: skip
