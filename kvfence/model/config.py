"""Model architecture description shared by loaders and the forward pass.

Loaders (GGUF, Hugging Face directory) produce a `ModelConfig` plus a weight dict in Hugging Face naming and
layout; the forward pass in `llama.py` consumes exactly that and knows nothing about file formats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int  # max positions the model was trained for
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    name: str = "model"
    # RoPE scaling: each of the head_dim/2 rotation frequencies is divided by its factor (`rope_scaling_factors`);
    # None: none
    rope_freq_factors: tuple[float, ...] | None = None

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model with this config must have, in Hugging Face naming, with its shape."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, cfg.intermediate_size),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


class RopeScalingError(ValueError):
    """A RoPE scaling that kvfence does not implement (refused: ignoring it would change every long context)."""


def rope_scaling_factors(
    params: Mapping[str, Any] | None, head_dim: int, theta: float
) -> tuple[float, ...] | None:
    """The per-frequency divisors of a Hugging Face `rope_scaling` (or transformers 5's `rope_parameters`):
    "linear" divides every frequency by `factor` (positions / factor); "llama3" (Llama 3.1+) divides the low
    frequencies (wavelength above original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high
    ones (below original / high_freq_factor), and interpolates in between, as transformers'
    `_compute_llama3_parameters` does. None, "default" and "dynamic" (dynamic NTK changes nothing within
    `max_position_embeddings`, past which kvfence serves nothing): None. Anything else (yarn, longrope, ...) or a
    bad parameter: RopeScalingError."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default", "dynamic"):
        return None
    if kind not in ("linear", "llama3"):
        raise RopeScalingError(f"RoPE scaling {kind!r} is not supported (supported: linear, llama3)")
    try:
        factor = float(params["factor"])
        if kind == "llama3":
            low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
            original = float(params["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as e:
        raise RopeScalingError(f"RoPE scaling {kind!r}: missing or bad parameter ({e})") from e
    if not (math.isfinite(factor) and factor > 0):
        raise RopeScalingError(f"RoPE scaling {kind!r}: factor must be positive, got {params['factor']!r}")
    if kind == "linear":
        return tuple(factor for _ in range(head_dim // 2))
    if not (high > low > 0 and math.isfinite(high) and math.isfinite(original) and original > 0):
        raise RopeScalingError(f"RoPE scaling llama3: bad parameters {dict(params)}")
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:  # new frequency = (1 - smooth) * f / factor + smooth * f
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)
