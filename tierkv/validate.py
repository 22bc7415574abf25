"""Checks at the entry of the store's public calls, before anything is allocated or changed.

What the store accepts (anything else raises an :class:`~tierkv.errors.InvalidInputError`;
wrong types an :class:`~tierkv.errors.InvalidTypeError`, also a ``TypeError``):

==================  ===========================================================================
token ids           a sequence of ints (numpy integer scalars too), a 1-D integer numpy array or
                    a 1-D integer tensor; every id in ``[0, 2**32)`` (:data:`TOKEN_ID_LIMIT`).
                    Keys hash ids as int64, so without the range ``-1`` and ``2**64 - 1`` would
                    name the same block. Floats (even ``3.0``), bools, strings and None are
                    rejected, never truncated.
sequence ids        a non-empty ``str``; an int (not a bool) is taken as its decimal string, so
                    ``5`` and ``"5"`` name *the same* sequence (adding both raises
                    SequenceError), never two sequences sharing page keys.
layers              ints in ``[0, num_layers)``.
k, v                ``torch.Tensor`` ``[H, n, D]`` in the spec's dtype, on the device tier's
                    device or the cpu (copied over); never a meta tensor. Values are stored:
                    a tensor that requires grad is detached.
names               a ``str`` that the kind's registry knows (policy, codec, backend; ``"auto"``
                    for a backend): an unknown one raises that registry's
                    :class:`~tierkv.errors.UnknownNameError` at entry.
budgets (bytes)     ints >= 0 (``8 << 30``); strings such as ``"1G"`` are not parsed.
timeouts (s)        finite numbers > 0, at most :data:`MAX_SECONDS` (~31 years).
==================  ===========================================================================
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping, Sequence
from numbers import Real
from typing import Any, TypeGuard

import msgpack
import numpy as np
import numpy.typing as npt
import torch

from tierkv.errors import InvalidInputError, InvalidTypeError, SequenceError, SpecError
from tierkv.spec import KVSpec
from tierkv.transports.named import Registry

TOKEN_ID_LIMIT = 1 << 32
"""Token ids are ints in ``[0, TOKEN_ID_LIMIT)``."""

_TEXT = (str, bytes, bytearray, memoryview)


def _is_int(x: object) -> TypeGuard[int | np.integer[Any]]:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _type(x: object) -> str:
    return type(x).__name__


# -- tokens ---------------------------------------------------------------------------------
def token_array(tokens: object, what: str = "tokens") -> npt.NDArray[np.int64]:
    """``tokens`` as a 1-D int64 array, every id in ``[0, TOKEN_ID_LIMIT)``.

    Raises:
        InvalidTypeError: not a sequence, array or tensor of integers.
        SpecError: not 1-D, or an id out of range.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidTypeError(
                f"{what}: token ids must be integers, got a {tokens.dtype} tensor"
            )
        if tokens.device.type == "meta":
            raise SpecError(f"{what}: a meta tensor holds no token ids")
        arr: np.ndarray[Any, Any] = tokens.detach().cpu().numpy()
    elif isinstance(tokens, np.ndarray):
        arr = tokens
    elif isinstance(tokens, Sequence) and not isinstance(tokens, _TEXT):
        try:
            arr = np.asarray(tokens)
        except (TypeError, ValueError, OverflowError) as exc:
            raise InvalidTypeError(f"{what}: not a flat sequence of ints ({exc})") from None
    else:
        raise InvalidTypeError(
            f"{what}: expected a sequence of ints, a numpy array or a tensor, got {_type(tokens)}"
        )
    if arr.ndim != 1:
        raise SpecError(f"{what}: token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind in "Of" and isinstance(tokens, Sequence):
            _explain(tokens, what)  # ints mixed past int64 (numpy made floats or objects of them)
        raise InvalidTypeError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= TOKEN_ID_LIMIT:
        bad = lo if lo < 0 else hi
        raise SpecError(f"{what}: token ids must be in [0, 2**32), got {bad}")
    return arr.astype(np.int64, copy=False)


def token_ids(tokens: object, what: str = "tokens") -> list[int]:
    """``tokens`` checked as by :func:`token_array`, as a new list of ints. A short list of
    Python ints (a decode step's sampled tokens) is checked without numpy (0.4 us, not 3.7)."""
    if isinstance(tokens, list) and len(tokens) <= 64 and _plain_ids(tokens):
        return list(tokens)
    ids: list[int] = token_array(tokens, what).tolist()
    return ids


def _plain_ids(tokens: list[Any]) -> bool:
    return all(type(t) is int and 0 <= t < TOKEN_ID_LIMIT for t in tokens)


def _explain(tokens: Sequence[Any], what: str) -> None:
    for i, x in enumerate(tokens):
        if not _is_int(x):
            raise InvalidTypeError(f"{what}: token {i} is {_type(x)} {x!r}, not an int")
    for x in tokens:
        if not 0 <= int(x) < TOKEN_ID_LIMIT:
            raise SpecError(f"{what}: token ids must be in [0, 2**32), got {x}")


# -- sequences and layers -------------------------------------------------------------------
def seq_id(x: object) -> str:
    """A sequence id as the store keys it: a non-empty str; an int becomes its decimal string.

    Raises InvalidTypeError (another type), InvalidInputError (an empty string).
    """
    if isinstance(x, str):
        if not x:
            raise InvalidInputError("a sequence id must not be empty")
        return x
    if _is_int(x):
        return str(operator.index(x))
    raise InvalidTypeError(f"a sequence id is a str (or an int), got {_type(x)} {x!r}")


def seq_ids(xs: object, what: str = "seq_ids") -> list[str]:
    """A list of sequence ids (:func:`seq_id` each). Raises InvalidTypeError for a single str
    or a non-sequence."""
    if isinstance(xs, _TEXT) or not isinstance(xs, Sequence):
        raise InvalidTypeError(f"{what}: expected a list of sequence ids, got {_type(xs)} {xs!r}")
    return [seq_id(x) for x in xs]


def blocks(xs: object, ids: Sequence[str]) -> dict[str, tuple[int, ...]] | None:
    """A lease's ``blocks``: None, or a mapping of some of ``ids`` to page indices (ints >= 0;
    one past a layer's pages is passed over there, as layers differ in length). Raises
    InvalidTypeError (not a mapping, an index that is no int: a str was compared with ints),
    InvalidInputError (a negative index), SequenceError (a sequence the lease does not name:
    its blocks were ignored)."""
    if xs is None:
        return None
    if not isinstance(xs, Mapping):
        raise InvalidTypeError(f"blocks: expected a dict of seq id -> pages, got {_type(xs)}")
    out: dict[str, tuple[int, ...]] = {}
    named = set(ids)
    for sid, chosen in xs.items():
        key = seq_id(sid)
        if key not in named:
            raise SequenceError(f"blocks names sequence {key!r}, which the lease does not")
        if isinstance(chosen, _TEXT) or not isinstance(chosen, Sequence | range | np.ndarray):
            raise InvalidTypeError(f"blocks[{key!r}]: expected a list of page indices")
        if not all(_is_int(b) for b in chosen):
            raise InvalidTypeError(f"blocks[{key!r}]: page indices are ints, got {chosen!r:.80}")
        got = tuple(int(b) for b in chosen)
        if any(b < 0 for b in got):
            raise InvalidInputError(f"blocks[{key!r}]: page indices are >= 0, got {got!r:.80}")
        out[key] = got
    return out


def layer(x: object, num_layers: int) -> int:
    """A layer index in ``[0, num_layers)``. Raises InvalidTypeError, SpecError."""
    if not _is_int(x):
        raise InvalidTypeError(f"a layer is an int, got {_type(x)} {x!r}")
    i = operator.index(x)
    if not 0 <= i < num_layers:
        raise SpecError(f"layer {i} out of range [0, {num_layers})")
    return int(i)


def layers(xs: object, num_layers: int) -> list[int]:
    """A list of layers (all of them for None). Raises InvalidTypeError, SpecError."""
    if xs is None:
        return list(range(num_layers))
    if isinstance(xs, _TEXT) or not isinstance(xs, Sequence | range | np.ndarray):
        raise InvalidTypeError(f"layers: expected a list of ints or None, got {_type(xs)}")
    return [layer(x, num_layers) for x in xs]


# -- tensors --------------------------------------------------------------------------------
def kv_tensors(
    spec: KVSpec, k: object, v: object, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check new KV: two tensors ``[H, n, D]`` of the same shape in ``spec.dtype``, on
    ``device`` or the cpu. Returns them detached from autograd (a cache holds values: copying
    a tensor that requires grad into a page would make the whole arena part of its graph).
    Only dense tensors with data hold KV: sparse (COO, CSR, CSC, BSR, BSC), mkldnn and nested
    tensors, meta tensors and subclasses with a dispatch of their own (FakeTensor, DTensor...)
    are refused. Raises InvalidTypeError, SpecError."""
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise InvalidTypeError(f"{name}: expected a torch.Tensor [H, n, D], got {_type(x)}")
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    for name, x in (("k", k), ("v", v)):  # before the shape: a nested tensor has none
        _dense(name, x)
    n = k.shape[1] if k.dim() == 3 else -1
    shape = (spec.num_kv_heads, n, spec.head_dim)
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or tuple(x.shape) != shape:
            raise SpecError(f"{name}: expected shape {shape} ([H, n, D]), got {tuple(x.shape)}")
        if x.dtype != spec.dtype:
            raise SpecError(f"{name}: expected dtype {spec.dtype}, got {x.dtype}")
        if x.device.type == "meta" or (x.device != device and x.device.type != "cpu"):
            raise SpecError(f"{name}: expected a tensor on {device} (or the cpu), got {x.device}")
    return (k.detach() if k.requires_grad else k), (v.detach() if v.requires_grad else v)


def _dense(name: str, x: torch.Tensor) -> None:
    """Raise SpecError unless ``x`` is a dense tensor whose bytes can be copied into a page."""
    if x.is_nested:
        raise SpecError(f"{name}: expected a dense tensor [H, n, D], got a nested tensor")
    if x.layout != torch.strided:
        raise SpecError(f"{name}: expected a dense (strided) tensor [H, n, D], got {x.layout}")
    if getattr(type(x), "__torch_dispatch__", None) is not _PLAIN_DISPATCH:
        raise SpecError(
            f"{name}: expected a tensor with data, got a {type(x).__name__} (a tensor subclass "
            "with a dispatch of its own)"
        )


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


# -- construction -----------------------------------------------------------------------------
def spec(x: object) -> KVSpec:
    """A KVSpec. Raises InvalidTypeError."""
    if not isinstance(x, KVSpec):
        raise InvalidTypeError(f"spec: expected a tierkv.KVSpec, got {_type(x)}")
    return x


def byte_size(name: str, x: object) -> int:
    """A size in bytes: an int >= 0. Raises InvalidTypeError (a str such as "1G", a float),
    InvalidInputError (negative)."""
    if not _is_int(x):
        raise InvalidTypeError(
            f"{name}: a size in bytes is an int (e.g. 8 << 30), got {_type(x)} {x!r}"
        )
    n = int(operator.index(x))
    if n < 0:
        raise InvalidInputError(f"{name} must be >= 0, got {n}")
    return n


def count(name: str, x: object, minimum: int) -> int:
    """An int >= ``minimum``. Raises InvalidTypeError, InvalidInputError."""
    if not _is_int(x):
        raise InvalidTypeError(f"{name}: expected an int, got {_type(x)} {x!r}")
    n = int(operator.index(x))
    if n < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, got {n}")
    return n


MAX_SECONDS = 1e9
"""The longest timeout or interval taken (about 31 years: any longer is a typo). A thread's
wait of more than ``threading.TIMEOUT_MAX`` (~292 years) raises OverflowError: a
``SyncKVStore(timeout=1e300)`` failed so at construction."""


def seconds(name: str, x: object, *, allow_zero: bool = False) -> float:
    """A finite number of seconds, > 0 (>= 0 with ``allow_zero``), at most
    :data:`MAX_SECONDS`. Raises InvalidTypeError, InvalidInputError."""
    if not isinstance(x, Real) or isinstance(x, (bool, np.bool_)):
        raise InvalidTypeError(f"{name}: expected seconds as a number, got {_type(x)} {x!r}")
    s = _as_float(x)
    if not math.isfinite(s) or s < 0 or (s == 0 and not allow_zero) or s > MAX_SECONDS:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidInputError(
            f"{name} must be a finite number of seconds {bound} and <= {MAX_SECONDS:g}, "
            f"got {x!r:.40}"
        )
    return s


def _as_float(x: Any) -> float:
    """``float(x)``; an int past a float's range is infinity (float() raised OverflowError,
    which the callers' range checks then refuse as InvalidInputError)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def fraction(name: str, x: object) -> float:
    """A number in ``[0, 1)``. Raises InvalidTypeError, InvalidInputError."""
    if not isinstance(x, Real) or isinstance(x, (bool, np.bool_)):
        raise InvalidTypeError(f"{name}: expected a number in [0, 1), got {_type(x)} {x!r}")
    f = _as_float(x)
    if not 0 <= f < 1:
        raise InvalidInputError(f"{name} must be in [0, 1), got {x!r:.40}")
    return f


def flag(name: str, x: object) -> bool:
    """A bool. Raises InvalidTypeError (a string such as "no" would read as true)."""
    if not isinstance(x, (bool, np.bool_)):
        raise InvalidTypeError(f"{name}: expected a bool, got {_type(x)} {x!r}")
    return bool(x)


def name(what: str, x: object, choices: Collection[str] | None = None) -> str:
    """A str (one of ``choices`` when given). Raises InvalidTypeError, InvalidInputError."""
    if not isinstance(x, str):
        raise InvalidTypeError(f"{what}: expected a str, got {_type(x)} {x!r}")
    if choices is not None and x not in choices:
        raise InvalidInputError(f"{what}: unknown {x!r}; choose from {sorted(choices)}")
    return x


def registered(what: str, x: object, registry: Registry[Any], *extra: str) -> str:
    """A name that ``registry`` knows, or one of ``extra``. Raises InvalidTypeError, or the
    registry's own :class:`~tierkv.errors.UnknownNameError` (listing the names it knows)."""
    x = name(what, x)
    if x not in extra:
        registry.factory(x)  # an unknown name raises the registry's typed error
    return x


def namespace(x: object) -> object:
    """A namespace msgpack can encode (see :func:`tierkv.keys.root_key`). Raises
    InvalidTypeError."""
    try:
        msgpack.packb(x, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidTypeError(f"namespace: cannot be encoded as a key ({exc})") from None
    return x
