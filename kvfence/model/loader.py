"""Load a model from disk into a `ModelConfig`, Hugging Face-layout weights and a `Tokenizer`.

Boundary: file formats end here. Two sources are accepted: a `.gguf` file (llama.cpp, read by
kvfence/model/gguf_reader.py) and a Hugging Face directory (`config.json` + `*.safetensors` + `tokenizer.json`,
read here). Both produce the same `LoadedModel`, whose weight names and layouts are those of `transformers`'
LlamaForCausalLM / Qwen2ForCausalLM, so the forward pass never knows where the weights came from. Quantized GGUF
tensors are dequantized. Linear weights stored as Q4_1 or Q8_0 blocks are also kept as those blocks
(`LoadedModel.quantized`, kvfence/model/quant.py), for the C++ kernels that multiply by them directly; every other
consumer sees only the dequantized weights. The `KernelOptions` a model is loaded with travel with it
(`LoadedModel.kernels`) to the model built from it.

Every way a file can be wrong ends in a `ModelLoadError` whose message names the file and the problem.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvfence.config import KernelOptions
from kvfence.model.config import ModelConfig, RopeScalingError, expected_shapes, rope_scaling_factors
from kvfence.model.gguf_reader import gguf_tokenizer, load_gguf
from kvfence.model.quant import QuantBlocks
from kvfence.model.tokenizer import ModelLoadError, Tokenizer

__all__ = ["LoadedModel", "ModelLoadError", "expected_shapes", "load_model", "load_tokenizer"]

_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names and layouts; no lm_head.weight when tied
    tokenizer: Tokenizer
    source: str  # the path it was loaded from
    quantized: dict[str, QuantBlocks] = field(default_factory=dict)  # the weights a GGUF stores as blocks
    kernels: KernelOptions = field(default_factory=KernelOptions)  # the compute path of a model built from it


def load_model(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, kernels: KernelOptions | None = None
) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face model directory; weights are cast to `dtype` on CPU. The weights own
    their memory (none maps the checkpoint), so a model may keep them as its parameters. `kernels`: the compute
    path of the model built from it (`LlamaForCausalLM.from_loaded`); None: `KernelOptions.from_env()`."""
    options = KernelOptions.from_env() if kernels is None else kernels
    p = Path(path)
    quantized: dict[str, QuantBlocks] = {}
    if p.is_dir():
        config, weights, tokenizer = _load_hf_dir(p)
    elif p.is_file():
        # the blocks serve only the bfloat16 kernels; other dtypes would load them for nothing
        config, weights, tokenizer, quantized = load_gguf(p, keep_blocks=dtype == torch.bfloat16)
    else:
        raise ModelLoadError(f"{p}: no such file or directory")
    weights = {name: w.to(dtype) for name, w in weights.items()}
    return LoadedModel(
        config=config,
        weights=weights,
        tokenizer=tokenizer,
        source=str(p),
        quantized=quantized,
        kernels=options,
    )


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Only the tokenizer of a `.gguf` file or Hugging Face directory; no weights are read or dequantized."""
    p = Path(path)
    if p.is_dir():
        return Tokenizer.from_hf_dir(p)
    if not p.is_file():
        raise ModelLoadError(f"{p}: no such file or directory")
    return gguf_tokenizer(p)


# -- Hugging Face directory -------------------------------------------------------------------------------


def _load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{cfg_file}: cannot parse JSON: {e}") from e
    tokenizer = Tokenizer.from_hf_dir(path)
    config = _hf_config(raw, tokenizer, cfg_file)
    found = _read_safetensors(path)
    weights: dict[str, torch.Tensor] = {}
    # Only expected names are kept: this drops a tied lm_head copy some exporters write, and buffers.
    for name, shape in expected_shapes(config).items():
        if name not in found:
            raise ModelLoadError(f"{path}: missing tensor {name} in the *.safetensors files")
        if tuple(found[name].shape) != shape:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {tuple(found[name].shape)}, "
                f"expected {shape} from config.json"
            )
        weights[name] = found[name]
    return config, weights, tokenizer


def _hf_config(raw: Mapping[str, Any], tokenizer: Tokenizer, cfg_file: Path) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((_HF_ARCHS[a] for a in archs if a in _HF_ARCHS), None)
    if arch is None:
        raise ModelLoadError(
            f"{cfg_file}: unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(_HF_ARCHS)}"
        )
    if arch != "qwen2" and raw.get("attention_bias"):
        raise ModelLoadError(f"{cfg_file}: attention_bias (with an o_proj bias) is not supported for {arch}")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ModelLoadError(f"{cfg_file}: missing {key!r}")
        return raw[key]

    d, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    # transformers >= 5 nests rope_theta in rope_parameters; older versions keep it at the top level.
    rope = raw.get("rope_parameters") or {}
    rope_theta = raw.get("rope_theta") or rope.get("rope_theta") or 10000.0
    head_dim = int(raw.get("head_dim") or d // n_heads)
    try:
        factors = rope_scaling_factors(raw.get("rope_scaling") or rope, head_dim, float(rope_theta))
    except RopeScalingError as e:
        raise ModelLoadError(f"{cfg_file}: {e}") from e
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=d,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        context_length=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",  # Qwen2 always has q/k/v biases (and none on o_proj)
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(raw.get("_name_or_path") or cfg_file.parent.name),
        rope_freq_factors=factors,
    )


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files (pytorch_model.bin is not supported)")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            # copies: load_file's tensors map the file, and a model that kept any of them (its parameters are the
            # loader's tensors) would keep every page of the file that loading touched resident
            weights |= {name: t.clone() for name, t in load_file(str(f)).items()}
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors: {e}") from e
    return weights
