"""Sampling parameters, the choice of the next token, and stop strings on the decoded text."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tierkv.errors import InvalidInputError


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
