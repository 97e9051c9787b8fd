"""Checkpoints with random weights in the shapes of real models, for benchmarks at real scale (issue 26).

    python bench/make_synthetic.py qwen05 OUT_DIR     # Qwen2.5-0.5B-like: 24 layers, hidden 896, 14/2 heads
    python bench/make_synthetic.py llama1b OUT_DIR    # Llama-3.2-1B-like: 16 layers, hidden 2048, 32/8 heads

writes, in OUT_DIR:
  hf/            a Hugging Face folder: config.json, model.safetensors (bfloat16), the tokenizer files
  model.Q8_0.gguf, model.Q4_1.gguf   the same weights as llama.cpp's converter would store them

Every file carries the default model's tokenizer (SmolLM2's, 49,152 tokens, read from its GGUF): the vocabulary
is cut to it, so the embedding and output matrices are 49,152 rows instead of the real model's 128k-152k (the
transformer blocks, where the time goes, have the real shapes). Weights are drawn from N(0, 0.02²) with a fixed
seed (norms are 1), so two runs write the same files, and every server (kvfence, vLLM-CPU, llama.cpp) serves the
same weights (rounded to Q8_0 or Q4_1 in the GGUF files). Text from random weights is noise; benchmarks force
their output length (`ignore_eos`).

Left out: Llama 3's RoPE frequency scaling (it changes the rotation frequencies, not the cost of a step) and the
real vocabularies. Qwen2.5 keeps its q/k/v biases (`Qwen2ForCausalLM`,
GGUF architecture `qwen2`). Existing files are kept (delete OUT_DIR to write them again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from kvfence.model.fetch import DEFAULT_MODEL_PATH
from kvfence.model.gguf_reader import gguf_name  # Hugging Face -> GGUF tensor names, as llama.cpp's converter

# bench/kernels.py would shadow the `kernels` package that transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


@dataclass(frozen=True)
class Shape:
    architecture: str  # Hugging Face class
    gguf_arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float
    rms_eps: float
    context: int
    bias: bool  # q/k/v biases (Qwen2)
    tied: bool


SHAPES = {
    # Qwen/Qwen2.5-0.5B-Instruct's config.json, vocabulary aside
    "qwen05": Shape("Qwen2ForCausalLM", "qwen2", 896, 24, 14, 2, 4864, 1e6, 1e-6, 32768, True, True),
    # meta-llama/Llama-3.2-1B-Instruct's config.json, vocabulary and RoPE scaling aside
    "llama1b": Shape("LlamaForCausalLM", "llama", 2048, 16, 32, 8, 8192, 5e5, 1e-5, 131072, False, True),
}
SEED = 26
GGUF_TYPES = ("Q8_0", "Q4_1")


def weights(shape: Shape, vocab: int) -> dict[str, torch.Tensor]:
    """Hugging Face names and layouts, bfloat16."""
    gen = torch.Generator().manual_seed(SEED)
    head_dim = shape.hidden // shape.heads

    def randn(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    out = {"model.embed_tokens.weight": randn(vocab, shape.hidden), "model.norm.weight": ones(shape.hidden)}
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": ones(shape.hidden),
            p + "self_attn.q_proj.weight": randn(q, shape.hidden),
            p + "self_attn.k_proj.weight": randn(kv, shape.hidden),
            p + "self_attn.v_proj.weight": randn(kv, shape.hidden),
            p + "self_attn.o_proj.weight": randn(shape.hidden, q),
            p + "post_attention_layernorm.weight": ones(shape.hidden),
            p + "mlp.gate_proj.weight": randn(shape.intermediate, shape.hidden),
            p + "mlp.up_proj.weight": randn(shape.intermediate, shape.hidden),
            p + "mlp.down_proj.weight": randn(shape.hidden, shape.intermediate),
        }
        if shape.bias:
            out |= {p + f"self_attn.{x}_proj.bias": randn(n) for x, n in (("q", q), ("k", kv), ("v", kv))}
    if not shape.tied:
        out["lm_head.weight"] = randn(vocab, shape.hidden)
    return out


# -- Hugging Face folder ------------------------------------------------------------------------------------


def write_hf(out: Path, name: str, shape: Shape, w: dict[str, torch.Tensor], tokenizer_gguf: Path) -> None:
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(tokenizer_gguf.parent), gguf_file=tokenizer_gguf.name
    )
    tokenizer.save_pretrained(out)
    config = {
        "architectures": [shape.architecture],
        "model_type": "qwen2" if shape.gguf_arch == "qwen2" else "llama",
        "_name_or_path": f"kvfence-synthetic-{name}",
        "vocab_size": int(w["model.embed_tokens.weight"].shape[0]),
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.hidden // shape.heads,
        "hidden_act": "silu",
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_eps,
        "max_position_embeddings": shape.context,
        "tie_word_embeddings": shape.tied,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "bfloat16",
    }
    if shape.gguf_arch == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )


# -- GGUF ---------------------------------------------------------------------------------------------------


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter for llama: each head's q/k rows [first half | second half] become interleaved pairs
    (its RoPE rotates adjacent pairs); Qwen2 keeps the Hugging Face order."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def copy_tokenizer(writer: gguf.GGUFWriter, source: Path) -> int:
    """The tokenizer.* keys of `source` (the default model's GGUF), as they are; returns the vocabulary size."""
    reader = gguf.GGUFReader(str(source))
    vocab = 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
            vocab = max(vocab, len(value)) if key == "tokenizer.ggml.tokens" else vocab
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        else:
            writer.add_key_value(key, value, kind)
    if not vocab:
        raise SystemExit(f"{source}: no tokenizer.ggml.tokens")
    return vocab


def write_gguf(
    path: Path, name: str, shape: Shape, w: dict[str, torch.Tensor], qtype: str, tokenizer_gguf: Path
) -> None:
    t = gguf.GGMLQuantizationType[qtype]
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), shape.gguf_arch)
    head_dim = shape.hidden // shape.heads
    writer.add_name(f"kvfence-synthetic-{name}")
    writer.add_file_type(
        {"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[qtype]
    )
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    vocab = copy_tokenizer(writer, tokenizer_gguf)
    writer.add_vocab_size(vocab)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for hf, tensor in w.items():
        arr = tensor.float().numpy()
        gname = gguf_name(hf)
        if shape.gguf_arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            arr = permute(arr, shape.heads)
        elif shape.gguf_arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            arr = permute(arr, shape.kv_heads)
        if arr.ndim == 2:  # linear weights and the embedding, as llama.cpp's converter quantizes them
            writer.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(arr), t), raw_dtype=t)
        else:  # norms and biases stay float32
            writer.add_tensor(gname, np.ascontiguousarray(arr, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer", type=Path, default=Path(DEFAULT_MODEL_PATH), help="GGUF to take it from")
    ap.add_argument(
        "--gguf", nargs="*", choices=GGUF_TYPES, default=list(GGUF_TYPES), help="GGUF types to write"
    )
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    vocab = len(gguf.GGUFReader(str(args.tokenizer)).fields["tokenizer.ggml.tokens"].data)
    todo = [q for q in args.gguf if not (args.out / f"model.{q}.gguf").is_file()]
    hf_done = (args.out / "hf" / "model.safetensors").is_file()
    if hf_done and not todo:
        print(f"{args.out}: already written")
        return 0
    start = time.perf_counter()
    w = weights(shape, vocab)
    params = sum(t.numel() for t in w.values())
    print(f"{args.shape}: {params / 1e6:.0f}M parameters, vocabulary {vocab}", file=sys.stderr)
    if not hf_done:
        write_hf(args.out / "hf", args.shape, shape, w, args.tokenizer)
        print(f"wrote {args.out / 'hf'} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    for q in todo:
        write_gguf(args.out / f"model.{q}.gguf", args.shape, shape, w, q, args.tokenizer)
        print(f"wrote {args.out / f'model.{q}.gguf'} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
