"""Top-k pages at decode in the serving engine: ``EngineConfig(sparse_topk=k)``.

The engine folds every request's new keys into its store's page summaries
(:class:`~tierkv.attention.summaries.KeySummaries`: per-channel min and max of K per page key
and KV head) and, for a request's decode row (one query token), attends only the first page,
the ``sparse_recent`` last and the ``k`` pages whose summaries bound the query's scores
highest (Quest's criterion, :func:`~tierkv.attention.summaries.page_scores`; ``sparse_mean_weight``
moves the score toward the page's mean key). Prompt chunks
attend every page, and so does a decode row whose pages those already cover: then the result
is the dense one exactly.

What it saves is attention work and the K/V read by it: the engine's step plan loads a layer's
pages before the layer's queries exist (:mod:`tierkv.step` prefetches ahead), so the pages
loaded per step are not cut here (``TieredCache(sparse_topk=...)`` chooses before it loads).
Pages a request took from the prefix cache carry the summaries their first writer left (keyed by
page key, they followed the publish's rename); pages the store never summarised (imported from
a peer) are *unknown* and always attended.
"""

from __future__ import annotations

import torch

from tierkv.attention.sparse import SparseCounters, SparseOptions
from tierkv.attention.summaries import page_scores, select_pages
from tierkv.serving.model import ServingModel
from tierkv.spec import KVSpec
from tierkv.store import KVStore

__all__ = ["ServingSparse"]


class ServingSparse:
    """The engine's page summaries and decode-time page choice (module docstring).

    Args:
        store: the engine's store (its page summaries and sequences).
        spec: the engine's page layout.
        topk: pages chosen by score besides the first and the recent ones.
        recent: the last pages always attended.
        max_pages: the most pages a request's layer can have: ``topk`` above it is an error.
        mean_weight: the weight of a page's mean key in its score (0: Quest's bound alone).

    Raises InvalidInputError for ``topk`` below 1 or above ``max_pages``, ``recent`` below 0,
    ``mean_weight`` outside ``[0, 1)``.
    """

    def __init__(
        self,
        store: KVStore,
        spec: KVSpec,
        topk: int,
        recent: int,
        max_pages: int,
        mean_weight: float = 0.0,
    ) -> None:
        self.options = SparseOptions(topk, recent, max_pages=max_pages, mean_weight=mean_weight)
        self.topk = topk
        self.page_tokens = spec.page_tokens
        self.scale = spec.head_dim**-0.5
        self._store = store
        self.summaries = store.summaries
        self.counters = SparseCounters()

    def append(self, rid: str, layer: int, k: torch.Tensor, start: int) -> None:
        """Fold in the request's keys ``k`` ``[Hkv, n, D]`` of tokens ``start...`` (appended to
        the store already)."""
        pages = self._store.sequence(rid).pages(layer)
        self.summaries.append(pages, k, start, self.page_tokens)

    def attend(
        self,
        model: ServingModel,
        layer: int,
        rid: str,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        past: int,
    ) -> torch.Tensor:
        """``model.attend`` of one request, over the chosen pages of a decode row (``q``
        ``[Hq, 1, D]``) or over every page (a prompt chunk); ``[n, Hq * D]``."""
        if q.shape[1] != 1:
            return model.attend(layer, q, k, v, past)
        t, total = self.page_tokens, k.shape[1]
        pages = -(-total // t)
        table = self.summaries.table(self._store.sequence(rid).pages(layer)[:pages])
        chosen = select_pages(
            page_scores(q[:, 0], table, self.scale, self.options.mean_weight),
            self.topk,
            self.options.sink,
            self.options.recent,
        )
        c = self.counters
        c.decode_attends += 1
        c.decode_pages += pages
        c.decode_chosen += len(chosen)
        if len(chosen) == pages:
            return model.attend(layer, q, k, v, past)
        idx = (torch.tensor(chosen).unsqueeze(1) * t + torch.arange(t)).flatten()
        idx = idx[idx < total].to(k.device)
        # one query after every key it reads: no mask, ``past`` only places the query
        return model.attend(
            layer, q, k.index_select(1, idx), v.index_select(1, idx), idx.numel() - 1
        )
