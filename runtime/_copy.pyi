"""Type stub of the native batch copy (runtime/_copy.c; built by setup.py where a compiler is)."""

from typing_extensions import Buffer

STREAMING: str

def copy_rows(
    dst: Buffer, src: Buffer, dst_ids: Buffer, src_ids: Buffer, row: int, stream_min: int, /
) -> int: ...
def check_ids(ids: Buffer, limit: int, /) -> int: ...
