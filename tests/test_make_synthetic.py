"""bench/make_synthetic.py writes one model three ways (bfloat16 Hugging Face folder, Q8_0 and Q4_1 GGUF):
kvfence loads each to the same weights (within the quantization's error) and the same tokenizer, for both
architectures it writes (llama: q/k rows permuted for llama.cpp; qwen2: biases, no permutation). Real shapes are
too big for a test; the same code runs at a tiny hidden size."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kvfence.model.loader import load_model, load_tokenizer
from tests.conftest import require_default_model

ROOT = Path(__file__).resolve().parent.parent


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "kvfence_make_synthetic", ROOT / "bench" / "make_synthetic.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["qwen05", "llama1b"])
def test_the_three_files_hold_the_same_model(tmp_path: Path, name: str) -> None:
    tokenizer_gguf = require_default_model()
    ms = _module()
    tiny = dataclasses.replace(ms.SHAPES[name], hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256)
    ms.SHAPES["tiny"] = tiny
    assert ms.main(["tiny", str(tmp_path), "--tokenizer", str(tokenizer_gguf)]) == 0

    hf = load_model(tmp_path / "hf")
    assert hf.config.architecture == tiny.gguf_arch
    assert hf.config.attention_bias == tiny.bias
    assert (hf.config.num_layers, hf.config.num_heads, hf.config.num_kv_heads) == (2, 4, 2)
    text = "Tenant isolation: a request reads only its own pages."
    assert load_tokenizer(tmp_path / "hf").encode(text) == load_tokenizer(tokenizer_gguf).encode(text)
    for qtype, tolerance in (("Q8_0", 0.01), ("Q4_1", 0.15)):
        q = load_model(tmp_path / f"model.{qtype}.gguf")
        assert q.config.architecture == hf.config.architecture
        assert q.tokenizer.encode(text) == hf.tokenizer.encode(text)
        assert set(q.weights) == set(hf.weights)
        for key, w in hf.weights.items():
            err = (q.weights[key] - w).norm() / w.norm()
            assert err < tolerance, (qtype, key, float(err))  # a wrong permutation gives ~1.4


def test_existing_files_are_kept(tmp_path: Path) -> None:
    tokenizer_gguf = require_default_model()
    ms = _module()
    ms.SHAPES["tiny"] = dataclasses.replace(ms.SHAPES["llama1b"], hidden=64, layers=1, heads=2, kv_heads=1,
                                            intermediate=128)  # fmt: skip
    assert ms.main(["tiny", str(tmp_path), "--tokenizer", str(tokenizer_gguf), "--gguf", "Q8_0"]) == 0
    before = (tmp_path / "model.Q8_0.gguf").stat().st_mtime_ns
    assert ms.main(["tiny", str(tmp_path), "--tokenizer", str(tokenizer_gguf), "--gguf", "Q8_0"]) == 0
    assert (tmp_path / "model.Q8_0.gguf").stat().st_mtime_ns == before
    assert torch.equal(load_model(tmp_path / "hf").weights["model.norm.weight"], torch.ones(64))
