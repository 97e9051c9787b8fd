"""The AMX tile kernels (`--amx-tiles`): bfloat16 linear layers (kvfence/model/kernels/tile_linear.cpp), the weight
packed once at load and every step multiplied on the tile unit, and prefill attention (tile_attention.cpp). The
linear kernel rounds float32 sums once, as oneDNN's product does, and a row's outputs do not depend on the other
rows of its step; the attention kernel is the C++ kernel's attention (float32 softmax, bfloat16 probabilities),
and no query sees a key past its own, also where the values hold NaN. A model on the tiles computes what oneDNN's
layers and torch's attention compute, to bfloat16 rounding. Where the CPU has no AMX (AMD Zen4) the model keeps
those, and the kernels' own tests skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kvfence.model.kernels.ops import KernelOps
from kvfence.model.linears import PackedLinear, interleave_gated, onednn_bf16_packing
from kvfence.model.llama import LlamaForCausalLM
from kvfence.model.loader import load_model
from tests.kernel_ops import kernel_ops, kernel_options
from tests.model_factory import write_tiny_hf_dir
from tests.test_forward import run_paged
from tests.test_kernels import prefill_case, prefill_reference

OPS = kernel_ops()
amx = pytest.mark.skipif(
    not OPS.head_tiles(), reason="no AMX tiles on this CPU: the layers keep oneDNN's product"
)


def bf16(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale).bfloat16()


@amx
@pytest.mark.parametrize("k,n", [(32, 32), (128, 96), (896, 1152), (4864, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_tile_linear_is_a_float32_sum_rounded_once(k, n, bias):
    """Within one bfloat16 rounding (plus float32 noise) of a float64 reference, for every row count around the
    tiles' 16 and the chunks' 32, with and without a bias added before the rounding."""
    rng = np.random.default_rng(k + n + bias)
    w = bf16(rng, n, k, scale=0.05)
    b = bf16(rng, n) if bias else None
    packed = OPS.pack_tiles(w)
    assert packed.shape == (n // 32, k // 32, 16, 64)
    for rows in (1, 2, 15, 16, 17, 31, 32, 33, 64, 100):
        x = bf16(rng, rows, k)
        out = OPS.tile_linear(x, packed, None if b is None else b.float(), 0)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        scale = float(ref.abs().max())
        torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-5 * scale)
        # mostly the very bfloat16 value of the float32 sum: the same rounding, only the order of the sum differs
        assert (out == ref.float().bfloat16()).float().mean() > 0.99


@amx
def test_tile_linear_rows_do_not_depend_on_the_batch_or_the_pass_size():
    """A row's outputs are the same bits alone, among others, anywhere in a tile or a chunk, and whatever rows per
    pass (`m_block`) the kernel takes: a request's answer does not move with the other tenants' load, and a prompt
    chunked differently gets the same projections."""
    rng = np.random.default_rng(7)
    w, b = bf16(rng, 96, 256, scale=0.05), torch.randn(96, generator=torch.Generator().manual_seed(1))
    packed = OPS.pack_tiles(w)
    x = bf16(rng, 70, 256)
    alone = torch.cat([OPS.tile_linear(x[i : i + 1], packed, b, 0) for i in range(len(x))])
    for rows in (2, 15, 16, 17, 32, 33, 48, 70):
        for m_block in (0, 32, 64, 1024):
            assert torch.equal(OPS.tile_linear(x[:rows], packed, b, m_block), alone[:rows]), (rows, m_block)
    shuffled = torch.from_numpy(rng.permutation(len(x)))
    assert torch.equal(OPS.tile_linear(x[shuffled], packed, b, 0), alone[shuffled])


@amx
def test_tile_linear_reads_strided_rows_and_refuses_what_does_not_fit():
    rng = np.random.default_rng(3)
    w = bf16(rng, 64, 128)
    packed = OPS.pack_tiles(w)
    wide = bf16(rng, 5, 160)
    assert torch.equal(
        OPS.tile_linear(wide[:, :128], packed, None, 0),
        OPS.tile_linear(wide[:, :128].contiguous(), packed, None, 0),
    )
    assert OPS.tile_linear(wide[:0, :128], packed, None, 0).shape == (0, 64)
    with pytest.raises(RuntimeError, match="columns"):
        OPS.tile_linear(wide, packed, None, 0)  # K of 160 against a weight of 128
    with pytest.raises(RuntimeError, match="m_block"):
        OPS.tile_linear(wide[:, :128], packed, None, 48)
    with pytest.raises(RuntimeError, match="bias"):
        OPS.tile_linear(wide[:, :128], packed, torch.zeros(63), 0)
    with pytest.raises(RuntimeError, match="packed"):
        OPS.tile_linear(wide[:, :128], w, None, 0)  # not packed
    with pytest.raises(RuntimeError, match="multiples of 32"):
        OPS.pack_tiles(bf16(rng, 48, 128))


@amx
@pytest.mark.parametrize("k,inter", [(32, 16), (128, 48), (896, 4864)])
def test_gated_tiles_are_silu_of_the_gate_times_the_up_rounded_once(k, inter):
    """The MLP's [gate | up] layer packed gated (gate and up rows interleaved 16 by 16): one call gives silu(gate)
    * up of the float32 sums, rounded once, within a bfloat16 rounding of a float64 reference, and a row's
    outputs do not depend on the other rows; the layer's own forward still returns [gate | up] in its order, the
    same bits as the plain packing."""
    rng = np.random.default_rng(k + inter)
    w = bf16(rng, 2 * inter, k, scale=0.05)
    gated = OPS.pack_tiles(interleave_gated(w))
    x = bf16(rng, 70, k)
    g, u = (x.double() @ w.double().T).split(inter, dim=1)
    ref = g * torch.sigmoid(g) * u
    alone = torch.cat([OPS.tile_linear(x[i : i + 1], gated, None, 0, True) for i in range(len(x))])
    for rows in (1, 15, 16, 17, 32, 33, 70):
        out = OPS.tile_linear(x[:rows], gated, None, 0, True)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, inter)
        assert torch.equal(out, alone[:rows]), rows
        torch.testing.assert_close(out.double(), ref[:rows], rtol=2**-7, atol=1e-4 * float(ref.abs().max()))
    layer = PackedLinear.on_tiles(nn.Linear(k, 2 * inter, bias=False), gated, KernelOps(OPS), gated=True)
    assert torch.equal(layer(x), OPS.tile_linear(x, OPS.pack_tiles(w), None, 0))
    assert torch.equal(layer.silu_mul(x, KernelOps(OPS)), alone)
    with pytest.raises(RuntimeError, match="no bias"):
        OPS.tile_linear(x, gated, torch.zeros(2 * inter), 0, True)


def build(path, **changes):
    loaded = load_model(path, torch.bfloat16, kernels=kernel_options(**changes))
    return loaded, LlamaForCausalLM.from_loaded(loaded, torch.bfloat16, "cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, added before the rounding
def test_a_model_on_tiles_computes_what_oneDNN_computes(tmp_path, monkeypatch, arch):
    """Every projection of a bfloat16 model, the attention of every prefill chunk and decode attention (pages of
    16 tokens) take the tiles where the CPU has AMX (the packed weights in one buffer, oneDNN's copy not kept),
    and none where it has not or `--no-amx-tiles` says so. The logits of a prompt prefilled in two chunks and
    decoded a token at a time stay within bfloat16-class error of oneDNN's and torch's, and the greedy choices
    agree where they are not near-ties. (The bits differ: the MLP's silu takes the gate and up sums before their
    rounding on the tiles, and decode attention weighs V with bfloat16 probabilities there.)"""
    # heads of 32 dims: the attention kernel's tiles take multiples of 32
    path = write_tiny_hf_dir(tmp_path / arch, arch=arch, seed=4, hidden_size=128, head_dim=32)
    loaded, model = build(path, amx_tiles=True)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert bool(linears) == onednn_bf16_packing()
    on_tiles = OPS.head_tiles() and bool(
        linears
    )  # linear layers: only where oneDNN packs (no PackedLinear else)
    attention_on_tiles = OPS.head_tiles()  # attention: wherever the CPU has AMX, whatever oneDNN's cap
    assert model.backend.tiles == OPS.head_tiles()
    assert all(layer.self_attn.tiles == attention_on_tiles for layer in model.model.layers)
    assert all((m.tiles is not None) == on_tiles for m in linears)
    # the MLP's [gate | up] layer gated on the tiles (silu_mul in the same call), no other layer
    assert all(m.gated == (on_tiles and name.endswith("gate_up_proj")) for name, m in model.named_modules()
               if isinstance(m, PackedLinear))  # fmt: skip
    assert all((m.packed_weight.numel() == 0) == on_tiles for m in linears)
    if arch == "qwen2" and on_tiles:
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.bias_f32 is not None and qkv.bias_f32.dtype == torch.float32
    _, off = build(path, amx_tiles=False)
    assert not off.backend.tiles
    assert all(m.tiles is None for m in off.modules() if isinstance(m, PackedLinear))

    ids = torch.randint(
        0, loaded.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    calls, attention = [], []
    real, real_attention = KernelOps.tile_linear, KernelOps.prefill_attention_tiles
    monkeypatch.setattr(
        KernelOps, "tile_linear", lambda self, x, *a: calls.append(len(x)) or real(self, x, *a)
    )
    monkeypatch.setattr(
        KernelOps,
        "prefill_attention_tiles",
        lambda self, out, *a: attention.append(len(out)) or real_attention(self, out, *a),
    )
    chunks = [25, 8, 1, 1, 1, 1, 1, 1, 1]  # a first chunk, a later one over the first's pages, decodes
    # pages of 16 tokens: decode attention takes the tiles too (pages of a multiple of 16), the last one partial
    tiles = run_paged(loaded, ids, chunks, 16, dtype=torch.bfloat16, kernels=kernel_options(amx_tiles=True))
    # every projection of every layer, each step: the chunks' rows, then one row at a time; each layer's
    # attention of each chunk
    layers = loaded.config.num_layers
    assert calls == ([25] * 4 * layers + [8] * 4 * layers + [1] * 4 * layers * 7 if on_tiles else [])
    assert attention == ([25] * layers + [8] * layers if attention_on_tiles else [])
    calls.clear()
    attention.clear()
    onednn = run_paged(loaded, ids, chunks, 16, dtype=torch.bfloat16, kernels=kernel_options(amx_tiles=False))
    assert calls == [] and attention == []
    torch.testing.assert_close(tiles, onednn, rtol=0.05, atol=0.05 * float(onednn.abs().max()))
    # the greedy choices agree wherever oneDNN's top two logits are more than a bfloat16 step of the logits'
    # scale apart (this random model has ties 0.0004 apart, which either path may break either way)
    top = onednn.topk(2, dim=-1).values
    clear = top[:, 0] - top[:, 1] > 2**-8 * float(onednn.abs().max())
    assert clear.sum() >= 0.75 * len(clear)
    assert torch.equal(tiles.argmax(-1)[clear], onednn.argmax(-1)[clear])


@amx
def test_shapes_the_tiles_do_not_take_keep_onednn(tmp_path):
    """A layer whose sides are not multiples of 32 (here hidden 48: every projection) stays in oneDNN's layout,
    alone, while the model still loads and runs."""
    path = write_tiny_hf_dir(
        tmp_path / "odd", arch="llama", seed=4, hidden_size=48, num_heads=3, num_kv_heads=1, head_dim=16
    )
    loaded, model = build(path, amx_tiles=True)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert bool(linears) == onednn_bf16_packing()  # capped below AVX512-BW: plain layers
    assert all(m.tiles is None and m.packed_weight.numel() > 0 for m in linears.values())
    ids = list(range(3, 20))
    out = run_paged(loaded, ids, [17], dtype=torch.bfloat16, kernels=kernel_options(amx_tiles=True))
    assert torch.isfinite(out).all()


@amx
@pytest.mark.parametrize(
    "q_len,k_len,heads,kv_heads,head_dim",
    [(196, 196, 9, 3, 64), (7, 30, 4, 2, 32), (1, 1, 4, 4, 32), (100, 300, 8, 2, 128), (65, 65, 4, 2, 64),
     (33, 41, 4, 2, 256), (2, 37, 14, 2, 64), (32, 64, 4, 1, 64)],
)  # fmt: skip
def test_attention_on_tiles_matches_float32(q_len, k_len, heads, kv_heads, head_dim):
    """A first chunk (k_len == q_len) and later chunks (keys before the chunk); blocks of 32 queries and 32 keys
    cut anywhere, a block of fewer than 16 queries, head sizes of one to eight tiles of 32 dims, and the query
    heads that share each KV head."""
    q, k, v = prefill_case(q_len, k_len, heads, kv_heads, head_dim)
    out = torch.empty(q_len, heads, head_dim, dtype=torch.bfloat16)
    OPS.prefill_attention_tiles(out, q, k, v, head_dim**-0.5)
    torch.testing.assert_close(out.float(), prefill_reference(q, k, v, head_dim**-0.5), atol=1e-2, rtol=1e-2)


@amx
@pytest.mark.parametrize(
    ("q_len", "k_len", "bad", "what"),
    [(40, 41, 40, "kv"), (40, 40, 20, "kv"), (39, 45, 6, "kv"), (40, 42, 7, "kv"), (64, 64, 40, "v"),
     (64, 64, 33, "k"), (50, 80, 63, "v")],
)  # fmt: skip
def test_attention_on_tiles_never_lets_a_query_see_past_its_keys(q_len, k_len, bad, what):
    """NaN in one key's K and V (or only its V, or only its K): exactly the queries that see that key turn NaN,
    every other output is unchanged. On the tile unit 0 x NaN is NaN, so a block with a NaN value where some
    queries do not see every key must not weigh V there."""
    q, k, v = prefill_case(q_len, k_len, 4, 2, 64, seed=2)
    clean = torch.empty(q_len, 4, 64, dtype=torch.bfloat16)
    OPS.prefill_attention_tiles(clean, q, k, v, 0.125)
    k, v = k.clone(), v.clone()
    if "k" in what:
        k[bad] = float("nan")
    if "v" in what:
        v[bad] = float("nan")
    out = torch.empty_like(clean)
    OPS.prefill_attention_tiles(out, q, k, v, 0.125)
    first = max(0, bad - (k_len - q_len))  # query i sees keys 0 .. k_len - q_len + i
    assert torch.equal(out[:first], clean[:first]) and torch.isnan(out[first:]).all()


@amx
def test_attention_on_tiles_refuses_bad_shapes():
    q, k, v = prefill_case(40, 40, 4, 2, 64, seed=1)
    out = torch.empty(40, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="shapes"):
        OPS.prefill_attention_tiles(out, q, k[:30], v[:30], 0.125)  # fewer keys than queries
    q48, k48, v48 = prefill_case(8, 8, 2, 1, 48)
    with pytest.raises(RuntimeError, match="shapes"):
        OPS.prefill_attention_tiles(
            torch.empty(8, 2, 48, dtype=torch.bfloat16), q48, k48, v48, 0.1
        )  # Dh % 32
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.prefill_attention_tiles(out.float(), q.float(), k.float(), v.float(), 0.125)
    with pytest.raises(RuntimeError):
        OPS.prefill_attention_tiles(q, q, k, v, 0.125)  # out overlaps an input
