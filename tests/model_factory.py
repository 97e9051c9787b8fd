"""Tiny random models on disk, for tests: a Hugging Face directory and GGUF files of the same weights.

Not a test module. Every writer is deterministic in its arguments (same `seed` -> same weights, same files),
so `write_tiny_gguf(p, qtype="F32", seed=3)` and `write_tiny_hf_dir(d, seed=3)` hold exactly the same model,
and `tiny_weights(seed=3)` returns it in Hugging Face layout for comparisons.

The GGUF writer does what llama.cpp's `convert_hf_to_gguf.py` does, independently of `kvfence.model.loader`:
tensor renaming, the q/k row permutation for llama/mistral, row-wise quantization with `gguf.quants`, and
`tokenizer.ggml.*` metadata for a gpt2-style BPE vocabulary.

Default shapes: vocab 384, hidden 64, intermediate 128, 2 layers, 4 heads, 2 KV heads, head_dim 16; every
quantized row length is a multiple of 32 as Q4/Q8 blocks require.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Fixed training text: English, digits, code-ish punctuation and some non-ASCII so merges are varied.
_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. "
    "A paged KV cache stores keys and values in fixed-size pages; "
    "each tenant leases pages and returns them when the request ends. Hello world! hello there, how are you? "
    "def forward(self, x): return self.norm(x) + 1234567890 * 0.5\n"
    "Les élèves étudient à l'école. Über naïve café résumé. 你好，世界。 🙂 emoji and 🚀 rockets.\n"
    "the then there these those this that with which while where when what who whom whose\n"
) * 4

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # llama | mistral | qwen2; anything else is written as llama weights under that name
    seed: int = 0
    tie: bool = False
    bias: bool | None = None  # q/k/v bias; None means "what the architecture has" (only qwen2)
    vocab_size: int | None = None  # None: the tiny tokenizer's size (384); larger pads the vocabulary
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    context_length: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02

    @property
    def has_bias(self) -> bool:
        return self.arch == "qwen2" if self.bias is None else self.bias


def make_spec(**kw: Any) -> TinySpec:
    names = {f.name for f in fields(TinySpec)}
    unknown = set(kw) - names
    if unknown:
        raise TypeError(f"unknown tiny-model options: {sorted(unknown)}")
    spec = TinySpec(**kw)
    if spec.has_bias != (spec.arch == "qwen2"):
        raise ValueError("q/k/v biases come with qwen2 and only with qwen2")
    return spec


# -- tokenizer ----------------------------------------------------------------------------------------------


@cache
def _tiny_tokenizer_json() -> str:
    tok = tokenizers.Tokenizer(models.BPE())
    # The same pre-tokenization as SmolLM2 (digits split one by one), so a GGUF can say pre = "smollm".
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TRAINING_TEXT], trainer=trainer)
    return str(tok.to_str())


def tiny_tokenizer() -> tokenizers.Tokenizer:
    """A fresh copy of the tiny byte-level BPE tokenizer (special tokens 0..2 as in SmolLM2)."""
    return tokenizers.Tokenizer.from_str(_tiny_tokenizer_json())


def _vocab_and_merges() -> tuple[list[str], list[str]]:
    model = json.loads(_tiny_tokenizer_json())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [""] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


# -- weights ------------------------------------------------------------------------------------------------


def _hf_model(spec: TinySpec) -> torch.nn.Module:
    import transformers  # slow to import; only the writers need it

    vocab = spec.vocab_size or tiny_tokenizer().get_vocab_size()
    kind = {"mistral": "Mistral", "qwen2": "Qwen2"}.get(spec.arch, "Llama")
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = getattr(transformers, f"{kind}ForCausalLM")(config)
    # Overwrite every parameter from our own generator: values then do not depend on transformers' init
    # scheme, and norms/biases are far from 1/0 so a loader that drops or swaps them is caught.
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(spec.init_std * noise)
    return model.eval()


def tiny_weights(**kw: Any) -> dict[str, torch.Tensor]:
    """The tiny model's weights in Hugging Face naming and layout, float32; no lm_head.weight when tied."""
    spec = make_spec(**kw)
    state = {k: v.detach().clone() for k, v in _hf_model(spec).state_dict().items()}
    if spec.tie:
        state.pop("lm_head.weight", None)
    return state


def quant_roundtrip(weights: dict[str, torch.Tensor], qtype: str) -> dict[str, torch.Tensor]:
    """What `write_tiny_gguf(qtype=...)` stores, dequantized: 2-D tensors pass through the quantization,
    1-D tensors (norms, biases) stay float32 as llama.cpp keeps them. Quant blocks run along rows, so the q/k
    row permutation does not change the values and this can be computed in Hugging Face layout."""
    out = {}
    for name, w in weights.items():
        arr = w.numpy()
        if arr.ndim == 2 and qtype != "F32":
            t = gguf.GGMLQuantizationType[qtype]
            arr = gguf.quants.dequantize(gguf.quants.quantize(arr, t), t)
        out[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    return out


# -- writers ------------------------------------------------------------------------------------------------


def write_tiny_hf_dir(path: str | Path, **kw: Any) -> Path:
    """A Hugging Face model directory: config.json, model.safetensors, generation_config.json, tokenizer.json,
    tokenizer_config.json (ChatML template, BOS `<|im_start|>`, EOS `<|im_end|>`, no BOS added)."""
    spec = make_spec(**kw)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _hf_model(spec).save_pretrained(path)
    tiny_tokenizer().save(str(path / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_TOKEN_ID],
        "eos_token": SPECIAL_TOKENS[EOS_TOKEN_ID],
        "add_bos_token": False,
        "model_max_length": spec.context_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return path


def write_tiny_gguf(
    path: str | Path,
    *,
    qtype: str = "F32",
    drop_tensors: Iterable[str] = (),
    qtype_overrides: dict[str, str] | None = None,
    tokenizer_model: str = "gpt2",
    rope_freqs: Iterable[float] | None = None,
    rope_scaling: tuple[str, float] | None = None,
    **kw: Any,
) -> Path:
    """A GGUF file of the tiny model as llama.cpp would convert it. `qtype` applies to 2-D tensors;
    `qtype_overrides` maps GGUF tensor names to other types (one gguf cannot quantize gets random bytes);
    `drop_tensors` omits GGUF tensors by name, to build broken files. RoPE scaling as llama.cpp's converter writes
    it: `rope_freqs` (Llama 3's per-frequency divisors) as the tensor `rope_freqs.weight`, `rope_scaling` (type,
    factor) as `{arch}.rope.scaling.type` / `.factor`."""
    spec = make_spec(**kw)
    path = Path(path)
    weights = tiny_weights(**kw)
    vocab_size = weights["model.embed_tokens.weight"].shape[0]
    writer = gguf.GGUFWriter(str(path), spec.arch)
    _write_hparams(writer, spec, vocab_size)
    _write_tokenizer(writer, vocab_size, tokenizer_model)
    if rope_scaling is not None:
        if rope_scaling[0]:  # "": the factor alone, as older converters wrote it
            writer.add_string(f"{spec.arch}.rope.scaling.type", rope_scaling[0])
        writer.add_float32(f"{spec.arch}.rope.scaling.factor", rope_scaling[1])
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(list(rope_freqs), dtype=np.float32))
    dropped, overrides = set(drop_tensors), qtype_overrides or {}
    rng = np.random.default_rng(spec.seed)
    for hf_name, w in weights.items():
        name = _gguf_name(hf_name)
        if name in dropped:
            continue
        arr = w.numpy()
        if spec.arch in ("llama", "mistral") and name.endswith(("attn_q.weight", "attn_q.bias")):
            arr = _permute(arr, spec.num_heads)
        elif spec.arch in ("llama", "mistral") and name.endswith(("attn_k.weight", "attn_k.bias")):
            arr = _permute(arr, spec.num_kv_heads)
        _add_tensor(writer, name, arr, overrides.get(name, qtype if arr.ndim == 2 else "F32"), rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer: gguf.GGUFWriter, spec: TinySpec, vocab_size: int) -> None:
    writer.add_name(f"tiny-{spec.arch}-seed{spec.seed}")
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_block_count(spec.num_layers)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(vocab_size)


def _write_tokenizer(writer: gguf.GGUFWriter, vocab_size: int, tokenizer_model: str) -> None:
    tokens, merges = _vocab_and_merges()
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    for i in range(len(tokens), vocab_size):  # llama.cpp pads a larger embedding with unused tokens
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: str, rng: np.random.Generator
) -> None:
    t = gguf.GGMLQuantizationType[qtype]
    if t == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif t == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, arr.astype(np.float16))
    else:
        try:
            data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), t)
        except NotImplementedError:  # a type gguf cannot produce (e.g. Q8_1): random bytes of the right size
            shape = gguf.quants.quant_shape_to_byte_shape(arr.shape, t)
            data = rng.integers(0, 256, size=shape, dtype=np.uint8)
        writer.add_tensor(name, data, raw_dtype=t)


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.{i}.{rest}
    return f"blk.{layer}.{_GGUF_LAYER[rest]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's [half0 | half1] rows become interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
