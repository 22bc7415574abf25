"""The tiny implementation: the demo's seeded random decoder and a one-id-per-character tokenizer.

Fast enough for tests on two cpu cores; its text is noise, its tokens are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tierkv.demo.model import ModelConfig, TinyLlama
from tierkv.errors import InvalidInputError
from tierkv.serving.model import Mask, causal_attention, decode_attention
from tierkv.spec import KVSpec, parse_dtype


class TinyModel:
    """:class:`~tierkv.serving.model.ServingModel` of :class:`tierkv.demo.model.TinyLlama`
    (computes in float32, K/V in ``kv_dtype``)."""

    def __init__(
        self, cfg: ModelConfig | None = None, kv_dtype: str = "fp16", max_context: int = 4096
    ) -> None:
        self.cfg = cfg or ModelConfig()
        self.kv_dtype = parse_dtype(kv_dtype)
        self.net = TinyLlama(self.cfg, self.kv_dtype)
        self.name = "tiny"
        self.num_layers = self.cfg.layers
        self.vocab_size = self.cfg.vocab
        self.max_context = max_context

    def kv_spec(self, page_tokens: int) -> KVSpec:
        """The page layout of the K/V."""
        c = self.cfg
        return KVSpec(c.layers, c.kv_heads, c.head_dim, self.kv_dtype, page_tokens)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[N, d]``."""
        return self.net.embed[tokens]

    def qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[H, N, D]``, keys and values ``[Hkv, N, D]``."""
        net, c = self.net, self.cfg
        n, hd = x.shape[0], c.head_dim
        hn = net.norm(x)
        q = (hn @ net.wq[layer]).view(n, c.heads, hd).transpose(0, 1)
        k = (hn @ net.wk[layer]).view(n, c.kv_heads, hd).transpose(0, 1)
        v = (hn @ net.wv[layer]).view(n, c.kv_heads, hd).transpose(0, 1)
        q, k = net.rope(q, positions), net.rope(k, positions)
        return q, k.to(self.kv_dtype), v.to(self.kv_dtype)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int
    ) -> torch.Tensor:
        """Causal attention ``[n, H * D]`` over the sequence's K/V."""
        return causal_attention(q, k, v, past)

    def attend_decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
    ) -> torch.Tensor:
        """One query per sequence over padded K/V, batched (:func:`decode_attention`)."""
        return decode_attention(q, k, v, mask)

    def finish(self, layer: int, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and the SwiGLU MLP."""
        net = self.net
        x = x + att @ net.wo[layer]
        hn = net.norm(x)
        return x + (F.silu(hn @ net.w1[layer]) * (hn @ net.w3[layer])) @ net.w2[layer]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, vocab]``."""
        return self.net.norm(x) @ self.net.out


class CharTokenizer:
    """One id per character (``ord(c) % vocab``); no end-of-sequence id unless given."""

    def __init__(self, vocab: int, eos_ids: Sequence[int] = ()) -> None:
        self.vocab = vocab
        self.eos_ids = frozenset(eos_ids)

    def encode(self, text: str) -> list[int]:
        """One id per character."""
        return [ord(c) % self.vocab for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """A character per id (ids below 32 shown as ``?``)."""
        return "".join(chr(i) if i >= 32 else "?" for i in ids if i not in self.eos_ids)

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """``role: content`` lines, then ``assistant:``. Raises InvalidInputError (a ValueError)
        when malformed."""
        text = ""
        for m in messages:
            role, content = chat_message(m)
            text += f"{role}: {content}\n"
        return self.encode(text + "assistant:")


def chat_message(m: object) -> tuple[str, str]:
    """One chat message as ``(role, content)``; raises InvalidInputError (a ValueError) for
    anything else."""
    if not isinstance(m, dict):
        raise InvalidInputError("each message must be an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in ("system", "user", "assistant") or not isinstance(content, str):
        raise InvalidInputError(
            'a message needs role "system", "user" or "assistant" and string content'
        )
    return role, content
