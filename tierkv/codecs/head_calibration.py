"""Measure a model's :class:`~tierkv.codecs.head_sparse.HeadRanking` on calibration text.

For every layer, a forward hook on its attention module reads the attention weights
(transformers' eager attention returns them) and keeps, per KV head, the mean over query
positions ``i >= window`` of the attention placed on keys ``sink <= j < i - window`` (query
heads sharing a KV head averaged; the first ``sink`` tokens, where every head parks attention
it has no use for, do not count as reaching back). The weights are reduced layer by layer
and never kept.
"""

from __future__ import annotations

from typing import Any

import torch

from tierkv import validate
from tierkv.codecs.head_sparse import CalibrationError, HeadRanking

__all__ = ["calibrate", "far_share"]


def far_share(weights: torch.Tensor, window: int, kv_heads: int, sink: int = 4) -> torch.Tensor:
    """``[kv_heads]`` share of attention beyond ``window`` tokens (and after the first
    ``sink``), from ``weights``
    ``[B, Hq, S, S]`` (rows sum to one). Raises CalibrationError when ``S <= window`` or the
    heads do not group."""
    _, hq, s, s2 = weights.shape
    if s != s2 or s <= window or hq % kv_heads:
        raise CalibrationError(
            f"attention {list(weights.shape)}: need square rows longer than the window "
            f"({window}) and query heads in groups of {kv_heads} KV heads"
        )
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    far = ((j < i - window) & (j >= sink)).to(weights.dtype)  # [S, S]
    per_query = (weights.float() * far).sum(dim=-1)[:, :, window:]  # [B, Hq, S - window]
    return per_query.mean(dim=(0, 2)).view(kv_heads, hq // kv_heads).mean(dim=1).clamp(0.0, 1.0)


def calibrate(
    model: Any,
    input_ids: torch.Tensor,
    window: int = 64,
    source: str = "",
    sink: int = 4,
    restore: str = "sdpa",
) -> HeadRanking:
    """Run ``model`` once on ``input_ids`` ``[B, S]`` (``S > window``) with eager attention and
    rank its KV heads (module docstring); the model's attention is ``restore`` afterwards.

    Raises CalibrationError for too short an input or a model whose attention modules are not
    found (a Llama-family decoder has ``model.model.layers[i].self_attn``)."""
    window = validate.count("window", window, 1)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:  # (a list: AttributeError)
        raise CalibrationError(f"calibration needs [B, S > {window}] token ids as a tensor")
    if input_ids.shape[1] <= window:
        raise CalibrationError(f"calibration needs [B, S > {window}] token ids")
    try:
        text = model.config.get_text_config(decoder=True)
    except AttributeError as exc:  # (not a transformers model: an AttributeError from inside)
        raise CalibrationError(f"not a transformers decoder (no config): {exc}") from exc
    kv_heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    try:
        attns = [layer.self_attn for layer in model.model.layers]
    except AttributeError as exc:
        raise CalibrationError(f"no attention modules found: {exc}") from exc
    shares: list[torch.Tensor | None] = [None] * len(attns)

    def hook(index: int) -> Any:
        def keep(_module: Any, _args: Any, out: Any) -> None:
            shares[index] = far_share(out[1], window, kv_heads, sink)

        return keep

    handles = [a.register_forward_hook(hook(i)) for i, a in enumerate(attns)]
    try:
        model.set_attn_implementation("eager")
        with torch.inference_mode():
            model(input_ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(restore)
    rows = []
    for i, got in enumerate(shares):
        if got is None:
            raise CalibrationError(f"layer {i}'s attention weights were not returned")
        rows.append(tuple(float(x) for x in got))
    return HeadRanking(tuple(rows), window, source)
