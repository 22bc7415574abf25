"""What the serving engine needs from a model: a Llama-style decoder cut at its attention.

The engine runs every layer for all the tokens of a step at once (rows of several sequences
concatenated); attention reads the K/V of every sequence from one gather per layer (the step's
padded rows, :meth:`tierkv.step_layer.LayerStep.kv_padded`): the sequences decoding one token
in one batched call, the others (prompt chunks) one call each over views of it::

    x = embed(tokens)                           [N, d]     N = new tokens of all sequences
    for layer:
        q, k, v = qkv(layer, x, positions)      q [Hq, N, D], k/v [Hkv, N, D] (rope applied)
        step.append(k, v); K, V = step.kv_padded()   one append, one gather [B, Hkv, S_max, D]
        att[decode rows] = attend_decode(layer, q of the one-token rows, K, V, mask)
        per other sequence s (rows a:b, past P):
            att[a:b] = attend(layer, q[:, a:b], K[s, :, :P + n], V[s, :, :P + n], P)
        x = finish(layer, x, att)               residual + output projection + MLP
    logits(x[last row of each sampled sequence])

and a tokenizer turns text and chat messages into ids and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from tierkv.spec import KVSpec

Mask = torch.Tensor | None
"""Which positions of padded K/V are real (``[B, S]``, True: real), or None: all are."""


class ServingModel(Protocol):
    """A decoder the engine can run layer by layer (see the module docstring)."""

    name: str
    num_layers: int
    vocab_size: int
    max_context: int

    def kv_spec(self, page_tokens: int) -> KVSpec:
        """The page layout of this model's K/V."""
        ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, d]`` of token ids ``[N]``."""
        ...

    def qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[Hq, N, D]`` and keys, values ``[Hkv, N, D]`` (in the KV dtype) of ``x``
        at ``positions`` ``[N]``, rotary embedding applied."""
        ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int
    ) -> torch.Tensor:
        """Causal attention of one sequence's ``n`` queries (positions ``past...``) over its K/V
        ``[Hkv, past + n, D]``; returns ``[n, Hq * D]``."""
        ...

    def attend_decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
    ) -> torch.Tensor:
        """Attention of ``B`` sequences' one query each (``q`` ``[B, Hq, D]``, the last
        position) over their K/V padded to one length ``[B, Hkv, S, D]``; ``mask`` ``[B, S]``
        (True: a real position) or None when none is padded. Returns ``[B, Hq * D]``."""
        ...

    def finish(self, layer: int, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """The rest of the layer: ``x + o_proj(att)``, then the MLP block; ``[N, d]``."""
        ...

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[M, vocab]`` (float32) of hidden states ``[M, d]``."""
        ...


class Tokenizer(Protocol):
    """Text <-> token ids for one model."""

    eos_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped)."""
        ...

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Ids of a chat (``[{"role": ..., "content": ...}]``), ready for the assistant's turn.

        Raises InvalidInputError (a ValueError) for a malformed message."""
        ...


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Grouped-query causal attention ``[n, Hq * D]`` of queries ``[Hq, n, D]`` at positions
    ``past...`` over K/V ``[Hkv, past + n, D]`` (any float dtype; computed in q's dtype).

    K/V are never repeated per query head. One query (decode) packs each K/V head's query heads
    as its rows (as transformers' ``pack_gqa``: several times faster on the cpu than SDPA's
    ``enable_gqa`` for one row); a prompt chunk runs SDPA with ``enable_gqa``, causal from
    position 0 as transformers runs a prompt, with an explicit mask after a cached prefix.
    """
    hq, n, d = q.shape
    hkv = k.shape[0]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if n == 1:
        out = F.scaled_dot_product_attention(q.reshape(hkv, hq // hkv, d), k, v)
        return out.reshape(1, hq * d)
    gqa = hq != hkv
    if past == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        pos = torch.arange(past, past + n, device=q.device)
        mask = torch.arange(past + n, device=q.device)[None, :] <= pos[:, None]  # [n, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return out.transpose(0, 1).reshape(n, hq * d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """Grouped-query attention ``[B, Hq * D]`` of one query per sequence (``q`` ``[B, Hq, D]``,
    each at its sequence's last position) over K/V ``[B, Hkv, S, D]`` padded to one length;
    ``mask`` ``[B, S]`` (True: a real position; None: none padded). Computed in q's dtype.

    Each K/V head's query heads are its rows (as :func:`causal_attention` packs one query), so
    one SDPA call serves the batch; padded positions get no weight. Against
    :func:`causal_attention` per sequence: within float rounding (the kernels sum in another
    order), 1e-6 at most in the tests."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)
    m = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), k, v, attn_mask=m)
    return out.reshape(b, hq * d)
