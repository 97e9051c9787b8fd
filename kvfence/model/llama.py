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

Compute path: chosen once, when the model is built (`from_weights`), from its `KernelOptions`: the C++ kernels'
wrappers (`KernelOps`, kvfence/model/kernels) or plain torch, which compute the same thing; the choice is kept
as `model.backend` and each layer holds its `kernels` (None: torch). The linear layers and the float32 output
head are in kvfence/model/linears.py, the KV pool's tensors in kvfence/model/paged_kv.py.

Shapes: T = tokens in the step, D = hidden size, H = query heads, Hkv = KV heads, Dh = head dim,
P = pages in the pool, S = page size (tokens per page).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvfence.config import KernelOptions
from kvfence.engine.plan import StepInterrupted, Stop
from kvfence.model.config import ModelConfig
from kvfence.model.kernels import Backend, KernelOps
from kvfence.model.kernels import configure as configure_kernels
from kvfence.model.linears import (
    OutputHead,
    PackedLinear,
    attach_quantized,
    fuse_projections,
    fuse_quantized,
    pack_linears,
)
from kvfence.model.paged_kv import PagedKV
from kvfence.model.quant import QuantBlocks

if TYPE_CHECKING:
    from kvfence.model.loader import LoadedModel


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

    def __init__(
        self,
        head_dim: int,
        max_pos: int,
        theta: float,
        device: str | torch.device = "cpu",
        factors: tuple[float, ...] | None = None,  # RoPE scaling: each frequency divided by its factor
    ) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if factors is not None:
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
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


# Where oneDNN has AMX (`KernelOps.prefill_sdpa`), prefill chunks of at least this many queries and query x key
# scores take torch's `scaled_dot_product_attention` rather than the C++ kernel: from about 128 x 128 on it is
# faster there, 3x at 2,000 tokens, 1.6x for 32 queries over 2,000 keys; below, the kernel is, and for a few
# queries over many keys (a short last chunk, a prefix-cache hit) the kernel stays (docs/performance.md, session
# 18). Without AMX (AMD Zen4) the kernel is faster at every size, 1.6x for 256 queries over 1,792 keys and 3.2x
# at 2,000 tokens (session 22), and takes every chunk. With the AMX tile kernels on (`--amx-tiles`, the default
# where the CPU has AMX) every chunk takes `prefill_attention_tiles` instead, 1.6-2.4x torch's (session 27).
SDPA_MIN_QUERIES = 32
SDPA_MIN_SCORES = 128 * 128


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
        self.kernels: KernelOps | None = None  # the backend's C++ kernels, set at load
        self.tiles = False  # prefill chunks and decode rows on AMX tiles (`Backend.tiles`), set at load

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
        kernels = self.kernels
        if kernels is not None and (
            self.tiles
            or not kernels.prefill_sdpa
            or seq.q_len < SDPA_MIN_QUERIES
            or seq.q_len * ctx < SDPA_MIN_SCORES
        ):
            # query i sees keys [0, start_pos + i]: the chunk's own K/V, or every page read back
            if seq.start_pos == 0:
                k, v = k_new[span], v_new[span]
            else:
                k, v = (t[:ctx] for t in cache.gather(self.layer, seq.pages))
            if (
                self.tiles
            ):  # AMX: every chunk, 1.6-2.4x torch's flash attention (docs/performance.md, session 27)
                kernels.prefill_attention_tiles(out, q[span], k, v, self.scale)
            else:
                kernels.prefill_attention(out, q[span], k, v, self.scale)
            return
        # torch's flash attention: its matrix products go through oneDNN (AMX where the CPU has it)
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
                out, q, cache.kv[self.layer], meta.decode_pages, meta.decode_lens, self.scale, self.tiles
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


# Rows of a step's MLP computed at a time. Each row's result is its own (the same bits in our tests: oneDNN's sums
# over K do not depend on the row count here), but a slice's [rows, 2 I] activations stay in cache: oneDNN's
# gate/up product falls from ~3.9 to ~1.8 TFLOP/s past ~1,000 rows, and a 2,048-row MLP of the 0.5B model took
# 31-34 ms as one product, 19.8 ms in slices of 512 (docs/performance.md, session 19).
MLP_CHUNK_ROWS = 512


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # gate and up projections in one: rows [gate | up] (from_weights concatenates HF's two)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.kernels: KernelOps | None = None  # the backend's C++ kernels, set at load

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 2 and x.shape[0] > MLP_CHUNK_ROWS:  # a long prefill: a slice of rows at a time
            out = torch.empty(x.shape[0], self.down_proj.out_features, dtype=x.dtype, device=x.device)
            for start in range(0, x.shape[0], MLP_CHUNK_ROWS):
                out[start : start + MLP_CHUNK_ROWS] = self._rows(x[start : start + MLP_CHUNK_ROWS])
            return out
        return self._rows(x)

    def _rows(self, x: Tensor) -> Tensor:
        if self.kernels is not None and isinstance(self.gate_up_proj, PackedLinear):
            y: Tensor = self.down_proj(self.gate_up_proj.silu_mul(x, self.kernels))  # one call on gated tiles
            return y
        gate_up = self.gate_up_proj(x)  # [T, 2 I]: [gate | up]
        if self.kernels is not None:
            y = self.down_proj(self.kernels.silu_mul(gate_up))
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
        self, ops: KernelOps, x: Tensor, delta: Tensor | None, meta: AttentionMetadata, cache: PagedKV,
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
        self.backend = Backend()  # the compute path, chosen once by from_weights
        self.kernels: KernelOps | None = None  # the backend's C++ kernels, set at load

    @torch.inference_mode()
    def forward(
        self, token_ids: Tensor, meta: AttentionMetadata, cache: PagedKV, stop: Stop | None = None
    ) -> Tensor:
        """token_ids [T] -> logits [N, V] for the N tokens in meta.sample_idx (only those pay for the head).
        `stop`: asked before each layer; when it says yes the step raises StepInterrupted (engine/plan.py)."""
        assert self.rotary is not None
        x = self.model.embed_tokens(token_ids)  # [T, D]
        if self.kernels is not None:  # the decode kernel stops at each row's length: no mask
            step = StepTensors(self.rotary.cos[meta.positions], self.rotary.signed_sin[meta.positions], None)
            delta = None
            for layer in self.model.layers:
                assert isinstance(layer, DecoderLayer)
                if stop is not None and stop():
                    raise StepInterrupted
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
            if stop is not None and stop():
                raise StepInterrupted
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
        kernels: KernelOptions | None = None,
    ) -> LlamaForCausalLM:
        """`quantized`: the loader's Q4_1/Q8_0 blocks of some linear weights; with the C++ kernels, a step of
        few rows multiplies by those blocks instead of the bfloat16 weights (`PackedLinear`). `kernels`: the
        compute path (None: `KernelOptions.from_env()`), decided here once (`kernels.configure`) and kept as
        `model.backend`; its layers never look again."""
        options = KernelOptions.from_env() if kernels is None else kernels
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
        model.rotary = Rotary(cfg.head_dim, cfg.context_length, cfg.rope_theta, device, cfg.rope_freq_factors)
        # no kernels when switched off, not bfloat16 on the CPU, or not buildable: the torch path then
        model.backend = backend = configure_kernels(options, dtype, device, cfg.head_dim)
        if PackedLinear.supported(dtype, device):
            pack_linears(model, backend)
        if backend.ops is not None:
            for module in model.modules():
                if isinstance(module, (LlamaForCausalLM, Attention, MLP, OutputHead)):
                    module.kernels = backend.ops
                if isinstance(module, Attention):
                    dh = cfg.head_dim  # the attention kernel's tiles take 32 to 256 dims, in 32s
                    module.tiles = (
                        backend.tiles and backend.ops.attention_tiles and dh % 32 == 0 and dh <= 256
                    )
            if quantized and backend.takes_blocks:
                attach_quantized(model, fuse_quantized(quantized, cfg), backend)
        return model

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
        """The model of a `LoadedModel`, on the compute path it was loaded with (`load_model(..., kernels=)`)."""
        return cls.from_weights(
            loaded.config, loaded.weights, dtype, device, loaded.quantized, loaded.kernels
        )
