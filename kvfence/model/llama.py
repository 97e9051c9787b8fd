"""Llama-family forward pass (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Boundary: tensors in, tensors out. Weights come from a loader in Hugging Face layout; K/V are read and written only
through the paged cache (`PagedKV`) using the block tables and slot mapping in `AttentionMetadata`, which the model
runner builds from a `Plan`. All tokens of a step (prefill chunks and decodes of many requests) run as one flat
sequence of T tokens through the dense layers; only attention is per request.

Speed (docs/performance.md, "Serving benchmark"): on a CPU a decode step is mostly per-operator overhead, so the
layer is written to issue few operators. Q, K and V come from one fused projection, gate and up from another
(the loader's separate Hugging Face weights are concatenated in `from_weights`); the rotary tables are looked up
once per step and applied to Q and K together; K and V go into the cache in one indexed copy; a step of only
decodes attends over all block tables at once with one gather per layer; a first prefill chunk attends over its
freshly computed K/V instead of reading them back from its pages.

Shapes: T = tokens in the step, D = hidden size, H = query heads, Hkv = KV heads, Dh = head dim,
P = pages in the pool, S = page size (tokens per page).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
import xxhash
from torch import Tensor, nn

from kvfence.model import hugepages, kernels
from kvfence.model.config import ModelConfig
from kvfence.model.loader import QuantBlocks, QuantPanels

T = TypeVar("T")


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
    decode_lens: Tensor | None  # [B] int64, each decode row's context length (its current token included)
    sample_idx: Tensor  # [N] int64, flat index of the tokens whose logits we need


class StepTensors(NamedTuple):
    """Computed once per step from the metadata, shared by every layer."""

    cos: Tensor  # [T, 1, Dh] in the model's dtype; [T, Dh] float32 for the C++ kernels
    signed_sin: Tensor  # same shape as cos
    decode_hide: (
        Tensor | None
    )  # torch path: [B, 1, 1, max_pages * S] bool, True past each decode row's context


class PagedKV:
    """The KV pool's tensors: per layer, K and V for every slot of every page."""

    def __init__(
        self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str
    ) -> None:
        self.page_size = page_size
        # kv: [L, 2, P, S, Hkv, Dh]; on CPU on huge pages (a decode step reads it at scattered pages)
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        if torch.device(device).type == "cpu":
            self.kv = hugepages.empty(shape, dtype)
        else:
            self.kv = torch.empty(shape, dtype=dtype, device=device)
        # touch it all now so the pool exists for real before serving starts (fails at startup rather than
        # mid-request if the memory is not there, and keeps step latency steady)
        self.kv.fill_(0)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        # k, v: [T, Hkv, Dh]; slots: [T]
        flat = self.kv[layer].view(2, -1, *self.kv.shape[-2:])  # [2, P*S, Hkv, Dh]
        flat.index_copy_(1, slots, torch.stack((k, v)))

    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V: the payload of one transfer frame."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def read_page(self, page: int) -> bytes:
        """One page's K/V for all layers as bytes, layout [L, 2, S, Hkv, Dh] (independent of placement)."""
        return self._page_block(page).tobytes()

    def page_digest(self, page: int) -> int:
        """xxh3-64 of `read_page(page)`: the page's K/V for all layers, layout [L, 2, S, Hkv, Dh]."""
        return xxhash.xxh3_64_intdigest(self._page_block(page).data)

    def _page_block(self, page: int) -> np.ndarray:
        """The page as one contiguous uint8 array. On CPU the strided copy goes through numpy, single-threaded:
        torch's parallel copy of 60 small blocks costs ten times more on a busy machine (about 0.1 ms against
        1-8 ms for a 737 KB page here)."""
        if self.kv.device.type == "cpu":
            raw = self.kv.view(torch.uint8).numpy()  # [L, 2, P, S, Hkv, Dh * itemsize], a view
            return np.ascontiguousarray(raw[:, :, page])
        return self.kv[:, :, page].contiguous().view(torch.uint8).cpu().numpy()

    def write_page(self, page: int, payload: bytes) -> None:
        """Inverse of read_page: the receiving side of a transfer frame."""
        if self.kv.device.type == "cpu":
            raw = self.kv.view(torch.uint8).numpy()
            raw[:, :, page] = np.frombuffer(payload, dtype=np.uint8).reshape(raw[:, :, page].shape)
            return
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

    def gather_kv(self, layer: int, pages: Tensor) -> Tensor:
        """K and V together in one copy: pages [B, n] -> [2, B, n * S, Hkv, Dh]."""
        num_pages = self.kv.shape[2]
        kv = self.kv[layer].view(2, num_pages, -1).index_select(1, pages.reshape(-1))
        return kv.view(2, *pages.shape[:-1], pages.shape[-1] * self.page_size, *self.kv.shape[-2:])


class Linear(nn.Linear):
    """nn.Linear without random initialization: every weight comes from the checkpoint, and the model is built on
    the meta device. There, random init runs torch's Python reference kernels, whose first call imports
    torch._dynamo, sympy and some 900 other modules: 40 MiB that stayed resident in every server process."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """nn.Embedding without random initialization (see `Linear`)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # one fused kernel; for bfloat16 it accumulates in float32 and rounds once, as HF's upcast does
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rotary:
    """Rotary embedding in Hugging Face layout (rotate_half over the two halves of each head). A plain object,
    not a module, so that casting the model to bfloat16 leaves the float32 tables alone."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, device: str | torch.device = "cpu") -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)  # [max_pos, Dh/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().float().to(device)
        self.sin = emb.sin().float().to(device)
        half = head_dim // 2
        # rotate_half's sign folded into sin: x * cos + cat(x2, x1) * signed_sin == x * cos + rotate_half(x) * sin
        self.signed_sin = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin for a step's positions, [T, 1, Dh] in `dtype` (as HF casts them): once per step."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.signed_sin[positions].unsqueeze(1).to(dtype),
        )

    @staticmethod
    def apply(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        # x: [T, heads, Dh]; cos, signed_sin: [T, 1, Dh]
        half = x.shape[-1] // 2
        swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return torch.addcmul(x * cos, swapped, signed_sin)

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        # x: [T, heads, Dh]
        return self.apply(x, *self.tables(positions, x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d, dh = cfg.hidden_size, cfg.head_dim
        # q, k and v projections in one: rows [q | k | v] (from_weights concatenates HF's three)
        self.qkv_proj = Linear(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * dh, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * dh, d, bias=False)
        self.scale = dh**-0.5
        self.kernels: ModuleType | None = None  # C++ kernels (kvfence/model/kernels), set at load

    def forward(self, x: Tensor, meta: AttentionMetadata, cache: PagedKV, step: StepTensors) -> Tensor:
        t, h, hkv, dh = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) * Dh]
        if self.kernels is not None:  # rotary in place on the Q and K heads of the fused projection
            heads = qkv.view(t, h + 2 * hkv, dh)
            self.kernels.rotary_(heads, h + hkv, step.cos, step.signed_sin)
            q, k, v = heads[:, :h], heads[:, h : h + hkv], heads[:, h + hkv :]
        else:
            qk = Rotary.apply(
                qkv[:, : (h + hkv) * dh].view(t, h + hkv, dh), step.cos, step.signed_sin
            )  # [T, H + Hkv, Dh]
            q, k = qk[:, :h], qk[:, h:]
            v = qkv[:, (h + hkv) * dh :].view(t, hkv, dh)
        if self.kernels is not None:
            self.kernels.write_kv(cache.kv[self.layer], meta.slot_mapping, k, v)
        else:
            cache.write(self.layer, meta.slot_mapping, k, v)
        if not meta.prefills and meta.decode_idx is not None and meta.decode_idx.numel() == t:
            out = self._decode(q, meta, cache, step)  # every token is a decode, in row order: no scatter
        else:
            out = torch.empty_like(q)  # [T, H, Dh]
            for seq in meta.prefills:
                self._prefill(q, k, v, seq, cache, out[seq.q_start : seq.q_start + seq.q_len])
            if meta.decode_idx is not None:
                out[meta.decode_idx] = self._decode(q[meta.decode_idx], meta, cache, step)
        y: Tensor = self.o_proj(out.reshape(t, -1))
        return y

    def _prefill(
        self, q: Tensor, k_new: Tensor, v_new: Tensor, seq: PrefillSeq, cache: PagedKV, out: Tensor
    ) -> None:
        """Attention of one prefill chunk, written into `out` ([q_len, H, Dh], the chunk's rows of the step's)."""
        ctx, span = seq.start_pos + seq.q_len, slice(seq.q_start, seq.q_start + seq.q_len)
        if self.kernels is not None:
            # query i sees keys [0, start_pos + i]: the chunk's own K/V, or every page read back
            if seq.start_pos == 0:
                k, v = k_new[span], v_new[span]
            else:
                k, v = (t[:ctx] for t in cache.gather(self.layer, seq.pages))
            self.kernels.prefill_attention(out, q[span], k, v, self.scale)
            return
        qs = q[span].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, Dh]
        if seq.start_pos == 0:  # a first chunk attends only to itself: its K/V as computed, no read-back
            k, v = k_new[span].transpose(0, 1).unsqueeze(0), v_new[span].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
            out.copy_(o[0].transpose(0, 1))
            return
        k, v = cache.gather(self.layer, seq.pages)  # [n*S, Hkv, Dh]
        k, v = k[:ctx].transpose(0, 1).unsqueeze(0), v[:ctx].transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, Dh]
        # causal with an offset: query i sees keys [0, start_pos + i]
        rows = torch.arange(seq.q_len, device=q.device).unsqueeze(1) + seq.start_pos
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        out.copy_(o[0].transpose(0, 1))

    def _decode(self, q: Tensor, meta: AttentionMetadata, cache: PagedKV, step: StepTensors) -> Tensor:
        """One query token per row over its whole block table, all rows at once. With the C++ kernel, read in
        place from the pages; otherwise plain matmuls rather than scaled_dot_product_attention (for one query
        token in bfloat16 the CPU kernel is ten times slower)."""
        assert meta.decode_pages is not None and meta.decode_lens is not None
        b, h, hkv, dh = q.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.kernels is not None:
            out = torch.empty(b, h, dh, dtype=q.dtype, device=q.device)
            self.kernels.paged_decode_attention(
                out, q, cache.kv[self.layer], meta.decode_pages, meta.decode_lens, self.scale
            )
            return out
        assert step.decode_hide is not None
        # one copy into head-major order, so that both matmuls below run on views (no hidden copies)
        kv = cache.gather_kv(self.layer, meta.decode_pages).transpose(2, 3).contiguous()  # [2, B, Hkv, N, Dh]
        qg = q.view(b, hkv, h // hkv, dh)  # [B, Hkv, G, Dh]: the G query heads that share each KV head
        scores = torch.matmul(qg, kv[0].transpose(2, 3))  # [B, Hkv, G, N]
        scores = scores.masked_fill(step.decode_hide, float("-inf")) * self.scale
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, kv[1]).view(b, h, dh)  # [B, H, Dh]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up projections in one: rows [gate | up] (from_weights concatenates HF's two)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.kernels: ModuleType | None = None  # C++ kernels (kvfence/model/kernels), set at load

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 I]: [gate | up]
        if self.kernels is not None:
            y: Tensor = self.down_proj(self.kernels.silu_mul(gate_up))
            return y
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
        y = self.down_proj(F.silu(gate) * up)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, meta: AttentionMetadata, cache: PagedKV, step: StepTensors) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, cache, step)
        y: Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y

    def forward_fused(
        self, ops: ModuleType, x: Tensor, delta: Tensor | None, meta: AttentionMetadata, cache: PagedKV,
        step: StepTensors,
    ) -> Tensor:  # fmt: skip
        """The same layer with the C++ kernels: the residual stream `x` is updated in place, each add fused with
        the norm that follows it. `delta` is the previous layer's MLP output, not yet added; returns this one's."""
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        if delta is None:
            h = ops.rms_norm(x, norm_in.weight, norm_in.eps)
        else:
            h = ops.add_rms_norm_(x, delta, norm_in.weight, norm_in.eps)
        h = ops.add_rms_norm_(x, self.self_attn(h, meta, cache, step), norm_post.weight, norm_post.eps)
        y: Tensor = self.mlp(h)
        return y


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head: Linear | OutputHead = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: Rotary | None = None  # built on the target device by from_weights
        self.kernels: ModuleType | None = None  # C++ kernels (kvfence/model/kernels), set at load

    @torch.inference_mode()
    def forward(self, token_ids: Tensor, meta: AttentionMetadata, cache: PagedKV) -> Tensor:
        """token_ids [T] -> logits [N, V] for the N tokens in meta.sample_idx (only those pay for the head)."""
        assert self.rotary is not None
        x = self.model.embed_tokens(token_ids)  # [T, D]
        if self.kernels is not None:  # the decode kernel stops at each row's length: no mask
            step = StepTensors(self.rotary.cos[meta.positions], self.rotary.signed_sin[meta.positions], None)
            delta = None
            for layer in self.model.layers:
                assert isinstance(layer, DecoderLayer)
                delta = layer.forward_fused(self.kernels, x, delta, meta, cache, step)
            assert delta is not None
            x = self.kernels.add_rms_norm_(x, delta, self.model.norm.weight, self.model.norm.eps)
            if meta.sample_idx.numel() != x.shape[0]:
                x = x[meta.sample_idx]
            return self.lm_head(x)  # type: ignore[no-any-return]
        hide = None
        if meta.decode_pages is not None and meta.decode_lens is not None:  # padding and beyond: masked
            slots = torch.arange(meta.decode_pages.shape[1] * cache.page_size, device=x.device)
            hide = (slots.unsqueeze(0) >= meta.decode_lens.unsqueeze(1))[:, None, None]
        step = StepTensors(*self.rotary.tables(meta.positions, x.dtype), hide)
        for layer in self.model.layers:
            x = layer(x, meta, cache, step)
        if meta.sample_idx.numel() != x.shape[0]:  # only the tokens we sample pay for the norm and the head
            x = x[meta.sample_idx]
        x = self.model.norm(x)
        return self.lm_head(x)  # type: ignore[no-any-return]

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        weights: dict[str, Tensor],
        dtype: torch.dtype,
        device: str,
        quantized: Mapping[str, QuantBlocks] | None = None,
    ) -> LlamaForCausalLM:
        """`quantized`: the loader's Q4_1/Q8_0 blocks of some linear weights; with the C++ kernels, a step of
        few rows multiplies by those blocks instead of the bfloat16 weights (`PackedLinear`)."""
        with torch.device("meta"):
            model = cls(cfg)
        weights = fuse_projections(weights, cfg.num_layers)
        expected = {n for n, _ in model.named_parameters()}
        missing = expected - set(weights)
        if missing:
            raise ValueError(f"weights missing for: {sorted(missing)[:5]}")
        # The loader's tensors become the parameters, converted to the target dtype and device where they differ
        # (`to_empty` and a copy would run torch's Python reference kernels on the meta tensors, which import
        # sympy and hundreds of modules: see `Linear`). The loader's tensors own their memory (`load_model`).
        target = torch.device(device)
        model.load_state_dict(
            {k: v.to(device=target, dtype=dtype) for k, v in weights.items() if k in expected},
            strict=False,
            assign=True,
        )
        if cfg.tie_word_embeddings:  # assigning replaced the shared parameter in one place: tie again
            model.lm_head.weight = model.model.embed_tokens.weight
        assert isinstance(model.lm_head, Linear)
        model.lm_head = OutputHead(model.lm_head)  # float32 logits on every path
        model = model.eval()
        if any(t.is_meta for t in model.state_dict().values()):
            raise RuntimeError("a parameter was left on the meta device")
        model.rotary = Rotary(cfg.head_dim, cfg.context_length, cfg.rope_theta, device)
        if PackedLinear.supported(dtype, device):
            pack_linears(model)
        if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and kernels.supports(cfg.head_dim):
            ops = kernels.ops()  # None when switched off or not buildable: the torch path then
            for module in model.modules():
                if isinstance(module, (LlamaForCausalLM, Attention, MLP, OutputHead)):
                    module.kernels = ops
            if ops is not None and quantized and kernels.quant_enabled():
                attach_quantized(model, fuse_quantized(quantized, cfg), ops)
        return model


# Rows up to which `panel_linear` quantizes activations in two int8 levels, finer than bfloat16: a step of so few
# rows is bound by reading the weights, so the second level's multiplies are about free. Longer steps take oneDNN
# on the bfloat16 weights, or with `KVFENCE_INT8=all` one int8 level (llama.cpp's precision, faster, coarser).
FINE_MAX_ROWS = 8


class PackedLinear(nn.Module):
    """A bfloat16 CPU linear layer whose weight oneDNN reordered once, at load, into its blocked layout. Same
    results as `F.linear` (bit for bit in our tests), which reorders the weight on every call: 1.7-1.9x faster
    for the few rows of a decode step, the same for a long prefill (docs/performance.md).

    When the GGUF stored this weight as Q4_1 or Q8_0 blocks and the C++ kernels run, steps of few rows multiply
    by those blocks instead (`attach_quantized`), reading a third of the bytes (Q4_1). By default `panels` holds
    them repacked for `panel_linear`, which quantizes the activations to int8 per block of 32 (AVX512-VNNI and
    BF16): two levels up to `FINE_MAX_ROWS` rows; with `KVFENCE_INT8=all` one level for longer steps too, and the
    bfloat16 weight is dropped. With `KVFENCE_INT8=0`, `quant` holds them as the GGUF stores them and steps of
    at most `QUANT_MAX_ROWS` rows multiply by them with bfloat16 activations. (The output head is an
    `OutputHead`: float32 logits.)"""

    packed_weight: Tensor  # empty once every step takes the panels
    quant: QuantBlocks | None = None
    panels: QuantPanels | None = None
    panel_max_rows = FINE_MAX_ROWS  # steps of more rows take the bfloat16 weight ...
    fine_max_rows = FINE_MAX_ROWS  # ... and steps of more rows than this one int8 level
    kernels: ModuleType | None = None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), DECODE_ROWS_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.out_features, self.in_features = linear.weight.shape
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @staticmethod
    def supported(dtype: torch.dtype, device: str) -> bool:
        return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and onednn_bf16_packing()

    def forward(self, x: Tensor) -> Tensor:
        p = self.panels
        if p is not None and self.kernels is not None:
            rows = x.reshape(-1, self.in_features)
            if rows.shape[0] <= self.panel_max_rows:
                levels = 2 if rows.shape[0] <= self.fine_max_rows else 1
                out: Tensor = self.kernels.panel_linear(rows, p.wp, p.d, p.m, p.kind_id, p.n, levels)
                return out.view(*x.shape[:-1], p.n)
        q = self.quant
        if (
            q is not None
            and self.kernels is not None
            and x.dim() == 2
            and x.shape[0] <= QUANT_MAX_ROWS[q.kind]
        ):
            y: Tensor = self.kernels.quant_linear(x, q.qs, q.d, q.m, q.kind_id)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return y


@functools.cache
def onednn_bf16_packing() -> bool:
    """Whether oneDNN reorders bfloat16 weights here: it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, and refuses
    otherwise, also when `ONEDNN_MAX_CPU_ISA` caps it below them. Without it the linear layers stay plain
    `nn.Linear` (torch's own bfloat16 matmul, slower) and do not take the GGUF's blocks."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):  # type: ignore[no-untyped-call]
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), DECODE_ROWS_HINT)
    except RuntimeError:
        return False
    return True


DECODE_ROWS_HINT = 8  # oneDNN picks the packed layout for this many rows; any row count works
# rows up to which the quantized-block kernels beat oneDNN on bfloat16 weights (docs/performance.md)
QUANT_MAX_ROWS = {"Q4_1": 6, "Q8_0": 2}


class OutputHead(nn.Module):
    """The output head: hidden states [N, D] -> float32 logits [N, V], in every dtype and on every path.

    Logits are never rounded to bfloat16 (issue 20, docs/quality.md): at a logit of 25 one bfloat16 step is 0.125,
    so two tokens 0.08 apart in float32 became an exact tie, greedy took the lower token id, and the same prompt
    answered differently on two CPUs. The sums of every path below stay float32:
      - `panels` (the GGUF's Q4_1/Q8_0 blocks, with AVX512-VNNI): `panel_linear_f32`, int8 activations in two
        levels up to FINE_MAX_ROWS rows and one beyond, for every step; the bfloat16 weight is then dropped;
      - the C++ kernels otherwise: `linear_f32` on the bfloat16 weight (exact products, float32 sums);
      - the torch path: float32 matmuls over slices of the bfloat16 weight, upcast one slice at a time.
    A tied head holds the embedding's tensor itself: no second copy."""

    panels: QuantPanels | None = None
    fine_max_rows = FINE_MAX_ROWS
    kernels: ModuleType | None = None
    SLICE_ROWS = 1024  # vocabulary rows upcast at a time on the torch path (2.3 MB of float32 at D = 576)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.out_features, self.in_features = linear.weight.shape

    def drop_weight(self) -> None:
        """Every step takes the panels: the bfloat16 weight goes (a tied embedding keeps its own reference)."""
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)
        p, ops = self.panels, self.kernels
        if p is not None and ops is not None:
            levels = 2 if rows.shape[0] <= self.fine_max_rows else 1
            out: Tensor = ops.panel_linear_f32(rows, p.wp, p.d, p.m, p.kind_id, p.n, levels)
        elif ops is not None and self.in_features % 32 == 0:
            out = ops.linear_f32(rows, self.weight)
        else:
            out = float32_linear(rows, self.weight, self.SLICE_ROWS)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.view(*x.shape[:-1], self.out_features)


def float32_linear(x: Tensor, weight: Tensor, slice_rows: int) -> Tensor:
    """x @ weight^T in float32 whatever their dtype. A lower-precision weight is upcast `slice_rows` output rows at a
    time (never a float32 copy of the whole matrix, which is 2 GB for a head of 128k x 4096)."""
    xf = x.float()
    if weight.dtype == torch.float32:
        return F.linear(xf, weight)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, weight.shape[0], slice_rows):
        part = weight.detach()[start : start + slice_rows]
        torch.matmul(xf, part.float().t(), out=out[:, start : start + part.shape[0]])
    return out


def fuse_quantized(quantized: Mapping[str, QuantBlocks], cfg: ModelConfig) -> dict[str, QuantBlocks]:
    """The blocks under this model's parameter names: q/k/v and gate/up concatenated like `fuse_projections`
    (a group whose parts differ in kind is dropped, and those layers keep the bfloat16 weights); a tied head
    takes the embedding's blocks."""
    fused = _fuse(quantized, cfg.num_layers, QuantBlocks.cat)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in fused:
        fused["lm_head.weight"] = fused["model.embed_tokens.weight"]
    return fused


def attach_quantized(model: nn.Module, quantized: Mapping[str, QuantBlocks], ops: ModuleType) -> None:
    """Give each bias-free PackedLinear its weight's blocks, when they have its shape: as panels for int8
    activations (the default where the CPU has AVX512-VNNI and AVX512-BF16; the output head, which sees one row
    per sequence, takes them for every step and drops its bfloat16 copy, as every layer does with
    `KVFENCE_INT8=all`), or as the GGUF lays them out for bfloat16 activations (`KVFENCE_INT8=0`, or a CPU
    without those instructions; the output head then keeps its bfloat16 weight for `linear_f32`). Every decode
    step streams all of them, so they move into one buffer on huge pages (`hugepages.pack`)."""
    takers: list[tuple[PackedLinear | OutputHead, QuantBlocks]] = []
    panels = kernels.int8_enabled() and ops.panel_vnni()
    for name, module in model.named_modules():
        blocks = quantized.get(name + ".weight")
        if (
            (isinstance(module, PackedLinear) or (panels and isinstance(module, OutputHead)))
            and blocks is not None
            and module.bias is None
            and blocks.shape == (module.out_features, module.in_features)
        ):
            takers.append((module, blocks))
    if panels:
        # one layer repacked at a time, straight into its place: the panels of all layers never exist twice
        placed = iter(hugepages.slots([spec for _, blocks in takers for spec in blocks.panel_shapes()]))
        for module, blocks in takers:
            p = blocks.panels()
            wp, d, m = next(placed), next(placed), next(placed)
            wp.copy_(p.wp)
            d.copy_(p.d)
            m.copy_(p.m)
            module.panels = QuantPanels(p.kind, p.n, wp, d, m)
            module.kernels = ops
            # The head sees only sampled rows (one per sequence): every step takes its panels, in one level beyond
            # FINE_MAX_ROWS, where two levels are slower than oneDNN was (docs/performance.md, session 10).
            if isinstance(module, OutputHead):
                module.drop_weight()
            elif kernels.int8_prefill():  # the bfloat16 weight goes
                module.panel_max_rows = sys.maxsize
                module.packed_weight = torch.empty(0, dtype=module.packed_weight.dtype)
        return
    placed = iter(hugepages.pack([t for _, b in takers for t in (b.qs, b.d, b.m)]))
    for module, blocks in takers:
        assert isinstance(module, PackedLinear)  # the head takes blocks only as panels
        module.quant = QuantBlocks(blocks.kind, next(placed), next(placed), next(placed))
        module.kernels = ops


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear by a PackedLinear (the output head is an `OutputHead`, whose logits stay float32)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))


FUSED = (  # fused parameter <- the Hugging Face parameters it concatenates, in row order
    (
        "self_attn.qkv_proj.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    ("self_attn.qkv_proj.bias", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    ("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
)


def fuse_projections(weights: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """A copy of `weights` (HF names) where each layer's q/k/v and gate/up projections are concatenated into the
    fused parameters this model uses. A group that is absent (no attention bias) is skipped; a partial group is
    left alone so that the missing-weights check names what is missing."""
    return _fuse(weights, num_layers, torch.cat)


def _fuse(items: Mapping[str, T], num_layers: int, cat: Callable[[list[T]], T | None]) -> dict[str, T]:
    """Each layer's complete FUSED groups concatenated by `cat` in row order (None from `cat`: dropped)."""
    fused = dict(items)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for target, parts in FUSED:
            names = [prefix + p for p in parts]
            if all(n in fused for n in names):
                joined = cat([fused.pop(n) for n in names])
                if joined is not None:
                    fused[prefix + target] = joined
    return fused
