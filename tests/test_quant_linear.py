"""Linear layers on the GGUF's own Q4_1 / Q8_0 blocks (kvfence/model/kernels `quant_linear`): the loader keeps
the blocks of exactly the weights it dequantizes, the kernel multiplies by them as float32 would (to bfloat16
rounding), and a bfloat16 model uses them for steps of few rows without changing what it computes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvfence.config import KernelOptions
from kvfence.model import kernels
from kvfence.model.loader import load_model
from kvfence.model.quant import QuantBlocks, QuantPanels
from tests.kernel_ops import kernel_ops, kernel_options
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


def tiny_quantized_model(tmp_path, int8="decode"):
    """A tiny tied GGUF model (Q4_1 layers, Q8_0 embedding and head) loaded in bfloat16 with its blocks attached
    as `int8` says (`KernelOptions.int8`): (path, loaded, model)."""
    from kvfence.model.llama import LlamaForCausalLM

    path = write_tiny_gguf(
        tmp_path / "m.gguf", qtype="Q4_1", tie=True, seed=5, qtype_overrides={"token_embd.weight": "Q8_0"}
    )
    loaded = load_model(path, dtype=torch.bfloat16, kernels=kernel_options(int8=int8))
    model = LlamaForCausalLM.from_loaded(loaded, torch.bfloat16, "cpu")
    return path, loaded, model


@pytest.mark.parametrize("mode", ["0", "decode", "all"])
def test_bfloat16_model_multiplies_by_the_blocks(tmp_path, mode):
    """The fused projections and the tied head carry the blocks: as the GGUF lays them out for bfloat16
    activations (int8 "0"), or as panels for int8 ones (`decode`, the default: few-row steps only; `all`:
    every step, and the bfloat16 weight is dropped). Logits stay within bfloat16-class error of the bfloat16 weights'
    and greedy choices agree with float32."""
    from kvfence.model import linears as linear_layers
    from kvfence.model.linears import PackedLinear
    from tests.test_forward import run_paged

    path, loaded, model = tiny_quantized_model(tmp_path, mode)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    if not linear_layers.onednn_bf16_packing():  # oneDNN capped below AVX512-BW: plain layers, no blocks
        assert not linears and isinstance(model.model.layers[0].mlp.gate_up_proj, torch.nn.Linear)
        return
    int8 = mode != "0" and OPS.panel_vnni()  # without AVX512-VNNI and BF16 the model takes `quant_linear`
    taken = {n: (m.panels if int8 else m.quant) for n, m in linears.items()}
    assert all(t is not None for t in taken.values()), [n for n, t in taken.items() if t is None]
    head = model.lm_head
    assert isinstance(head, linear_layers.OutputHead) and "lm_head" not in linears
    qkv = linears["model.layers.0.self_attn.qkv_proj"]
    if not int8:
        assert qkv.quant.shape == (qkv.out_features, loaded.config.hidden_size) and qkv.panels is None
        # the head multiplies by the embedding's own bfloat16 tensor (float32 sums), no copy of it
        assert head.panels is None and head.weight is model.model.embed_tokens.weight
    else:
        assert qkv.panels.n == qkv.out_features and qkv.quant is None
        # a bfloat16 weight kept only where prefills still use it: oneDNN's, or the AMX tiles' (`tile_linear`)
        assert (qkv.packed_weight.numel() == 0) == (mode == "all" or qkv.tiles is not None)
        assert (qkv.tiles is not None) == (mode != "all" and model.backend.tiles)
        assert head.panels.kind == "Q8_0" and head.weight.numel() == 0  # the blocks for every step

    ids = torch.randint(
        0, loaded.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    chunks = [20, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    blocks = run_paged(loaded, ids, chunks, dtype=torch.bfloat16)
    # never the blocks: the bfloat16 weights
    weights = run_paged(
        loaded, ids, chunks, dtype=torch.bfloat16, kernels=kernel_options(quant_kernels=False)
    )
    assert not torch.equal(blocks[20:], weights[20:])  # the decode steps really took the blocks
    # the 20-token prefill is longer than FINE_MAX_ROWS: oneDNN's bfloat16 with `decode`, one int8 level with `all`
    assert linear_layers.FINE_MAX_ROWS < 20
    tolerance = 1e-1 if mode == "all" else 5e-2
    torch.testing.assert_close(blocks, weights, atol=tolerance, rtol=tolerance)
    f32 = run_paged(load_model(path), ids, chunks, dtype=torch.float32)
    assert (blocks.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.9


def panels_of(w: np.ndarray, kind: str) -> tuple[QuantPanels, torch.Tensor]:
    blocks, exact = blocks_of(w, kind)
    return blocks.panels(), exact


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [32, 96, 576])
@pytest.mark.parametrize("n", [1, 17, 48])  # a partial panel, whole panels and pairs of them
def test_panel_linear_matches_float32_on_the_dequantized_weight(kind, k, n):
    """Two int8 levels are as close to float32 as bfloat16 activations (one rounding of the output); one level
    within a few percent, llama.cpp's precision."""
    rng = np.random.default_rng(k * 100 + n)
    w = (
        rng.standard_normal((n, k)).astype(np.float32) * 0.05
        + rng.standard_normal((n, 1)).astype(np.float32) * 0.02
    )
    panels, exact = panels_of(w, kind)
    for rows in (1, 2, 3, 4, 5, 9, 17):  # every row tile and the rows left over
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).bfloat16()
        ref = x.float() @ exact.T
        for levels, rtol in ((2, 2**-8), (1, 2**-5)):
            out = OPS.panel_linear(x, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            torch.testing.assert_close(out.float(), ref, rtol=rtol, atol=rtol * float(ref.abs().max()) + 1e-6)


@pytest.mark.parametrize("levels", [1, 2])
def test_panel_linear_rows_do_not_depend_on_each_other(levels):
    """Each row's result is a function of that row alone (integer sums, fixed order): the same bits alone, in
    any batch and at any position, so a request's output does not depend on who shares its step."""
    rng = np.random.default_rng(7)
    panels, _ = panels_of(rng.standard_normal((40, 64)).astype(np.float32), "Q4_1")
    x = torch.from_numpy(rng.standard_normal((13, 64)).astype(np.float32)).bfloat16()
    whole = OPS.panel_linear(x, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels)
    for r in range(13):
        alone = OPS.panel_linear(
            x[r : r + 1], panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels
        )
        assert torch.equal(alone[0], whole[r]), r
    shuffled = OPS.panel_linear(x.flip(0), panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels)
    assert torch.equal(shuffled.flip(0), whole)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_panel_linear_turns_exactly_the_rows_with_a_nan_into_nan(kind):
    rng = np.random.default_rng(3)
    panels, _ = panels_of(rng.standard_normal((20, 64)).astype(np.float32), kind)
    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32)).bfloat16()
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    for levels in (1, 2):
        out = OPS.panel_linear(x, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels)
        assert out[1].isnan().all() and out[2].isnan().all(), levels
        assert out[0].isfinite().all() and out[3].isfinite().all(), levels


def test_panel_linear_refuses_bad_shapes_and_reads_strided_rows():
    rng = np.random.default_rng(0)
    panels, exact = panels_of(rng.standard_normal((8, 64)).astype(np.float32), "Q4_1")
    wide = torch.from_numpy(rng.standard_normal((3, 96)).astype(np.float32)).bfloat16()
    x = wide[:, :64]
    out = OPS.panel_linear(x, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, 2)
    torch.testing.assert_close(out.float(), x.float() @ exact.T, rtol=2**-8, atol=1e-4)
    with pytest.raises(RuntimeError, match="panel shapes"):
        OPS.panel_linear(wide, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, 2)
    with pytest.raises(RuntimeError, match="levels"):
        OPS.panel_linear(x, panels.wp, panels.d, panels.m, panels.kind_id, panels.n, 3)
    with pytest.raises(RuntimeError, match="kind"):
        OPS.panel_linear(x, panels.wp, panels.d, panels.m, 7, panels.n, 2)
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.panel_linear(x.float(), panels.wp, panels.d, panels.m, panels.kind_id, panels.n, 2)
    # built with -march=native: the vector path exists exactly where the CPU has both instruction sets
    flags = kernels.cpu_flags().split()
    if KernelOptions.from_env().kernels_march == "native":
        assert OPS.panel_vnni() == (b"avx512_vnni" in flags and b"avx512_bf16" in flags)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("levels", [1, 2])
def test_panel_linear_vector_path_equals_the_scalar_one(kind, levels):
    """The scalar path (CPUs without AVX512-VNNI and BF16) does the same float operations in the same order as the
    vector one: equal bits on every shape the vector path tiles differently, and on NaN and tiny rows. Where the
    vector path is not built, both calls run the scalar path and this only checks that it runs."""
    rng = np.random.default_rng(11)
    for k, n in ((32, 1), (96, 17), (576, 48), (64, 37)):
        panels, _ = panels_of(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
        for rows in (1, 2, 3, 4, 5, 6, 9, 11, 16, 17):
            x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).bfloat16()
            x[rows // 2, k // 3] = float("nan")
            x[-1] *= 1e-36  # blocks below MIN_AMAX: flushed to zero by both
            args = (panels.wp, panels.d, panels.m, panels.kind_id, panels.n, levels)
            vector, scalar = OPS.panel_linear(x, *args), OPS.panel_linear_scalar(x, *args)
            torch.testing.assert_close(vector, scalar, rtol=0, atol=0, equal_nan=True, msg=f"{k} {n} {rows}")
            # the output head's float32 logits: the same sums, not rounded (the bfloat16 outputs are their rounding)
            vector32 = OPS.panel_linear_f32(x, *args)
            scalar32 = OPS.panel_linear_scalar(x, *args, out_f32=True)
            assert vector32.dtype == scalar32.dtype == torch.float32
            torch.testing.assert_close(
                vector32, scalar32, rtol=0, atol=0, equal_nan=True, msg=f"{k} {n} {rows}"
            )
            finite = torch.isfinite(vector32) & (vector32.abs() > 1e-30)  # past bfloat16's flushed denormals
            assert torch.equal(vector32.bfloat16()[finite], vector[finite])


def test_float32_linear_slices_equal_one_float32_matmul():
    """The torch path's head upcasts the weight a slice of rows at a time: every slice boundary (7 rows, and a last
    slice of 3) gives what one float32 matmul of the whole weight gives."""
    from kvfence.model.linears import float32_linear

    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(45, 64, generator=g).bfloat16(), torch.randn(5, 64, generator=g).bfloat16()
    out = float32_linear(x, w, slice_rows=7)
    assert out.dtype == torch.float32 and out.shape == (5, 45)
    torch.testing.assert_close(out, x.float() @ w.float().T, rtol=1e-6, atol=1e-5)
    assert torch.equal(float32_linear(x.float(), w.float(), slice_rows=7), x.float() @ w.float().T)


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("k,n", [(32, 1), (64, 37), (576, 130), (96, 65)])
def test_linear_f32_is_float32_precise_on_bfloat16_inputs(k, n, tiles):
    """The output head's kernel on bfloat16 weights, on AMX tiles (where the CPU has them) and on AVX512-BF16:
    products of bfloat16 pairs are exact and sums stay float32, so logits are within float32 noise of a float64
    reference, never rounded to bfloat16 (issue 20: a 0.08 gap at a logit of 25 became an exact tie in bfloat16,
    and the lower token id won)."""
    rng = np.random.default_rng(k + n)
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).bfloat16()
    for rows in (1, 3, 8, 9, 16, 20, 33, 50):  # one row tile, several, and the rows left over (8s and 16s)
        x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32) * 4).bfloat16()
        out = OPS.linear_f32(x, w, tiles)
        ref = x.double() @ w.double().T
        assert out.dtype == torch.float32 and out.shape == (rows, n)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert not torch.equal(out, out.bfloat16().float())  # not rounded to bfloat16
    strided = torch.from_numpy(rng.standard_normal((3, k + 32)).astype(np.float32)).bfloat16()[:, :k]
    torch.testing.assert_close(
        OPS.linear_f32(strided, w, tiles).double(), strided.double() @ w.double().T, rtol=1e-5, atol=1e-4
    )
    with pytest.raises(RuntimeError, match="K"):
        OPS.linear_f32(x[:, : k - 16], w, tiles)
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.linear_f32(x, w.float(), tiles)


@pytest.mark.parametrize("tiles", [True, False])
def test_linear_f32_rows_do_not_depend_on_the_batch(tiles):
    """A row's logits are the same bits whatever rows share its call and wherever it sits among them (first of
    a tile, last, alone): one request's greedy answer does not move with other tenants' load (I2's spirit for
    the head). The tile path computes logits^T with the hidden rows as its right operand, so this checks that
    padding and the second product tile change nothing."""
    rng = np.random.default_rng(3)
    k, n = 96, 70  # vocabulary rows not a multiple of the 32 a tile step takes
    w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).bfloat16()
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32)).bfloat16()
    alone = torch.cat([OPS.linear_f32(x[i : i + 1], w, tiles) for i in range(len(x))])
    for rows in (2, 15, 16, 17, 32, 33, 40):
        assert torch.equal(OPS.linear_f32(x[:rows], w, tiles), alone[:rows]), rows
    shuffled = torch.from_numpy(rng.permutation(len(x)))
    assert torch.equal(OPS.linear_f32(x[shuffled], w, tiles), alone[shuffled])


def test_linear_f32_takes_tiles_exactly_where_the_cpu_has_amx():
    """Built with -march=native, the tile path exists where the CPU has AMX-BF16 (Intel Sapphire Rapids and later;
    the AMD machines take AVX512-BF16). Both paths' float32 sums agree to float32 noise."""
    flags = kernels.cpu_flags().split()
    if KernelOptions.from_env().kernels_march == "native":
        assert OPS.head_tiles() == (b"amx_bf16" in flags and b"amx_tile" in flags)
    rng = np.random.default_rng(5)
    w = torch.from_numpy(rng.standard_normal((300, 576)).astype(np.float32)).bfloat16()
    x = torch.from_numpy(rng.standard_normal((24, 576)).astype(np.float32)).bfloat16()
    torch.testing.assert_close(OPS.linear_f32(x, w, True), OPS.linear_f32(x, w, False), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scalar", [False, True])
def test_panel_linear_flushes_tiny_blocks_and_keeps_huge_finite_rows(scalar):
    """A block whose largest value is below MIN_AMAX (3.9e-34) counts as zeros, as denormals flushed to zero would:
    its quants are not computed from an infinite 127 / max|x| (which made them -128 and flipped the sign). A finite
    row whose block sums overflow float32 stays finite (Q8_0; Q4_1 multiplies m by the block's sum, which does
    overflow there, as it would in float32). Only NaN and infinities make a row NaN."""
    rng = np.random.default_rng(5)
    q8, exact8 = panels_of(rng.standard_normal((20, 64)).astype(np.float32) * 0.05, "Q8_0")
    q4, exact4 = panels_of(rng.standard_normal((20, 64)).astype(np.float32) * 0.05, "Q4_1")
    linear = OPS.panel_linear_scalar if scalar else OPS.panel_linear
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32)).bfloat16()
    x[0] = torch.full((64,), 1e-37).bfloat16()  # tiny everywhere
    x[1, 32:] = torch.from_numpy(
        rng.uniform(1e-38, 1e-37, 32).astype(np.float32)
    ).bfloat16()  # one tiny block
    x[2] = torch.full((64,), 2e37).bfloat16() * torch.from_numpy(
        rng.choice([-1.0, 1.0], 64).astype(np.float32)
    )
    for levels in (1, 2):
        for p, exact in ((q8, exact8), (q4, exact4)):
            out = linear(x, p.wp, p.d, p.m, p.kind_id, p.n, levels)
            assert torch.equal(out[0], torch.zeros_like(out[0])), (p.kind, levels)
            ref = x[1:2].float() @ exact.T
            rtol = 2**-8 if levels == 2 else 2**-5
            torch.testing.assert_close(out[1:2].float(), ref, rtol=rtol, atol=rtol * float(ref.abs().max()))
        huge = linear(x[2:], q8.wp, q8.d, q8.m, q8.kind_id, q8.n, levels)
        ref = x[2:].float() @ exact8.T
        assert huge.isfinite().all(), levels
        rtol = 2**-8 if levels == 2 else 2**-5
        torch.testing.assert_close(huge.float(), ref, rtol=rtol, atol=rtol * float(ref.abs().max()))


class RecordingOps:
    """The kernels' wrappers, with every panel_linear call recorded as (rows, levels)."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        return getattr(self.ops, name)

    def panel_linear(self, x, panels, levels):
        self.calls.append((x.shape[0], levels))
        return self.ops.panel_linear(x, panels, levels)

    def panel_linear_f32(self, x, panels, levels):
        self.calls.append((x.shape[0], levels, "f32"))
        return self.ops.panel_linear_f32(x, panels, levels)


@pytest.mark.parametrize("mode", ["decode", "all"])
def test_each_step_size_takes_its_path(tmp_path, mode):
    """Up to FINE_MAX_ROWS rows: two int8 levels. Beyond: oneDNN on the bfloat16 weight (`decode`) or one level
    (`all`); the output head, whose bfloat16 weight is gone in both, two levels up to HEAD_FINE_MAX_ROWS and one
    beyond, with float32 logits. Without
    AVX512-VNNI and BF16 no step takes panels: the layers keep their blocks for `quant_linear`, and the head its
    bfloat16 weight for `linear_f32`."""
    from kvfence.model.linears import FINE_MAX_ROWS, HEAD_FINE_MAX_ROWS, onednn_bf16_packing

    _, loaded, model = tiny_quantized_model(tmp_path, mode)
    layer, head = model.model.layers[0].mlp.gate_up_proj, model.lm_head
    if not onednn_bf16_packing():  # oneDNN capped below AVX512-BW: the layers stay plain and take no blocks
        assert isinstance(layer, torch.nn.Linear) and not hasattr(layer, "panels")
        return
    if not OPS.panel_vnni():
        assert layer.panels is None and head.panels is None
        assert layer.quant is not None and head.weight.numel() > 0
        return
    for module in (layer, head):
        module.kernels = RecordingOps(module.kernels)
    hidden = loaded.config.hidden_size
    for rows in sorted({1, HEAD_FINE_MAX_ROWS, HEAD_FINE_MAX_ROWS + 1, FINE_MAX_ROWS, FINE_MAX_ROWS + 1, 30}):
        x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for module in (layer, head):
            module.kernels.calls.clear()
            module(x)
        fine = rows <= FINE_MAX_ROWS
        assert layer.kernels.calls == ([(rows, 2)] if fine else [] if mode == "decode" else [(rows, 1)]), rows
        assert head.kernels.calls == [(rows, 2 if rows <= HEAD_FINE_MAX_ROWS else 1, "f32")], rows


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_panel_shapes_are_those_of_the_panels(kind):
    """The loader places every layer's panels in one buffer before repacking them (`hugepages.slots`), from
    `panel_shapes`: it must say exactly what `panels()` makes."""
    rng = np.random.default_rng(2)
    for n, k in ((1, 32), (17, 96), (48, 64)):
        blocks, _ = blocks_of(rng.standard_normal((n, k)).astype(np.float32), kind)
        p = blocks.panels()
        assert blocks.panel_shapes() == tuple((tuple(t.shape), t.dtype) for t in (p.wp, p.d, p.m))
