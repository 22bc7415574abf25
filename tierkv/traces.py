"""Synthetic request traces with prefix structure, for checking eviction policies.

Each trace is a list of requests; a request is the list of its blocks' hash ids, in prefix
order, as in the Mooncake trace format (``hash_ids``): equal ids at the same position are the
same reusable block, and every request starts with block 0 (a shared system prompt). Ids are
chained by construction: a block id always has the same predecessor.

Kinds:

* ``"loop"``: 400 documents of 16 blocks (6,400 blocks) read in a fixed cycle, each with a fresh
  one-block question; LRU gets nothing once the cycle outgrows the cache.
* ``"zipf"``: 10,000 documents of 4-32 blocks picked by Zipf(1.0) popularity, each with a
  fresh one- to three-block question.
* ``"flood"``: 30 hot documents of 8 blocks asked about half of the time; the other half are
  one-shot prompts of 20-60 fresh blocks that flush a recency cache.
"""

from __future__ import annotations

import numpy as np

from tierkv.errors import InvalidInputError

KINDS = ("loop", "zipf", "flood")


class _Ids:
    """Hands out fresh block ids (0 is the shared root)."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _docs(ids: _Ids, lengths: np.ndarray) -> list[list[int]]:
    return [ids.take(int(n)) for n in lengths]


def synthetic_trace(kind: str, n_requests: int, seed: int = 0) -> list[list[int]]:
    """A synthetic trace of ``n_requests`` requests (see the module docstring for kinds).

    Raises:
        ValueError: unknown kind or negative ``n_requests``.
    """
    if kind not in KINDS:
        raise InvalidInputError(f"unknown trace kind {kind!r}; choose from {list(KINDS)}")
    if n_requests < 0:
        raise InvalidInputError(f"n_requests must be >= 0, got {n_requests}")
    rng = np.random.default_rng(seed)
    ids = _Ids()
    out: list[list[int]] = []
    if kind == "loop":
        docs = _docs(ids, np.full(400, 16))
        for i in range(n_requests):
            out.append([0, *docs[i % len(docs)], *ids.take(1)])
    elif kind == "zipf":
        docs = _docs(ids, rng.integers(4, 33, size=10_000))
        ranks = np.arange(1, len(docs) + 1, dtype=np.float64)
        p = 1.0 / ranks
        p /= p.sum()
        picks = rng.choice(len(docs), size=n_requests, p=p)
        tails = rng.integers(1, 4, size=n_requests)
        for d, t in zip(picks, tails):
            out.append([0, *docs[int(d)], *ids.take(int(t))])
    else:
        docs = _docs(ids, np.full(30, 8))
        for _ in range(n_requests):
            if rng.random() < 0.5:
                out.append([0, *docs[int(rng.integers(len(docs)))], *ids.take(1)])
            else:
                out.append([0, *ids.take(int(rng.integers(20, 61)))])
    return out
