"""Linear layers on the GGUF's own Q4_1 / Q8_0 blocks (kvfence/model/kernels `quant_linear`): the loader keeps
the blocks of exactly the weights it dequantizes, the kernel multiplies by them as float32 would (to bfloat16
rounding), and a bfloat16 model uses them for steps of few rows without changing what it computes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvfence.model.loader import QuantBlocks, load_model
from tests.kernel_ops import kernel_ops
from tests.model_factory import write_tiny_gguf

OPS = kernel_ops()  # skips the module without the kernels, fails instead under `make test`


def blocks_of(w: np.ndarray, kind: str) -> tuple[QuantBlocks, torch.Tensor]:
    """`w` [N, K] quantized as llama.cpp does, split for the kernel, and what it dequantizes to (float32)."""
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype)
    exact = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    return QuantBlocks.split(raw, kind), exact


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [32, 64, 96, 128, 576])  # last group of 4 blocks: 1, 2, 3, 4 and 2 (18 blocks)
@pytest.mark.parametrize("n", [1, 5, 37])  # columns left over after tiles of 4 and 2
def test_matches_float32_on_the_dequantized_weight(kind, k, n):
    rng = np.random.default_rng(k * 100 + n)
    w = (
        rng.standard_normal((n, k)).astype(np.float32) * 0.05
        + rng.standard_normal((n, 1)).astype(np.float32) * 0.02
    )
    blocks, exact = blocks_of(w, kind)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17):  # every row tile, and more rows than one tile
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).bfloat16()
        out = OPS.quant_linear(x, blocks.qs, blocks.d, blocks.m, blocks.kind_id)
        ref = x.float() @ exact.T
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        # one rounding to bfloat16 of a float32 sum: within 2^-8 of each value, plus float32 noise
        torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-4 * float(ref.abs().max()) + 1e-6)


def test_reads_a_row_of_strided_activations_and_refuses_bad_shapes():
    rng = np.random.default_rng(0)
    blocks, exact = blocks_of(rng.standard_normal((8, 64)).astype(np.float32), "Q4_1")
    wide = torch.from_numpy(rng.standard_normal((3, 96)).astype(np.float32)).bfloat16()
    x = wide[:, :64]  # rows of a wider tensor, as the model's views are
    out = OPS.quant_linear(x, blocks.qs, blocks.d, blocks.m, blocks.kind_id)
    torch.testing.assert_close(out.float(), x.float() @ exact.T, rtol=2**-8, atol=1e-5)
    with pytest.raises(RuntimeError, match="block shapes"):
        OPS.quant_linear(wide, blocks.qs, blocks.d, blocks.m, blocks.kind_id)  # K of 96 against blocks of 64
    with pytest.raises(RuntimeError, match="kind"):
        OPS.quant_linear(x, blocks.qs, blocks.d, blocks.m, 7)
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.quant_linear(x.float(), blocks.qs, blocks.d, blocks.m, blocks.kind_id)


def test_loader_keeps_the_blocks_of_exactly_the_weights_it_dequantizes(tmp_path):
    """Every kept block set dequantizes to the float32 weight the loader gives, q/k rows un-permuted like the
    weights; only a bfloat16 load keeps blocks, and only of Q4_1/Q8_0 tensors."""
    path = write_tiny_gguf(
        tmp_path / "m.gguf", qtype="Q4_1", tie=True, seed=3, qtype_overrides={"token_embd.weight": "Q8_0"}
    )
    loaded = load_model(path, dtype=torch.bfloat16)  # blocks are kept for the bfloat16 kernels only
    exact = load_model(path)
    assert exact.quantized == {}
    assert "model.layers.0.self_attn.q_proj.weight" in loaded.quantized
    assert loaded.quantized["model.embed_tokens.weight"].kind == "Q8_0"
    for name, b in loaded.quantized.items():
        n, k = b.shape
        q = b.qs.numpy().reshape(n, k // 32, -1)
        if b.kind == "Q4_1":
            q = np.concatenate([q & 0x0F, q >> 4], axis=2).astype(np.float32)
            w = b.d.float().numpy()[:, :, None] * q + b.m.float().numpy()[:, :, None]
        else:
            w = b.d.float().numpy()[:, :, None] * q.view(np.int8).astype(np.float32)
        np.testing.assert_array_equal(w.reshape(n, k), exact.weights[name].numpy(), err_msg=name)
    f16 = write_tiny_gguf(tmp_path / "f.gguf", qtype="F16")
    assert load_model(f16, dtype=torch.bfloat16).quantized == {}


def test_bfloat16_model_multiplies_by_the_blocks_for_few_rows(tmp_path):
    """The fused projections and the tied head carry the blocks; decoding with them gives the logits of the
    bfloat16 weights within bfloat16 rounding, and greedy choices agree with float32."""
    from kvfence.model import llama
    from kvfence.model.llama import LlamaForCausalLM, PackedLinear
    from tests.test_forward import run_paged

    path = write_tiny_gguf(
        tmp_path / "m.gguf", qtype="Q4_1", tie=True, seed=5, qtype_overrides={"token_embd.weight": "Q8_0"}
    )
    loaded = load_model(path, dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_weights(
        loaded.config, loaded.weights, torch.bfloat16, "cpu", loaded.quantized
    )
    linears = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert all(m.quant is not None for m in linears.values()), [
        n for n, m in linears.items() if m.quant is None
    ]
    assert linears["model.layers.0.self_attn.qkv_proj"].quant.shape == (
        linears["model.layers.0.self_attn.qkv_proj"].out_features,
        loaded.config.hidden_size,
    )
    assert linears["lm_head"].quant.kind == "Q8_0"

    ids = torch.randint(
        0, loaded.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    chunks = [20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    blocks = run_paged(loaded, ids, chunks, dtype=torch.bfloat16)
    saved = dict(llama.QUANT_MAX_ROWS)
    try:
        llama.QUANT_MAX_ROWS.update(dict.fromkeys(saved, 0))  # never the blocks: the bfloat16 weights
        weights = run_paged(loaded, ids, chunks, dtype=torch.bfloat16)
    finally:
        llama.QUANT_MAX_ROWS.update(saved)
    assert not torch.equal(blocks[20:], weights[20:])  # the decode steps really took the blocks
    torch.testing.assert_close(blocks, weights, atol=5e-2, rtol=5e-2)
    f32 = run_paged(load_model(path), ids, chunks, dtype=torch.float32)
    assert (blocks.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.9
