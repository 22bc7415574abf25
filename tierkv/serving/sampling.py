"""Sampling parameters, the choice of the next token, and stop strings on the decoded text."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from tierkv.arguments import checked_init
from tierkv.errors import InvalidInputError, InvalidTypeError


@checked_init
@dataclass(frozen=True)
class SamplingParams:
    """How a request generates.

    Args:
        max_tokens: tokens to generate at most.
        temperature: 0 is greedy (argmax); otherwise softmax of ``logits / temperature``.
        top_p: nucleus sampling: keep the smallest set of tokens with this probability mass.
        seed: seeds the request's own generator (None: drawn from torch's global one).
        stop_ids: token ids that end the request (give the tokenizer's end-of-sequence ids
            here); the stop token is not part of the output.
        stop: strings that end the request; the output text is cut before the first one.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_types(self)
        if self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidInputError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidInputError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidInputError("stop strings must not be empty")


def _whole(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_types(p: SamplingParams) -> None:
    """Each field of the type it is used as (checked before a request starts: a float seed or
    a str of stop ids failed inside the request, a bare str of stops stopped at any of its
    characters). ``stop_ids`` becomes a frozenset and a single stop string a 1-tuple.
    Raises InvalidTypeError."""
    if not _whole(p.max_tokens):
        raise InvalidTypeError(f"max_tokens must be an int, got {p.max_tokens!r}")
    for name in ("temperature", "top_p"):
        if not _real(getattr(p, name)):
            raise InvalidTypeError(f"{name} must be a number, got {getattr(p, name)!r}")
    if p.seed is not None and not _whole(p.seed):
        raise InvalidTypeError(f"seed must be an int or None, got {p.seed!r}")
    ids = p.stop_ids
    if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise InvalidTypeError(f"stop_ids must be a collection of token ids, got {ids!r:.80}")
    ids = frozenset(ids)
    if not all(_whole(t) for t in ids):
        raise InvalidTypeError(f"stop_ids must be ints, got {sorted(map(repr, ids))[:4]}")
    object.__setattr__(p, "stop_ids", ids)
    stop = (p.stop,) if isinstance(p.stop, str) else p.stop
    if isinstance(stop, bytes) or not isinstance(stop, Iterable):
        raise InvalidTypeError(f"stop must be a str or a tuple of str, got {p.stop!r:.80}")
    stop = tuple(stop)
    if not all(isinstance(x, str) for x in stop):
        raise InvalidTypeError(f"stop strings must be str, got {stop!r:.80}")
    object.__setattr__(p, "stop", stop)


class Sampler:
    """Picks a request's next tokens from its logits (one generator per request)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._gen: torch.Generator | None = None
        if params.seed is not None:
            self._gen = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token of logits ``[vocab]``."""
        p = self.params
        if p.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < p.top_p  # always keeps the first
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self._gen))


class StopText:
    """Incremental text of generated ids, cut at the first stop string.

    :meth:`push` returns the text that is safe to emit now: a tail that could be the start of a
    stop string is held back until the next tokens decide it.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self._decode = decode
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False
        self.text = ""

    def push(self, token: int) -> str:
        """Add a token; returns the new text to emit (sets ``stopped`` at a stop string)."""
        self.ids.append(token)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        self.text = text
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            return self._emit(cut)
        return self._emit(max(self.emitted, len(text) - self._hold))

    def flush(self) -> str:
        """The held-back text, at the end of generation."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out
