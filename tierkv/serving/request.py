"""A request's life in the engine: waiting, prefilling (in chunks), decoding, finished.

::

    submit -> WAITING --admitted (room on the device, a running slot)--> RUNNING
    RUNNING: prefill chunks until the prompt's KV is complete (the last chunk samples a token),
             then one decode token per step; ends at max_tokens, a stop id, or cancellation
    finished -> the store sequence is released between steps (full blocks stay cached)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tierkv.serving.sampling import Sampler, SamplingParams


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One generated token (``token`` is None on the final event of a request that ended
    without a new token), with ``finish_reason`` set on the last event: ``"length"``
    (max_tokens), ``"stop"`` (a stop id) or ``"abort"`` (the engine closed)."""

    token: int | None
    finish_reason: str | None = None
    cached_tokens: int = 0  # prompt tokens whose KV was reused from the cache


@dataclass(slots=True)
class Request:
    """The engine's record of one request (owned by the engine's loop)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue[TokenEvent | BaseException] = field(default_factory=asyncio.Queue)
    output: list[int] = field(default_factory=list)
    computed: int = 0  # prompt tokens whose KV is in the store (reused or prefilled)
    reused: int = 0  # prompt tokens whose KV came from the cache
    admitted: float | None = None
    first_token: float | None = None
    last_token: float = 0.0  # (perf_counter of its latest token)
    finished: str | None = None  # finish reason once done
    cancelled: bool = False
    in_store: bool = False
    salt: bytes | None = None  # the cache salt (checked): shares pages with its salt only
    tenant: str | None = None  # the store's tenant charged for its pages (and its quotas)

    @property
    def prefilling(self) -> bool:
        """The prompt's KV is not complete yet."""
        return self.computed < len(self.prompt)

    @property
    def total_len(self) -> int:
        """Tokens the request may hold KV for: prompt plus max_tokens."""
        return len(self.prompt) + self.params.max_tokens

    def next_input(self, budget: int) -> list[int]:
        """The tokens to run this step: a prefill chunk of at most ``budget`` or the last
        sampled token."""
        if self.prefilling:
            return self.prompt[self.computed : self.computed + budget]
        return self.output[-1:]
