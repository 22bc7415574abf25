"""A small Llama-style decoder with seeded random weights, reading K/V from store pages.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP; compute in fp32,
K/V stored in the store's dtype. Attention gets each layer's K/V from a provider (a store lease,
or anything with the same two methods), so the same code runs tiered and all-resident.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from tierkv.spec import KVSpec, parse_dtype


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo model."""

    vocab: int = 2048
    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 512
    seed: int = 0

    @property
    def head_dim(self) -> int:
        """Elements per head."""
        return self.dim // self.heads

    def kv_spec(self, dtype: str = "fp16", page_tokens: int = 16) -> KVSpec:
        """The page layout of this model's KV."""
        return KVSpec(self.layers, self.kv_heads, self.head_dim, parse_dtype(dtype), page_tokens)


class KVProvider(Protocol):
    """What attention needs from the KV store (a :class:`tierkv.lease.Lease` fits)."""

    async def append(self, seq_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V ``[H, n, D]`` of new tokens."""

    def kv(self, seq_id: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All K/V of the sequence in the layer, ``[H, S, D]``."""


LayerGate = Callable[[int], Awaitable[KVProvider]]


class TinyLlama:
    """The demo decoder. ``forward`` runs new tokens of one sequence and returns logits."""

    def __init__(
        self, cfg: ModelConfig, kv_dtype: torch.dtype = torch.float16, device: str = "cpu"
    ) -> None:
        self.cfg = cfg
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        g = torch.Generator().manual_seed(cfg.seed)
        d, hd = cfg.dim, cfg.head_dim

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

        self.embed = torch.randn(cfg.vocab, d, generator=g)
        self.wq = [w(d, cfg.heads * hd) for _ in range(cfg.layers)]
        self.wk = [w(d, cfg.kv_heads * hd) for _ in range(cfg.layers)]
        self.wv = [w(d, cfg.kv_heads * hd) for _ in range(cfg.layers)]
        self.wo = [w(cfg.heads * hd, d) for _ in range(cfg.layers)]
        self.w1 = [w(d, cfg.ffn) for _ in range(cfg.layers)]
        self.w3 = [w(d, cfg.ffn) for _ in range(cfg.layers)]
        self.w2 = [w(cfg.ffn, d) for _ in range(cfg.layers)]
        self.out = w(d, cfg.vocab)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self._inv_freq = inv
        if self.device.type != "cpu":  # weights are drawn on the cpu: same values everywhere
            for name in ("embed", "out", "_inv_freq"):
                setattr(self, name, getattr(self, name).to(self.device))
            for name in ("wq", "wk", "wv", "wo", "w1", "w3", "w2"):
                setattr(self, name, [t.to(self.device) for t in getattr(self, name)])

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        """RMS norm over the last dimension (no weight)."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotary position embedding of ``x`` ``[heads, n, hd]`` at positions ``pos`` ``[n]``."""
        ang = pos[:, None].float() * self._inv_freq[None, :]  # [n, hd/2]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    async def forward(
        self, seq_id: str, tokens: list[int], start: int, gate: LayerGate
    ) -> torch.Tensor:
        """Run ``tokens`` (at positions ``start...``) through every layer; logits of the last.

        ``gate(layer)`` returns the KV provider for that layer (and may wait for its pages).
        """
        cfg = self.cfg
        n = len(tokens)
        hd, h, kvh = cfg.head_dim, cfg.heads, cfg.kv_heads
        x = self.embed[torch.tensor(tokens, device=self.device)]  # [n, d]
        pos = torch.arange(start, start + n, device=self.device)
        mask = None
        if n > 1:
            keys = torch.arange(start + n, device=self.device)
            mask = keys[None, :] <= pos[:, None]  # [n, S]
        for layer in range(cfg.layers):
            kv = await gate(layer)
            hn = self.norm(x)
            q = (hn @ self.wq[layer]).view(n, h, hd).transpose(0, 1)
            k = (hn @ self.wk[layer]).view(n, kvh, hd).transpose(0, 1)
            v = (hn @ self.wv[layer]).view(n, kvh, hd).transpose(0, 1)
            q, k = self.rope(q, pos), self.rope(k, pos)
            await kv.append(seq_id, layer, k.to(self.kv_dtype), v.to(self.kv_dtype))
            k_all, v_all = kv.kv(seq_id, layer)
            rep = h // kvh
            k_all = k_all.float().repeat_interleave(rep, 0)
            v_all = v_all.float().repeat_interleave(rep, 0)
            att = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)
            x = x + att.transpose(0, 1).reshape(n, h * hd) @ self.wo[layer]
            hn = self.norm(x)
            x = x + (F.silu(hn @ self.w1[layer]) * (hn @ self.w3[layer])) @ self.w2[layer]
        return self.norm(x[-1]) @ self.out
