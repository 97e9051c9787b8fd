"""Load a model from disk into a `ModelConfig`, Hugging Face-layout weights and a `Tokenizer`.

Boundary: file formats end here. Two sources are accepted: a `.gguf` file (llama.cpp) and a Hugging Face
directory (`config.json` + `*.safetensors` + `tokenizer.json`). Both produce the same `LoadedModel`, whose
weight names and layouts are those of `transformers`' LlamaForCausalLM / Qwen2ForCausalLM, so the forward pass
never knows where the weights came from. Quantized GGUF tensors are dequantized here. Linear weights stored
as Q4_1 or Q8_0 blocks are also kept as those blocks (`LoadedModel.quantized`, split by `QuantBlocks`), for
the C++ kernels that multiply by them directly; every other consumer sees only the dequantized weights.

Every way a file can be wrong ends in a `ModelLoadError` whose message names the file and the problem.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvfence.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvfence.model.tokenizer import ModelLoadError, Tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "QuantBlocks",
    "QuantPanels",
    "expected_shapes",
    "load_model",
    "load_tokenizer",
]

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
_HF_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


QBLOCK = 32  # weights per Q4_1 / Q8_0 block, along a row
PANEL = 16  # output columns per panel of `QuantPanels`
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; Q8_0: fp16 d, 32 int8


@dataclass(frozen=True)
class QuantBlocks:
    """A linear weight [N, K] as the GGUF stores it, in blocks of 32 along each row, split into arrays the
    kernels read directly (`kvfence/model/kernels`): `qs` [N, K/2] (Q4_1: block element j in the low nibble of
    byte j, element j + 16 in its high nibble) or [N, K] (Q8_0: int8 as bytes); `d` and `m` [N, K/32] float16.
    Weight = d * q + m (Q4_1) or d * q (Q8_0, `m` is empty)."""

    kind: str  # "Q4_1" or "Q8_0"
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def kind_id(self) -> int:  # the kernels' enum
        return 0 if self.kind == "Q4_1" else 1

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.d.shape[1] * QBLOCK

    @staticmethod
    def split(raw: np.ndarray, kind: str) -> QuantBlocks:
        """From a GGUF tensor's bytes [N, K/32 * block bytes]."""
        n = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(n, -1, _BLOCK_BYTES[kind])
        d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, -1)
        if kind == "Q4_1":
            m, qs = blocks[:, :, 2:4].copy().view(np.float16).reshape(n, -1), blocks[:, :, 4:].reshape(n, -1)
        else:
            m, qs = np.zeros((0, 0), np.float16), blocks[:, :, 2:].reshape(n, -1)
        return QuantBlocks(kind, torch.from_numpy(qs.copy()), torch.from_numpy(d), torch.from_numpy(m))

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> QuantBlocks:
        """The same weight with its rows reordered by `fn` (a row permutation of [N, ...] arrays)."""
        m = self.m if self.kind == "Q8_0" else torch.from_numpy(np.ascontiguousarray(fn(self.m.numpy())))
        return QuantBlocks(
            self.kind,
            torch.from_numpy(np.ascontiguousarray(fn(self.qs.numpy()))),
            torch.from_numpy(np.ascontiguousarray(fn(self.d.numpy()))),
            m,
        )

    def panel_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """The shapes and dtypes of `panels()`' wp, d and m, without repacking."""
        n, k = self.shape
        nb, panels = k // QBLOCK, -(-n // PANEL)
        group_bytes = QBLOCK // 2 if self.kind == "Q4_1" else QBLOCK
        scales = (panels, nb, PANEL)
        m = scales if self.kind == "Q4_1" else (0,)
        return (
            ((panels * nb * group_bytes * PANEL,), torch.uint8),
            (scales, torch.float16),
            (m, torch.float16),
        )

    def panels(self) -> QuantPanels:
        """The same blocks repacked for `panel_linear` (int8 activations, kvfence/model/kernels): panels of 16
        output columns, one column per 32-bit lane, blocks of each panel one after another along K. Q4_1: 4 groups
        of 64 bytes per block, byte i of a lane's group g holding q[8g + i] | q[8g + 4 + i] << 4; Q8_0: 8 groups,
        byte i holding q[4g + i] + 128. d and m become [panels, K/32, 16]; columns past N are zero."""
        n, k = self.shape
        nb, panels = k // QBLOCK, -(-n // PANEL)
        pad = panels * PANEL - n
        if self.kind == "Q4_1":
            packed = self.qs.numpy().reshape(n, nb, 16)
            q = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # [n, nb, 32] in 0..15
            q = np.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(panels, PANEL, nb, 4, 2, 4)  # k = 8g + 4h + i
            nibbles = q[:, :, :, :, 0, :] | (q[:, :, :, :, 1, :] << 4)  # [panels, lane, nb, g, i]
            wp = nibbles.transpose(0, 2, 3, 1, 4)  # [panels, nb, g, lane, i]
        else:
            q = (self.qs.numpy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            q = np.pad(q.reshape(n, nb, 8, 4), ((0, pad), (0, 0), (0, 0), (0, 0)))
            wp = q.reshape(panels, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4)

        def scales(t: torch.Tensor) -> torch.Tensor:
            a = np.pad(t.numpy(), ((0, pad), (0, 0))).reshape(panels, PANEL, nb).transpose(0, 2, 1)
            return torch.from_numpy(np.ascontiguousarray(a))

        m = scales(self.m) if self.kind == "Q4_1" else torch.zeros((0,), dtype=torch.float16)
        return QuantPanels(
            self.kind, n, torch.from_numpy(np.ascontiguousarray(wp).reshape(-1)), scales(self.d), m
        )

    @staticmethod
    def cat(parts: Sequence[QuantBlocks]) -> QuantBlocks | None:
        """The rows of `parts` one after another (a fused projection); None unless all are of one kind."""
        if len({p.kind for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return None
        m = parts[0].m if parts[0].kind == "Q8_0" else torch.cat([p.m for p in parts])
        return QuantBlocks(
            parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m
        )


@dataclass(frozen=True)
class QuantPanels:
    """A linear weight's blocks laid out for `panel_linear` (`QuantBlocks.panels`): `wp` the repacked quants,
    `d` and `m` [ceil(N/16), K/32, 16] float16 (`m` empty for Q8_0), `n` the number of output columns."""

    kind: str
    n: int
    wp: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def kind_id(self) -> int:
        return 0 if self.kind == "Q4_1" else 1


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names and layouts; no lm_head.weight when tied
    tokenizer: Tokenizer
    source: str  # the path it was loaded from
    quantized: dict[str, QuantBlocks] = field(default_factory=dict)  # the weights a GGUF stores as blocks


def load_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a `.gguf` file or a Hugging Face model directory; weights are cast to `dtype` on CPU. The weights own
    their memory (none maps the checkpoint), so a model may keep them as its parameters."""
    p = Path(path)
    quantized: dict[str, QuantBlocks] = {}
    if p.is_dir():
        config, weights, tokenizer = _load_hf_dir(p)
    elif p.is_file():
        # the blocks serve only the bfloat16 kernels; other dtypes would load them for nothing
        config, weights, tokenizer, quantized = _load_gguf(p, keep_blocks=dtype == torch.bfloat16)
    else:
        raise ModelLoadError(f"{p}: no such file or directory")
    weights = {name: w.to(dtype) for name, w in weights.items()}
    return LoadedModel(
        config=config, weights=weights, tokenizer=tokenizer, source=str(p), quantized=quantized
    )


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Only the tokenizer of a `.gguf` file or Hugging Face directory; no weights are read or dequantized."""
    p = Path(path)
    if p.is_dir():
        return Tokenizer.from_hf_dir(p)
    if not p.is_file():
        raise ModelLoadError(f"{p}: no such file or directory")
    return Tokenizer.from_gguf_fields(_GGUFMeta(_open_gguf(p), p).tokenizer_fields(), source=str(p))


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


def _gguf_name(hf_name: str) -> str:
    """`model.layers.3.self_attn.q_proj.weight` -> `blk.3.attn_q.weight` (for error messages and lookup)."""
    parts = hf_name.split(".")
    if hf_name.startswith("model.layers.") and len(parts) > 3:
        return _HF_TO_GGUF["model.layers.{i}." + ".".join(parts[3:])].format(i=parts[2])
    return _HF_TO_GGUF[hf_name]


# -- GGUF -------------------------------------------------------------------------------------------------


def _load_gguf(
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

    if "rope_freqs.weight" in tensors or meta.get(f"{arch}.rope.scaling.type", "none") != "none":
        logger.warning("%s: RoPE scaling is not supported and is ignored; long contexts may degrade", path)

    tok_fields = meta.tokenizer_fields()
    tokenizer = Tokenizer.from_gguf_fields(tok_fields, source=str(path))
    d = int(meta.get(f"{arch}.embedding_length"))
    n_heads = int(meta.get(f"{arch}.attention.head_count"))
    config = ModelConfig(
        architecture=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", len(tok_fields["tokenizer.ggml.tokens"]))),
        hidden_size=d,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length")),
        num_layers=int(meta.get(f"{arch}.block_count")),
        num_heads=n_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", d // n_heads)),
        rope_theta=meta.get_float(f"{arch}.rope.freq_base", 10000.0),
        rms_norm_eps=meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        context_length=int(meta.get(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(meta.get("general.name", path.stem)),
    )
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantBlocks] = {}
    for hf_name, shape in expected_shapes(config).items():
        gg_name = _gguf_name(hf_name)
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
            if keep_blocks and kind in _BLOCK_BYTES and len(shape) == 2
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
    if raw.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        logger.warning(
            "%s: RoPE scaling is not supported and is ignored; long contexts may degrade", cfg_file
        )
    rope_theta = raw.get("rope_theta") or rope.get("rope_theta") or 10000.0
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=d,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=n_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or d // n_heads),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        context_length=int(need("max_position_embeddings")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",  # Qwen2 always has q/k/v biases (and none on o_proj)
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        name=str(raw.get("_name_or_path") or cfg_file.parent.name),
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
