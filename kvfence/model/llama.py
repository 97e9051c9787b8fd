"""Llama-family forward pass (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Boundary: tensors in, tensors out. Weights come from a loader in Hugging Face layout; K/V are read and written only
through the paged cache (`PagedKV`) using the block tables and slot mapping in `AttentionMetadata`, which the model
runner builds from a `Plan`. All tokens of a step (prefill chunks and decodes of many requests) run as one flat
sequence of T tokens through the dense layers; only attention is per request.

Shapes: T = tokens in the step, D = hidden size, H = query heads, Hkv = KV heads, Dh = head dim,
P = pages in the pool, S = page size (tokens per page).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvfence.model.config import ModelConfig


@dataclass
class PrefillSeq:
    q_start: int  # offset of this request's new tokens in the flat step
    q_len: int
    start_pos: int  # tokens already cached before this step
    pages: Tensor  # [n_pages] int64, block table covering start_pos + q_len tokens


@dataclass
class AttentionMetadata:
    positions: Tensor  # [T] int64
    slot_mapping: Tensor  # [T] int64, flat slot (page * S + offset) where each new token's K/V goes
    prefills: list[PrefillSeq]  # requests with more than one new token, attended one by one
    decode_idx: Tensor | None  # [B] int64, flat index of each single-token request
    decode_pages: Tensor | None  # [B, max_pages] int64 block tables, padded with page 0
    decode_mask: Tensor | None  # [B, 1, 1, max_pages * S] bool, True where a position is inside the context
    sample_idx: Tensor  # [N] int64, flat index of the tokens whose logits we need


class PagedKV:
    """The KV pool's tensors: per layer, K and V for every slot of every page."""

    def __init__(
        self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str
    ) -> None:
        self.page_size = page_size
        # kv: [L, 2, P, S, Hkv, Dh]
        self.kv = torch.zeros(
            cfg.num_layers,
            2,
            num_pages,
            page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=dtype,
            device=device,
        )
        # zeros() may map memory lazily; touch it all now so the pool exists for real before serving starts
        # (fails at startup rather than mid-request if the memory is not there, and keeps step latency steady)
        self.kv.fill_(0)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        # k, v: [T, Hkv, Dh]; slots: [T]
        flat = self.kv[layer].view(2, -1, *self.kv.shape[-2:])
        flat[0, slots] = k
        flat[1, slots] = v

    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V: the payload of one transfer frame."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def read_page(self, page: int) -> bytes:
        """One page's K/V for all layers as bytes, layout [L, 2, S, Hkv, Dh] (independent of placement)."""
        return bytes(self.kv[:, :, page].contiguous().view(torch.uint8).cpu().numpy().tobytes())

    def write_page(self, page: int, payload: bytes) -> None:
        """Inverse of read_page: the receiving side of a transfer frame."""
        block = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv.dtype)
        self.kv[:, :, page] = block.view(self.kv[:, :, page].shape).to(self.kv.device)

    def gather(self, layer: int, pages: Tensor) -> tuple[Tensor, Tensor]:
        """K and V for the pages of a block table: pages [..., n] -> [..., n * S, Hkv, Dh]."""
        # index_select over [P, S*Hkv*Dh] rows copies whole pages; several times faster than advanced indexing
        num_pages = self.kv.shape[2]
        idx = pages.reshape(-1)
        k = self.kv[layer, 0].view(num_pages, -1).index_select(0, idx)
        v = self.kv[layer, 1].view(num_pages, -1).index_select(0, idx)
        shape = (*pages.shape[:-1], pages.shape[-1] * self.page_size, *self.kv.shape[-2:])
        return k.view(shape), v.view(shape)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class Rotary:
    """Rotary embedding in Hugging Face layout (rotate_half over the two halves of each head). A plain object,
    not a module, so that casting the model to bfloat16 leaves the float32 tables alone."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, device: str | torch.device = "cpu") -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)  # [max_pos, Dh/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().float().to(device)
        self.sin = emb.sin().float().to(device)

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        # x: [T, heads, Dh]
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x32 = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
        return (x32 * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d, dh = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_heads * dh, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * dh, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * dh, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * dh, d, bias=False)
        self.scale = dh**-0.5

    def forward(self, x: Tensor, meta: AttentionMetadata, cache: PagedKV, rotary: Rotary) -> Tensor:
        t = x.shape[0]
        q = rotary(self.q_proj(x).view(t, self.num_heads, self.head_dim), meta.positions)
        k = rotary(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), meta.positions)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cache.write(self.layer, meta.slot_mapping, k, v)
        out = torch.empty_like(q)  # [T, H, Dh]
        for seq in meta.prefills:
            out[seq.q_start : seq.q_start + seq.q_len] = self._prefill(q, seq, cache)
        if meta.decode_idx is not None:
            out[meta.decode_idx] = self._decode(q[meta.decode_idx], meta, cache)
        y: Tensor = self.o_proj(out.view(t, -1))
        return y

    def _prefill(self, q: Tensor, seq: PrefillSeq, cache: PagedKV) -> Tensor:
        ctx = seq.start_pos + seq.q_len
        k, v = cache.gather(self.layer, seq.pages)  # [n*S, Hkv, Dh]
        k, v = k[:ctx].transpose(0, 1).unsqueeze(0), v[:ctx].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, Dh]
        qs = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, Dh]
        if seq.start_pos == 0:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:  # causal with an offset: query i sees keys [0, start_pos + i]
            rows = torch.arange(seq.q_len, device=q.device).unsqueeze(1) + seq.start_pos
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)  # [q_len, H, Dh]

    def _decode(self, q: Tensor, meta: AttentionMetadata, cache: PagedKV) -> Tensor:
        assert meta.decode_pages is not None and meta.decode_mask is not None
        k, v = cache.gather(self.layer, meta.decode_pages)  # [B, n*S, Hkv, Dh]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, Dh]
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(2)  # [B, H, Dh]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, meta: AttentionMetadata, cache: PagedKV, rotary: Rotary) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, cache, rotary)
        y: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: Rotary | None = None  # built on the target device by from_weights

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, meta: AttentionMetadata, cache: PagedKV) -> Tensor:
        """token_ids [T] -> logits [N, V] for the N tokens in meta.sample_idx (only those pay for the head)."""
        assert self.rotary is not None
        x = self.model.embed_tokens(token_ids)  # [T, D]
        for layer in self.model.layers:
            x = layer(x, meta, cache, self.rotary)
        x = self.model.norm(x[meta.sample_idx])
        logits: Tensor = self.lm_head(x).float()
        return logits

    @classmethod
    def from_weights(
        cls, cfg: ModelConfig, weights: dict[str, Tensor], dtype: torch.dtype, device: str
    ) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = cls(cfg)
        model = model.to_empty(device=device)
        if cfg.tie_word_embeddings:  # to_empty gives every parameter its own storage: tie again
            model.lm_head.weight = model.model.embed_tokens.weight
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - set(weights)
        if missing:
            raise ValueError(f"weights missing for: {sorted(missing)[:5]}")
        model.load_state_dict({k: v for k, v in weights.items() if k in expected}, strict=False)
        model = model.to(dtype=dtype).eval()
        model.rotary = Rotary(cfg.head_dim, cfg.context_length, cfg.rope_theta, device)
        return model
