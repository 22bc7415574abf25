"""Type stub of the native int8 dequantization (tierkv/codecs/_dequant.c; built by setup.py)."""

ISA: str

def dequant(
    out: int,
    out_stride: int,
    q: int,
    q_stride: int,
    s: int,
    s_stride: int,
    pages: int,
    groups: int,
    t: int,
    d: int,
    g: int,
    dtype: int,
    /,
) -> None: ...
def bad_scales(s: int, s_stride: int, pages: int, count: int, mask: int, /) -> int: ...
