"""Where the cluster directory keeps its data in Redis / Valkey, and the Lua that reads and
writes it (every script runs atomically on one slot).

::

    {ns}:{m}:seq      INCR: node numbers, never reused (a restarted node gets a new one);
                      starts at the server's clock (s): a Redis that lost its data hands
                      out numbers above the ones it handed out before
    {ns}:{m}:alive    zset  node number -> expiry (ms, the server's clock); live: score > now
    {ns}:{m}:addr     hash  node number -> address (what locate answers)
    {ns}:{m}:ids      hash  address -> node number holding it now
    {ns}:{m}:dead     set   node numbers whose entries wait for the sweep
    {ns}:{m}:conf     hash  buckets, shards (the first node to register sets them)
    {ns}:{s<i>}:<b>   hash  bucket b of shard i: page key -> node numbers (uint32 LE each)

A page key picks its shard from bytes 4..7 (mod shards) and its bucket from bytes 8 and 9: the
bucket's name ends with byte 8 and byte 9 masked to the shard's bucket bits (8 to 16: 256 to
65,536 buckets per shard), raw bytes, so that a script names a bucket with two string
operations (keys are blake2b digests: uniform; a `struct.unpack`, a modulo and a number to
string cost 2.4x more per key, measured). A bucket of a few dozen keys stays a listpack
(``hash-max-listpack-entries`` 128, values up to 64 bytes = 16 holders): about 25 bytes per
(key, node) entry. The hash tag
``{s<i>}`` keeps a shard on one slot (cluster mode): a script reads or writes many buckets of a
shard at once; the meta keys share the tag ``{m}``.

Requests carry keys as one blob (no per-key argument): the keys end to end when all have one
length (``fixed``: 16 or 18), else records ``len (1 byte) | key``::

    locate(names and keys)    -> per key its holder count (uint16), the holders end to end
                                 (a Cluster; a standalone server gets `Layout.hgets`: plain
                                 HGET commands, wire.py)
    publish(idx, add, drop)   -> adds (HSETNX first: one call for a new key), drops
    sweep(first, last, dead)  -> buckets first..last rid of the dead numbers
    register / refresh / leave / lapsed: the {m} keys
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.errors import InvalidInputError
from tierkv.keys import is_content

__all__ = [
    "LEAVE",
    "LIVE",
    "LOCATE",
    "PUBLISH",
    "REFRESH",
    "REGISTER",
    "SWEEP",
    "Layout",
    "blob",
    "check_keys",
    "fixed_length",
    "pack",
    "resp",
]


class Layout:
    """Key names of one directory namespace."""

    def __init__(self, namespace: str, buckets: int, shards: int) -> None:
        self.namespace, self.buckets, self.shards = namespace, buckets, shards
        bits = min(16, max(8, (max(1, buckets // shards)).bit_length() - 1))
        self.per_shard = 1 << bits
        self.mask = (1 << (bits - 8)) - 1  # of key byte 9
        self._masked = bytes(b & self.mask for b in range(256))  # (a bytes.translate table)
        meta = f"{namespace}:{{m}}:"
        self.seq, self.alive, self.addr = meta + "seq", meta + "alive", meta + "addr"
        self.ids, self.dead, self.conf = meta + "ids", meta + "dead", meta + "conf"
        self.sweep_lock = meta + "sweep"

    def meta_keys(self) -> list[str]:
        """The keys every membership script is given (one slot: the tag ``{m}``)."""
        return [self.seq, self.alive, self.addr, self.ids, self.dead]

    def shard_prefix(self, shard: int) -> str:
        """Bucket names of a shard are this prefix and the bucket number."""
        return f"{self.namespace}:{{s{shard}}}:"

    def shard_of(self, key: bytes) -> int:
        """The shard of a page key."""
        return int.from_bytes(key[4:8], "little") % self.shards

    def bucket_of(self, key: bytes) -> bytes:
        """The name of a page key's bucket."""
        prefix = self.shard_prefix(self.shard_of(key)).encode()
        return prefix + bytes((key[8], key[9] & self.mask))

    def records(self, shard: int, keys_blob: bytes, fixed: int, keys: Sequence[bytes]) -> bytes:
        """LOCATE's request: per key its bucket's name (of shard ``shard``), then the key (a
        length byte first when ``fixed`` is 0). Keys of one length (``keys_blob``, end to end)
        are laid out by C slice assignments, one per byte column (30 of them), not a Python
        step per key."""
        prefix = self.shard_prefix(shard).encode()
        if not fixed:
            return b"".join(prefix + bytes((k[8], k[9] & self.mask, len(k))) + k for k in keys)
        return bytes(self._columns(prefix, b"", b"", keys_blob, fixed))

    def hgets(self, keys_blob: bytes, fixed: int, keys: Sequence[bytes]) -> bytes | bytearray:
        """One ``HGET bucket key`` per key in RESP, end to end (a standalone server's locate:
        wire.py). Keys of one length on one shard are laid out by C slices (`records`), any
        other request by a step per key."""
        if not fixed or self.shards != 1:
            return b"".join(resp(b"HGET", self.bucket_of(k), k) for k in keys)
        prefix = self.shard_prefix(0).encode()
        head = b"*3\r\n$4\r\nHGET\r\n$%d\r\n%s" % (len(prefix) + 2, prefix)
        return self._columns(head, b"\r\n$%d\r\n" % fixed, b"\r\n", keys_blob, fixed)

    def _columns(
        self, head: bytes, mid: bytes, tail: bytes, keys_blob: bytes, fixed: int
    ) -> bytearray:
        """Per key ``head``, its bucket's two bytes, ``mid``, the key, ``tail``: records of one
        width filled by one C slice assignment per byte column."""
        n, at = len(keys_blob) // fixed, len(head)
        first = at + 2 + len(mid)
        width = first + fixed + len(tail)
        out = bytearray((head + bytes(2) + mid + bytes(fixed) + tail) * n)
        out[at::width] = keys_blob[8::fixed]
        ninth = keys_blob[9::fixed]
        out[at + 1 :: width] = ninth if self.mask == 255 else ninth.translate(self._masked)
        for j in range(fixed):
            out[first + j :: width] = keys_blob[j::fixed]
        return out


def resp(*args: bytes | str | int) -> bytes:
    """One command in RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


def fixed_length(*groups: Sequence[bytes]) -> int:
    """The length every key of ``groups`` has, or 0 when they differ."""
    sizes = {len(k) for g in groups for k in g}
    return sizes.pop() if len(sizes) == 1 else 0


def blob(keys: Sequence[bytes], fixed: int) -> bytes:
    """The keys as one blob: end to end (``fixed``), or length-prefixed records."""
    return b"".join(keys) if fixed else b"".join(bytes((len(k),)) + k for k in keys)


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise InvalidInputError unless every key is a content page key (16..255 bytes)."""
    for k in keys:
        if not isinstance(k, bytes) or not 16 <= len(k) <= 255 or not is_content(k):
            raise InvalidInputError(f"the directory holds content page keys only, not {k!r}")


def pack(keys: Sequence[bytes]) -> tuple[bytes, int]:
    """`check_keys`, then ``(blob, fixed)`` of the keys. The common case (keys of one length,
    plain bytes) costs a few C calls, not a Python step per key: the lengths and types as sets,
    the blob joined once, and the content bit of every key (its first byte below 0x80) read as
    ``isascii`` of the blob's every ``fixed``-th byte (0.3 ms per 1,000 keys -> 0.03 ms)."""
    if set(map(type, keys)) == {bytes}:
        sizes = set(map(len, keys))
        if len(sizes) == 1 and 16 <= (fixed := sizes.pop()) <= 255:
            joined = b"".join(keys)
            if joined[::fixed].isascii():  # no private bit (0x80) on any first byte
                return joined, fixed
    check_keys(keys)
    fixed = fixed_length(keys)
    return blob(keys, fixed), fixed


# -- membership (the {m} keys: seq, alive, addr, ids, dead) --------------------------------
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

#: ARGV address, ttl_ms, prev (our former number or 0) -> {number, 0} or {-1, ms the holder
#: has left}: an address held by another live node is refused; our own former number (or a
#: lapsed holder) is retired to the sweep
REGISTER = (
    _NOW
    + """
local cur = redis.call('HGET', KEYS[4], ARGV[1])
if cur and cur ~= ARGV[3] then
  local score = redis.call('ZSCORE', KEYS[2], cur)
  if score and tonumber(score) > now then return {-1, tonumber(score) - now} end
end
if cur then
  redis.call('ZREM', KEYS[2], cur)
  redis.call('HDEL', KEYS[3], cur)
  redis.call('SADD', KEYS[5], cur)
end
if redis.call('EXISTS', KEYS[1]) == 0 then  -- a new (or emptied) Redis: numbers start at
  redis.call('SET', KEYS[1], math.floor(now / 1000))  -- the clock, past any issued before
end
local idx = redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[4], ARGV[1], idx)
redis.call('HSET', KEYS[3], idx, ARGV[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), idx)
return {idx, 0}
"""
)

#: ARGV number, address, ttl_ms -> 1 refreshed, 0 lapsed or replaced (register again).
#: Lapsed nodes found on the way go to the sweep (a few per call).
REFRESH = (
    _NOW
    + """
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 64)
for _, idx in ipairs(gone) do
  redis.call('ZREM', KEYS[2], idx)
  redis.call('HDEL', KEYS[3], idx)
  redis.call('SADD', KEYS[5], idx)
end
if redis.call('HGET', KEYS[4], ARGV[2]) ~= ARGV[1] then return 0 end
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

#: ARGV number, address: a clean leave (its entries go to the sweep)
LEAVE = """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
if redis.call('HGET', KEYS[4], ARGV[2]) == ARGV[1] then redis.call('HDEL', KEYS[4], ARGV[2]) end
return 1
"""

#: -> {number, address, number, address...} of the live nodes
LIVE = (
    _NOW
    + """
local live = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')
local out = {}
if #live == 0 then return out end
local addrs = redis.call('HMGET', KEYS[3], unpack(live))
for i, idx in ipairs(live) do
  if addrs[i] then out[#out + 1] = idx; out[#out + 1] = addrs[i] end
end
return out
"""
)

# -- buckets (one shard: KEYS[1] names its slot) -------------------------------------------
#: Lua: the key at ``pos`` of ``blob`` (``fixed`` bytes, or a length byte first) into ``key``,
#: ``pos`` past it
_CUT_KEY = """
  if fixed > 0 then key = sub(blob, pos, pos + fixed - 1); pos = pos + fixed
  else
    local len = byte(blob, pos)
    key = sub(blob, pos + 1, pos + len)
    pos = pos + 1 + len
  end
"""

_RECORDS = (
    """
local sub, byte, char, band, call = string.sub, string.byte, string.char, bit.band, redis.call
local mask = tonumber(ARGV[2])
local fixed = tonumber(ARGV[4])
local function records(blob, fn)
  local pos, n, pre = 1, #blob, ARGV[1]
  while pos <= n do
    local key
"""
    + _CUT_KEY
    + """
    if mask == 255 then fn(pre .. sub(key, 9, 10), key)
    else fn(pre .. sub(key, 9, 9) .. char(band(byte(key, 10), mask)), key) end
  end
end
"""
)

#: ARGV name length, key length (0: a length byte first), records (`Layout.records`: per key
#: its bucket's full name, then the key) -> {counts, holders}: per key its number of holders
#: (uint16 LE), the holders of every key end to end (uint32 LE each), and how many keys' values
#: tierkv never writes (no whole number of holders, over 65,535 of them, a bucket that is no
#: hash: written by another writer) were taken as no holders. The client names the
#: buckets (C slices over the whole request), so the script cuts two strings per key and joins
#: none (the name built here, ``prefix .. sub(key, 9, 10)``, cost 0.24 ms per 1,000 keys);
#: two bulk strings come back, not an array of 1,000, unpacked by one C call each.
LOCATE = (
    """
local sub, byte, char, call, floor = string.sub, string.byte, string.char, redis.pcall, math.floor
local name, fixed, blob = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local counts, held, i, h, n, pos, bad = {}, {}, 0, 0, #blob, 1, 0
local none, one = char(0, 0), char(1, 0)
while pos <= n do
  local bucket, key = sub(blob, pos, pos + name - 1), nil
  pos = pos + name
"""
    + _CUT_KEY
    + """
  local v = call('HGET', bucket, key)  -- (pcall: a bucket that is no hash answers a table)
  i = i + 1
  if type(v) == 'table' or (v and (#v % 4 ~= 0 or #v > 262140)) then bad = bad + 1; v = false end
  if not v then counts[i] = none
  else
    h = h + 1
    held[h] = v
    local k = #v / 4
    if k == 1 then counts[i] = one else counts[i] = char(k % 256, floor(k / 256)) end
  end
end
return {table.concat(counts), table.concat(held), bad}
"""
)

#: ARGV prefix, mask, number (4 bytes), fixed, add blob, drop blob -> entries added
PUBLISH = (
    _RECORDS
    + """
local me, added = ARGV[3], 0
local function has(v)
  for i = 1, #v, 4 do if string.sub(v, i, i + 3) == me then return true end end
  return false
end
records(ARGV[5], function(bucket, key)
  if call('HSETNX', bucket, key, me) == 1 then added = added + 1; return end
  local v = call('HGET', bucket, key)
  if not has(v) then call('HSET', bucket, key, v .. me); added = added + 1 end
end)
records(ARGV[6], function(bucket, key)
  local v = call('HGET', bucket, key)
  if not v then return end
  local keep = {}
  for i = 1, #v, 4 do
    local one = string.sub(v, i, i + 3)
    if one ~= me then keep[#keep + 1] = one end
  end
  if #keep == 0 then redis.call('HDEL', bucket, key)
  elseif #keep * 4 ~= #v then redis.call('HSET', bucket, key, table.concat(keep)) end
end)
return added
"""
)

#: ARGV prefix, first bucket, last bucket, dead numbers (4 bytes each) -> entries removed;
#: bucket i is named by the bytes i % 256, i / 256
SWEEP = """
local dead = {}
for i = 1, #ARGV[4], 4 do dead[string.sub(ARGV[4], i, i + 3)] = true end
local removed = 0
for b = tonumber(ARGV[2]), tonumber(ARGV[3]) do
  local bucket = ARGV[1] .. string.char(b % 256, math.floor(b / 256))
  local all = redis.call('HGETALL', bucket)
  for i = 1, #all, 2 do
    local v = all[i + 1]
    local keep = {}
    for j = 1, #v, 4 do
      local one = string.sub(v, j, j + 3)
      if dead[one] then removed = removed + 1 else keep[#keep + 1] = one end
    end
    if #keep == 0 then redis.call('HDEL', bucket, all[i])
    elseif #keep * 4 ~= #v then redis.call('HSET', bucket, all[i], table.concat(keep)) end
  end
end
return removed
"""
