"""The ``"tierkv"`` attention function of transformers, for sparse and host-side attention.

A transformers attention layer calls ``cache.update(k, v, layer)`` and then the attention
function of ``config._attn_implementation`` with the query. A :class:`TieredCache` with
``sparse_topk`` or ``host_attention`` only appends in ``update`` and leaves the layer pending
here; the ``"tierkv"`` function then takes the pending layer and asks the cache's
:class:`~tierkv.attention.sparse.SparseLayers` for its attention with the query in hand
(pages chosen by the query, some attended on the host, parts merged exactly). Without a
pending layer (another cache, no cache) it is transformers' SDPA attention::

    from tierkv.attention.hf import route
    route(model)                      # registers "tierkv" and sets the model's attention to it
    cache = TieredCache(model.config, device_bytes=..., host_bytes=..., sparse_topk=24)

The pending layer lives in a context variable: the update and the attention of a layer run
one after the other in the model's thread.
"""

from __future__ import annotations

from typing import Any

import torch

from tierkv.attention.sparse import AttentionNotRoutedError, Pending, take_pending

__all__ = ["NAME", "AttentionNotRoutedError", "Pending", "register", "route", "tierkv_attention"]

NAME = "tierkv"
"""The attention implementation's name (``model.set_attn_implementation(NAME)``)."""


def tierkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[B, n, Hq, D]`` and no weights."""
    pending = take_pending(int(getattr(module, "layer_idx", -1)))
    if pending is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = pending.run(
        pending.layers.attend(pending.ids, pending.layer, query, attention_mask, scale)
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"tierkv"`` with transformers' attention and mask interfaces (the mask is
    SDPA's). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, tierkv_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def route(model: Any) -> None:
    """Register ``"tierkv"`` and make it ``model``'s attention."""
    register()
    model.set_attn_implementation(NAME)
