"""Read a `.gguf` file (llama.cpp) into a `ModelConfig`, Hugging Face-layout float32 weights and a `Tokenizer`.

Boundary: the GGUF format ends here (kvfence/model/loader.py is the only caller). Tensor names are mapped to
`transformers`' names, every tensor is dequantized to float32, and llama.cpp's interleaving of the rotary halves of
q/k is undone for the architectures it permutes. Linear weights stored as Q4_1 or Q8_0 blocks are also kept as
those blocks (`QuantBlocks`, kvfence/model/quant.py) when asked. Every way the file can be wrong ends in a
`ModelLoadError` that names the file and the problem.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from kvfence.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScalingError,
    expected_shapes,
    rope_scaling_factors,
)
from kvfence.model.quant import BLOCK_BYTES, QuantBlocks
from kvfence.model.tokenizer import ModelLoadError, Tokenizer

# GGUF per-layer tensor suffix -> Hugging Face per-layer suffix.
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_TO_GGUF = {hf: gg for gg, hf in _GGUF_GLOBAL.items()} | {
    f"model.layers.{{i}}.{hf}": f"blk.{{i}}.{gg}" for gg, hf in _GGUF_LAYER.items()
}
# llama.cpp's converter interleaves the two RoPE halves of each q/k head for these architectures only.
_PERMUTED_ARCHS = ("llama", "mistral")


def gguf_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` (for error messages and lookup)."""
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers.") and len(parts) > 3:
        return _HF_TO_GGUF["model.layers.{i}." + ".".join(parts[3:])].format(i=parts[2])
    return _HF_TO_GGUF[hf_name]


def load_gguf(
    path: Path, keep_blocks: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer, dict[str, QuantBlocks]]:
    reader = _open_gguf(path)
    meta = _GGUFMeta(reader, path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "blk.0.attn_output.bias" in tensors:
        raise ModelLoadError(f"{path}: attention output bias (blk.*.attn_output.bias) is not supported")

    tok_fields = meta.tokenizer_fields()
    tokenizer = Tokenizer.from_gguf_fields(tok_fields, source=str(path))
    d = int(meta.get(f"{arch}.embedding_length"))
    n_heads = int(meta.get(f"{arch}.attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", d // n_heads))
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tok_fields["tokenizer.ggml.tokens"]))),
        hidden_size=d,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length")),
        num_layers=int(meta.get(f"{arch}.block_count")),
        num_heads=n_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        rope_theta=meta.get_float(f"{arch}.rope.freq_base", 10000.0),
        rms_norm_eps=meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        context_length=int(meta.get(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(meta.get("general.name", path.stem)),
        rope_freq_factors=_rope_factors(path, arch, meta, tensors, head_dim),
    )
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantBlocks] = {}
    for hf_name, shape in expected_shapes(config).items():
        gg_name = gguf_name(hf_name)
        if gg_name not in tensors:
            raise ModelLoadError(f"{path}: missing tensor {gg_name}")
        w = _dequantize(tensors[gg_name], path)
        if w.shape != shape:
            raise ModelLoadError(
                f"{path}: tensor {gg_name} has shape {w.shape}, expected {shape} from the model config"
            )
        kind = tensors[gg_name].tensor_type.name
        blocks = (
            QuantBlocks.split(tensors[gg_name].data, kind)
            if keep_blocks and kind in BLOCK_BYTES and len(shape) == 2
            else None
        )
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(gg_name.split(".")[-2])
        if arch in _PERMUTED_ARCHS and heads is not None:
            w = _unpermute(w, heads)
            if blocks is not None:
                blocks = blocks.map_rows(functools.partial(_unpermute, n_head=heads))
        weights[hf_name] = torch.from_numpy(w)
        if blocks is not None:
            quantized[hf_name] = blocks
    return config, weights, tokenizer, quantized


def gguf_tokenizer(path: Path) -> Tokenizer:
    """Only the tokenizer of a `.gguf` file; no tensor is read or dequantized."""
    return Tokenizer.from_gguf_fields(_GGUFMeta(_open_gguf(path), path).tokenizer_fields(), source=str(path))


class _PlainArrayReader(gguf.GGUFReader):
    """GGUFReader whose buffer is a plain ndarray view of the memory map instead of an `np.memmap`.

    The reader slices its buffer once per metadata array element (~100k times for a 49k-token vocabulary), and
    every `np.memmap` slice pays for `__array_finalize__`; a plain view of the same mapping parses the SmolLM2
    file in ~0.7 s instead of ~2.4 s. Should the reader stop assigning `self.data`, this property is simply
    unused and loading gets slower, not wrong.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain_data = np.asarray(value)


def _open_gguf(path: Path) -> gguf.GGUFReader:
    """A `gguf.GGUFReader` over `path`, or a `ModelLoadError` saying why the file is not a usable GGUF."""
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = _PlainArrayReader(path)
    except Exception as e:  # the reader fails in many ways on truncated or corrupt files
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {size} bytes"
            )
    return reader


def _dequantize(tensor: gguf.ReaderTensor, path: Path) -> np.ndarray:
    """A writable float32 array in numpy (row-major) order. GGUF lists dims fastest-first; the reader has
    already reversed them, so a Hugging Face [out, in] weight comes back as [out, in]."""
    try:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} uses quantization type {tensor.tensor_type.name}, "
            "which cannot be dequantized"
        ) from e
    except ValueError as e:  # data that does not fit its declared type and shape
        raise ModelLoadError(f"{path}: tensor {tensor.name} cannot be dequantized: {e}") from e
    w = np.asarray(w, dtype=np.float32)
    if not w.flags.writeable or not w.flags.c_contiguous:
        w = w.copy()  # F32 data is a view into the read-only memory map
    return w


def _rope_factors(
    path: Path, arch: str, meta: _GGUFMeta, tensors: dict[str, gguf.ReaderTensor], head_dim: int
) -> tuple[float, ...] | None:
    """RoPE scaling as llama.cpp reads it: Llama 3's per-frequency divisors as the tensor `rope_freqs.weight`, a
    linear scaling as `{arch}.rope.scaling.factor` (or the older `{arch}.rope.scale_linear`) with
    `{arch}.rope.scaling.type` "linear" or absent; both may come together (the divisors multiply). Other types
    (yarn, longrope) are refused: ignored, they would change the positions of every token."""
    factor = meta.get(f"{arch}.rope.scaling.factor", None)
    if factor is None:
        factor = meta.get(f"{arch}.rope.scale_linear", None)
    kind = str(meta.get(f"{arch}.rope.scaling.type", "none" if factor is None else "linear"))
    if kind not in ("none", "linear"):
        raise ModelLoadError(f"{path}: RoPE scaling {kind!r} is not supported (supported: linear, llama3)")
    factors: list[float] | None = None
    if "rope_freqs.weight" in tensors:
        freqs = _dequantize(tensors["rope_freqs.weight"], path).reshape(-1)
        if not (np.isfinite(freqs).all() and (freqs > 0).all()):
            raise ModelLoadError(f"{path}: rope_freqs.weight holds values that are not positive and finite")
        if len(freqs) != head_dim // 2:
            raise ModelLoadError(
                f"{path}: rope_freqs.weight has {len(freqs)} values, expected {head_dim // 2}"
            )
        factors = [float(f) for f in freqs]
    if kind == "linear" and factor is not None:
        try:
            linear = rope_scaling_factors({"rope_type": "linear", "factor": factor}, head_dim, 0.0)
        except RopeScalingError as e:
            raise ModelLoadError(f"{path}: {e}") from e
        assert linear is not None
        factors = [f * s for f, s in zip(factors or [1.0] * len(linear), linear, strict=True)]
    return tuple(factors) if factors is not None else None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute(w, n_head)`, which reorders each head's rows from [half0 | half1] (HF
    rotate_half layout) to interleaved pairs (GGML's RoPE).

    Works for weights [rows, cols] and biases [rows]."""
    rows, rest = w.shape[0], w.shape[1:]
    # GGUF row order within a head is (j, s) with s the half; HF order is (s, j).
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


class _GGUFMeta:
    """Typed access to GGUF key/value metadata, with errors that name the file and the key."""

    def __init__(self, reader: gguf.GGUFReader, path: Path) -> None:
        self._reader = reader
        self._path = path

    def get(self, key: str, default: Any = ...) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ModelLoadError(f"{self._path}: missing metadata key {key!r}")
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(f"{self._path}: cannot read metadata key {key!r}: {e}") from e

    def get_float(self, key: str, default: Any = ...) -> float:
        # GGUF stores these as float32; the shortest decimal that round-trips (1e-05, not 9.9999997e-06) is
        # what the original config.json said, so both loaders agree on the config exactly.
        return float(str(np.float32(self.get(key, default))))

    def tokenizer_fields(self) -> dict[str, Any]:
        return {k: self.get(k) for k in self._reader.fields if k.startswith("tokenizer.")}
