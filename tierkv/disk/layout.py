"""The on-disk format: segment files of fixed-size slots, one self-describing header per slot.

::

    PATH/
      lock                       flock'ed by the process that has PATH open
      layout.json                format, page_bytes, key_bytes, slot_bytes, slots_per_segment
      segment-00000.tkvd         preallocated: slots_per_segment * slot_bytes
      segment-00001.tkvd         ...

    slot i of a segment, at offset i * slot_bytes       (ALIGN = 4096)
      +--------------------------+----------------------------------------+
      | header (ALIGN bytes)     | payload (page_bytes, padded to ALIGN)  |
      +--------------------------+----------------------------------------+

    header (little-endian; the rest of the ALIGN bytes is zero)
      0  magic        8s   b"TKVDISK\\x01"
      8  version      u16  1
     10  flags        u16  bit 0: PERSISTENT (a content-keyed full block)
     12  key_len      u16  16 or 32
     14  (zero)       u16
     16  key          32s  the page key, zero-padded
     48  generation   u64  unique per write, increasing across restarts
     56  length       u32  payload bytes (= page_bytes)
     60  payload_crc  u32  CRC-32C of the payload
     64  slot         u64  the global slot index (a misdirected write is caught)
     72  header_crc   u32  CRC-32C of bytes 0..72

A slot is served only when its header is intact (magic, version, header_crc), names the key and
generation the index expects at that slot, and the payload read back has payload_crc. A torn
write (header and payload from different writes, or half of either) fails one of these checks:
nothing needs ordering or fsync for a ``kill -9`` to leave nothing served wrong. Headers whose
PERSISTENT flag is clear (a live sequence's private pages) are free slots at the next open.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from .errors import DiskConfigError, DiskLayoutError

ALIGN = 4096
MAGIC = b"TKVDISK\x01"
VERSION = 1
FLAG_PERSISTENT = 1
KEY_FIELD = 32
KEY_SIZES = (16, 32)

_ZERO_KEY = bytes(KEY_FIELD)
_HEADER = struct.Struct("<8sHHHH32sQIIQ")
_HEADER_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _HEADER_CRC.size  # 76
LAYOUT_FILE = "layout.json"
LOCK_FILE = "lock"


def round_up(n: int, to: int = ALIGN) -> int:
    """`n` rounded up to a multiple of `to`."""
    return -(-n // to) * to


def segment_name(index: int) -> str:
    """The file name of segment `index`."""
    return f"segment-{index:05d}.tkvd"


class Header(NamedTuple):
    """A slot header, parsed (a tuple: the read path builds one per page)."""

    flags: int
    key: bytes
    generation: int
    length: int
    payload_crc: int
    slot: int

    @property
    def persistent(self) -> bool:
        """Whether the slot is found again after a restart."""
        return bool(self.flags & FLAG_PERSISTENT)


def pack_header(out: memoryview, header: Header, crc: object) -> None:
    """Write `header` into `out` (at least HEADER_BYTES; the caller zeroed the rest once).
    `crc` is the CRC-32C function ``crc(data, seed) -> int``."""
    key = header.key
    _HEADER.pack_into(
        out,
        0,
        MAGIC,
        VERSION,
        header.flags,
        len(key),
        0,
        key,
        header.generation,
        header.length,
        header.payload_crc,
        header.slot,
    )
    _HEADER_CRC.pack_into(out, _HEADER.size, crc(out[: _HEADER.size], 0))  # type: ignore[operator]


def unpack_header(raw: memoryview, crc: object) -> Header | None:
    """The header in `raw` (at least HEADER_BYTES), or None when it is not an intact header of
    this format (never written, torn, damaged or hostile: every field is checked, nothing
    raises)."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, flags, key_len, zero, key, generation, length, pcrc, slot = _HEADER.unpack_from(
        raw, 0
    )
    if magic != MAGIC or version != VERSION or zero != 0 or key_len not in KEY_SIZES:
        return None
    (stored,) = _HEADER_CRC.unpack_from(raw, _HEADER.size)
    if crc(raw[: _HEADER.size], 0) != stored:  # type: ignore[operator]
        return None
    if key[key_len:] != _ZERO_KEY[key_len:]:
        return None
    return Header(flags, bytes(key[:key_len]), generation, length, pcrc, slot)


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where every slot lives: sizes fixed when PATH is first opened (``layout.json``)."""

    page_bytes: int
    key_bytes: int
    slots_per_segment: int
    capacity: int  # slots in all segments together
    #: the payload area of a slot (page_bytes padded to ALIGN)
    payload_bytes: int = field(init=False)
    #: the stride of slots in a segment file (computed once: `place` runs per page)
    slot_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload_bytes", round_up(self.page_bytes))
        object.__setattr__(self, "slot_bytes", ALIGN + self.payload_bytes)

    @property
    def segments(self) -> int:
        """How many segment files."""
        return -(-self.capacity // self.slots_per_segment)

    def segment_slots(self, segment: int) -> int:
        """The slots of segment `segment` (the last one may be shorter)."""
        return min(self.slots_per_segment, self.capacity - segment * self.slots_per_segment)

    def place(self, slot: int) -> tuple[int, int]:
        """(segment, byte offset of the slot's header) of global slot `slot`."""
        seg, i = divmod(slot, self.slots_per_segment)
        return seg, i * self.slot_bytes

    @staticmethod
    def plan(page_bytes: int, key_bytes: int, disk_bytes: int, segment_bytes: int) -> Geometry:
        """The geometry of `disk_bytes` of slots of `page_bytes` pages. Raises DiskConfigError
        when not even one slot fits, or a size is not a positive int."""
        for name, value in (
            ("page_bytes", page_bytes),
            ("disk_bytes", disk_bytes),
            ("segment_bytes", segment_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DiskConfigError(f"{name} must be a positive int, got {value!r}")
        if key_bytes not in KEY_SIZES:
            raise DiskConfigError(f"key_bytes must be one of {KEY_SIZES}, got {key_bytes!r}")
        slot_bytes = ALIGN + round_up(page_bytes)
        if disk_bytes < slot_bytes:
            raise DiskConfigError(
                f"disk_bytes={disk_bytes} holds no page: one slot of a {page_bytes}-byte page "
                f"takes {slot_bytes} bytes (a {ALIGN}-byte header and the page padded to {ALIGN})"
            )
        per_segment = max(1, segment_bytes // slot_bytes)
        return Geometry(page_bytes, key_bytes, per_segment, disk_bytes // slot_bytes)


def read_layout(path: str) -> dict[str, int] | None:
    """The layout recorded in PATH, or None when PATH has none yet. Raises DiskLayoutError when
    the file is unreadable or not ours."""
    name = os.path.join(path, LAYOUT_FILE)
    try:
        with open(name, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DiskLayoutError(f"cannot read {name}: {exc}") from exc
    try:  # (hostile bytes: Infinity, 10^400 or deep nesting raise more than ValueError)
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DiskLayoutError(f"{name} is not a tierkv disk layout: {exc!r:.200}") from None
    keys = ("format", "page_bytes", "key_bytes", "slot_bytes", "slots_per_segment")
    if not isinstance(data, dict) or not all(_whole(data.get(k)) for k in keys):
        raise DiskLayoutError(
            f"{name} is not a tierkv disk layout: want ints {', '.join(keys)}, got {data!r:.200}"
        )
    return {k: data[k] for k in keys}


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_layout(path: str, recorded: dict[str, int], geometry: Geometry) -> None:
    """Raise DiskLayoutError when `recorded` (from layout.json) differs from `geometry`."""
    wanted = layout_record(geometry)
    diff = {k: (recorded.get(k), v) for k, v in wanted.items() if recorded.get(k) != v}
    if diff:
        detail = ", ".join(f"{k}: on disk {a}, asked {b}" for k, (a, b) in diff.items())
        raise DiskLayoutError(
            f"{path} holds disk pages of another layout ({detail}); open it with the same "
            "page size and segment size, or give another path"
        )


def layout_record(geometry: Geometry) -> dict[str, int]:
    """What layout.json records of `geometry` (capacity may change between opens)."""
    return {
        "format": VERSION,
        "page_bytes": geometry.page_bytes,
        "key_bytes": geometry.key_bytes,
        "slot_bytes": geometry.slot_bytes,
        "slots_per_segment": geometry.slots_per_segment,
    }


def write_layout(path: str, geometry: Geometry) -> None:
    """Record `geometry` in PATH atomically (a temporary file renamed over)."""
    name = os.path.join(path, LAYOUT_FILE)
    tmp = name + ".tmp"
    with open(tmp, "w") as f:
        json.dump(layout_record(geometry), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, name)
