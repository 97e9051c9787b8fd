"""The C++ kernels (kvfence/model/kernels) against float32 references, and what decode attention may read.

Without the kernels the module is skipped, except under `make test`, where it fails (tests/kernel_ops.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernel_ops import kernel_ops, kernel_options

OPS = kernel_ops()

# decode attention on AMX tiles where the CPU has them, and its AVX-512 path (the only one elsewhere: tiles=True
# then falls back to it)
TILES = pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "avx512"])


def reference(q, kv, tables, lens, scale):
    """float32 attention of each row's query over the first lens[b] slots of its block table."""
    page_size, hkv, dh = kv.shape[2:]
    b, h, _ = q.shape
    out = torch.empty(b, h, dh)
    for row in range(b):
        slots = [int(tables[row, t // page_size]) * page_size + t % page_size for t in range(int(lens[row]))]
        k = kv[0].reshape(-1, hkv, dh)[slots].float().repeat_interleave(h // hkv, dim=1)  # [ctx, H, Dh]
        v = kv[1].reshape(-1, hkv, dh)[slots].float().repeat_interleave(h // hkv, dim=1)
        probs = torch.softmax(torch.einsum("hd,thd->ht", q[row].float(), k) * scale, dim=-1)
        out[row] = torch.einsum("ht,thd->hd", probs, v)
    return out


def random_case(heads, kv_heads, head_dim, lens, page_size=16, num_pages=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_pages, page_size, kv_heads, head_dim, generator=g).bfloat16()
    max_pages = max(-(-n // page_size) for n in lens) + 1  # one page of padding past the longest row
    tables = torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in lens])
    # q as the model has it: a strided view of a fused [B, H + Hkv, Dh] tensor
    q = torch.randn(len(lens), heads + kv_heads, head_dim, generator=g).bfloat16()[:, :heads]
    return q, kv, tables, torch.tensor(lens)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [
        (9, 3, 64),
        (8, 2, 32),
        (4, 2, 16),
        (6, 1, 48),
        (16, 2, 128),
        (4, 4, 64),
        (14, 2, 64),
        (7, 1, 192),
        (16, 1, 64),
        (32, 1, 64),
    ],
)
@TILES
def test_decode_attention_matches_float32(heads, kv_heads, head_dim, tiles):
    lens = [1, 15, 16, 17, 64, 230]  # a single token, page edges, several pages
    q, kv, tables, ctx = random_case(heads, kv_heads, head_dim, lens)
    out = torch.empty(len(lens), heads, head_dim, dtype=torch.bfloat16)
    OPS.paged_decode_attention(out, q, kv, tables, ctx, head_dim**-0.5, tiles=tiles)
    expected = reference(q, kv, tables, ctx, head_dim**-0.5)
    # float32 inside, one bfloat16 rounding at the end: within two bfloat16 steps of the exact result
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    if tiles and OPS.attention_tiles() and head_dim % 32 == 0 and heads // kv_heads <= 16:
        # the tile path ran (its bfloat16 probabilities give other bits than the AVX-512 path's float32 ones)
        other = torch.empty_like(out)
        OPS.paged_decode_attention(other, q, kv, tables, ctx, head_dim**-0.5, tiles=False)
        assert not torch.equal(out, other)


@pytest.mark.parametrize("page_size", [1, 4, 32])
@TILES
def test_decode_attention_any_page_size(page_size, tiles):
    """The kernel scores 16 tokens at a time whatever the page size: blocks that span pages, or half a page. (The
    tile path takes pages of a multiple of 16 tokens: here 32; 1 and 4 fall back to AVX-512.)"""
    lens = [1, 7, 16, 33, 100]
    q, kv, tables, ctx = random_case(9, 3, 64, lens, page_size=page_size, num_pages=400 // page_size + 8)
    out = torch.empty(len(lens), 9, 64, dtype=torch.bfloat16)
    OPS.paged_decode_attention(out, q, kv, tables, ctx, 0.125, tiles=tiles)
    torch.testing.assert_close(out.float(), reference(q, kv, tables, ctx, 0.125), atol=1e-2, rtol=1e-2)


LONG_LENS = [
    230,
    1023,
    1024,
    1025,
    2047,
    3,
    2049,
    1999,
]  # one span, span edges, three spans, among short rows


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (14, 2, 64), (8, 2, 32), (6, 1, 48)])
@TILES
def test_decode_attention_of_long_rows_matches_float32(heads, kv_heads, head_dim, tiles):
    """Rows longer than a span (1,024 tokens) are computed span by span and merged: the same result."""
    q, kv, tables, ctx = random_case(heads, kv_heads, head_dim, LONG_LENS, num_pages=140, seed=4)
    out = torch.empty(len(LONG_LENS), heads, head_dim, dtype=torch.bfloat16)
    OPS.paged_decode_attention(out, q, kv, tables, ctx, head_dim**-0.5, tiles=tiles)
    expected = reference(q, kv, tables, ctx, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


@TILES
def test_decode_attention_row_bits_do_not_depend_on_the_batch_or_the_threads(tiles):
    """A row's output is the same bits alone, beside other rows (a long one's spans shared out differently
    among the threads) and on one thread or two: what one tenant's row computes cannot tell what else ran."""
    q, kv, tables, ctx = random_case(9, 3, 64, LONG_LENS, num_pages=140, seed=5)
    together = torch.empty(len(LONG_LENS), 9, 64, dtype=torch.bfloat16)
    OPS.paged_decode_attention(together, q, kv, tables, ctx, 0.125, tiles=tiles)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for row in range(len(LONG_LENS)):
                alone = torch.empty(1, 9, 64, dtype=torch.bfloat16)
                one = slice(row, row + 1)
                OPS.paged_decode_attention(alone, q[one], kv, tables[one], ctx[one], 0.125, tiles=tiles)
                assert torch.equal(alone[0], together[row]), (n, row)
            again = torch.empty_like(together)
            OPS.paged_decode_attention(again, q.flip(0), kv, tables.flip(0), ctx.flip(0), 0.125, tiles=tiles)
            assert torch.equal(again.flip(0), together)
    finally:
        torch.set_num_threads(threads)


@TILES
def test_a_nan_in_a_long_rows_span_reaches_that_row_only(tiles):
    """A NaN in one span of a long row turns that row NaN through the merge; the other rows keep their bits."""
    q, kv, tables, ctx = random_case(9, 3, 64, [40, 2100, 300], num_pages=420, seed=6)
    tables = torch.randperm(420, generator=torch.Generator().manual_seed(6))[: tables.numel()].view_as(tables)
    clean = torch.empty(3, 9, 64, dtype=torch.bfloat16)
    OPS.paged_decode_attention(clean, q, kv, tables, ctx, 0.125, tiles=tiles)
    poisoned = kv.clone()  # the rows' pages are disjoint here
    page_size = kv.shape[2]
    t = 1500  # row 1's second span
    poisoned[1, int(tables[1, t // page_size]), t % page_size] = float("nan")
    out = torch.empty_like(clean)
    OPS.paged_decode_attention(out, q, poisoned, tables, ctx, 0.125, tiles=tiles)
    assert torch.isnan(out[1]).all() and torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


@TILES
def test_reads_only_the_slots_of_its_block_table(tiles):
    """Everything but the slots below each row's context length, in its own pages, is NaN: the result is
    unchanged. One NaN inside a row's context changes that row, and only that row."""
    lens = [5, 21, 40]
    q, kv, tables, ctx = random_case(9, 3, 64, lens, seed=3)
    clean = torch.empty(3, 9, 64, dtype=torch.bfloat16)
    OPS.paged_decode_attention(clean, q, kv, tables, ctx, 0.125, tiles=tiles)
    poisoned = torch.full_like(kv, float("nan"))
    page_size = kv.shape[2]
    for row, n in enumerate(lens):
        for t in range(n):
            page, slot = int(tables[row, t // page_size]), t % page_size
            poisoned[:, page, slot] = kv[:, page, slot]
    out = torch.empty_like(clean)
    OPS.paged_decode_attention(out, q, poisoned, tables, ctx, 0.125, tiles=tiles)
    assert torch.equal(out, clean)
    poisoned[1, int(tables[1, 1]), 3] = float("nan")  # row 1's token 19
    OPS.paged_decode_attention(out, q, poisoned, tables, ctx, 0.125, tiles=tiles)
    assert torch.isnan(out[1]).all() and torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


def test_refuses_pages_outside_the_pool_and_contexts_beyond_the_table():
    q, kv, tables, ctx = random_case(9, 3, 64, [20, 20])
    out = torch.empty(2, 9, 64, dtype=torch.bfloat16)
    bad = tables.clone()
    bad[1, 1] = kv.shape[1]  # one past the last page
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.paged_decode_attention(out, q, kv, bad, ctx, 0.125)
    bad[1, 1] = -1
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.paged_decode_attention(out, q, kv, bad, ctx, 0.125)
    too_long = torch.tensor([20, tables.shape[1] * kv.shape[2] + 1])
    with pytest.raises(RuntimeError, match="context length"):
        OPS.paged_decode_attention(out, q, kv, tables, too_long, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.paged_decode_attention(out.float(), q.float(), kv.float(), tables, ctx, 0.125)


def prefill_case(q_len, k_len, heads, kv_heads, head_dim, seed=0):
    """q, k, v as the model has them: strided views of a fused [tokens, H + 2 Hkv, Dh] projection (q for the
    chunk's last q_len tokens)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(k_len, heads + 2 * kv_heads, head_dim, generator=g).bfloat16()
    return qkv[k_len - q_len :, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]


def prefill_reference(q, k, v, scale):
    """float32 attention where query i of the chunk sees keys [0, k_len - q_len + i]."""
    q_len, k_len = q.shape[0], k.shape[0]
    mask = torch.arange(k_len)[None, :] <= torch.arange(q_len)[:, None] + (k_len - q_len)
    o = F.scaled_dot_product_attention(
        *(t.float().transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize(
    "q_len,k_len,heads,kv_heads,head_dim",
    [(196, 196, 9, 3, 64), (7, 30, 4, 2, 32), (1, 1, 4, 4, 16), (50, 50, 6, 1, 48), (100, 300, 8, 2, 128),
     (65, 65, 4, 2, 64), (33, 41, 4, 2, 256), (20, 20, 2, 1, 80)],
)  # fmt: skip
def test_prefill_attention_matches_float32(q_len, k_len, heads, kv_heads, head_dim):
    """A first chunk (k_len == q_len) and later chunks (keys before the chunk), key blocks of 16 and groups
    of four blocks cut anywhere, odd and even chunk lengths, and head sizes of one to sixteen 16-float vectors
    (256: two passes of 128 dimensions)."""
    q, k, v = prefill_case(q_len, k_len, heads, kv_heads, head_dim)
    out = torch.empty(q_len, heads, head_dim, dtype=torch.bfloat16)
    OPS.prefill_attention(out, q, k, v, head_dim**-0.5)
    torch.testing.assert_close(out.float(), prefill_reference(q, k, v, head_dim**-0.5), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("q_len", "k_len", "bad"), [(40, 41, 40), (40, 40, 20), (39, 45, 6), (40, 42, 7)])
def test_prefill_attention_never_lets_a_query_see_past_its_keys(q_len, k_len, bad):
    """NaN in one key and value: exactly the queries that see that key turn NaN (pairs of keys and tiles of two
    queries split anywhere), every other output is unchanged."""
    q, k, v = prefill_case(q_len, k_len, 4, 2, 64, seed=2)
    clean = torch.empty(q_len, 4, 64, dtype=torch.bfloat16)
    OPS.prefill_attention(clean, q, k, v, 0.125)
    k, v = k.clone(), v.clone()
    k[bad], v[bad] = float("nan"), float("nan")
    out = torch.empty_like(clean)
    OPS.prefill_attention(out, q, k, v, 0.125)
    first = max(0, bad - (k_len - q_len))  # query i sees keys 0 .. k_len - q_len + i
    assert torch.equal(out[:first], clean[:first]) and torch.isnan(out[first:]).all()


def test_prefill_attention_is_causal_and_refuses_bad_shapes():
    """NaN in the last key and value changes only the last query; fewer keys than queries is refused."""
    q, k, v = prefill_case(40, 40, 9, 3, 64, seed=1)
    clean = torch.empty(40, 9, 64, dtype=torch.bfloat16)
    OPS.prefill_attention(clean, q, k, v, 0.125)
    k, v = k.clone(), v.clone()
    k[-1], v[-1] = float("nan"), float("nan")
    out = torch.empty_like(clean)
    OPS.prefill_attention(out, q, k, v, 0.125)
    assert torch.equal(out[:-1], clean[:-1]) and torch.isnan(out[-1]).all()
    with pytest.raises(RuntimeError, match="shapes"):
        OPS.prefill_attention(out, q, k[:30], v[:30], 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        OPS.prefill_attention(out.float(), q.float(), k.float(), v.float(), 0.125)
    with pytest.raises(RuntimeError):
        OPS.prefill_attention(q, q, k, v, 0.125)  # out overlaps an input


@pytest.mark.parametrize("rows", [1, 8, 77])  # a decode step's few rows run inline, a prefill's in parallel
def test_fused_layer_operators_match_float32(rows):
    """RMSNorm (alone and after the residual add), rotary in place, and silu(gate) * up: float32 inside, one
    bfloat16 rounding at the end, so within a bfloat16 step or two of the float32 result."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    delta = torch.randn(rows, 576, generator=g).bfloat16()
    w = (1 + torch.randn(576, generator=g) / 4).bfloat16()

    def norm32(v):
        v = v.float()
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()

    tol = dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(OPS.rms_norm(x, w, 1e-5).float(), norm32(x), **tol)
    stream = x.clone()
    normed = OPS.add_rms_norm_(stream, delta, w, 1e-5)
    assert torch.equal(stream, x + delta)  # the residual stream is rounded exactly as `x + delta` would be
    torch.testing.assert_close(normed.float(), norm32(stream), **tol)

    from kvfence.model.llama import Rotary

    rotary = Rotary(64, 512, 10000.0)
    positions = torch.randint(0, 512, (rows,), generator=g)
    heads = torch.randn(rows, 15, 64, generator=g).bfloat16()  # [q: 9 | k: 3 | v: 3], rotate the first 12
    expected = Rotary.apply(
        heads[:, :12].float(), rotary.cos[positions][:, None], rotary.signed_sin[positions][:, None]
    )
    untouched = heads[:, 12:].clone()
    OPS.rotary_(heads, 12, rotary.cos[positions], rotary.signed_sin[positions])
    torch.testing.assert_close(heads[:, :12].float(), expected, **tol)
    assert torch.equal(heads[:, 12:], untouched)

    gate_up = torch.randn(rows, 2 * 1536, generator=g).bfloat16() * 4
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(OPS.silu_mul(gate_up).float(), F.silu(gate) * up, **tol)
    gate_up[0, 0] = float("nan")  # NaN stays NaN through the fused exp
    assert torch.isnan(OPS.silu_mul(gate_up)[0, 0])


def test_bfloat16_models_use_the_kernel_and_agree_with_the_torch_path(tmp_path):
    """A bfloat16 model decodes through the kernel; switched off, the torch path gives logits within bfloat16
    rounding of it."""
    from kvfence.model.llama import LlamaForCausalLM
    from kvfence.model.loader import load_model
    from tests.model_factory import write_tiny_hf_dir
    from tests.test_forward import run_paged

    loaded = load_model(write_tiny_hf_dir(tmp_path / "m", arch="llama", seed=4, head_dim=32))
    model = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.bfloat16, "cpu")
    assert model.kernels is not None and model.kernels.lib is OPS
    assert all(layer.self_attn.kernels is model.kernels for layer in model.model.layers)
    ids = torch.randint(
        0, loaded.config.vocab_size, (40,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    chunks = [20, 1, 1, 1, 9, 1, 1, 1, 1, 1, 1, 1, 1]
    with_kernel = run_paged(loaded, ids, chunks, dtype=torch.bfloat16)
    without = run_paged(loaded, ids, chunks, dtype=torch.bfloat16, kernels=kernel_options(kernels=False))
    assert not torch.equal(with_kernel, without)  # the kernel really ran (it rounds differently)
    torch.testing.assert_close(with_kernel, without, atol=5e-2, rtol=5e-2)
    f32 = run_paged(loaded, ids, chunks, dtype=torch.float32)
    assert (with_kernel.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.9


def test_mixed_step_with_ragged_decodes_agrees_with_the_torch_path(tmp_path):
    """One step holding a fresh prefill and two decode rows of different lengths (block tables of different
    widths, padded): with the kernels, each row's log-probabilities are those of the torch path within bfloat16
    rounding, and the greedy choices agree."""
    from kvfence.engine.model_runner import ModelRunner
    from kvfence.engine.plan import Plan, PlanRow
    from kvfence.engine.request import SamplingParams
    from kvfence.ids import LeaseId, PageId, RequestId
    from kvfence.model.kernels import KernelOps
    from kvfence.model.linears import OutputHead
    from kvfence.model.llama import MLP, Attention, LlamaForCausalLM
    from kvfence.model.loader import load_model
    from tests.model_factory import write_tiny_hf_dir

    loaded = load_model(write_tiny_hf_dir(tmp_path / "m", arch="llama", seed=5, head_dim=32))
    model = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.bfloat16, "cpu")
    params = SamplingParams(temperature=0, logprobs=5)
    rng = torch.Generator().manual_seed(3)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, loaded.config.vocab_size, (n,), generator=rng).tolist())

    def pages(*ids: int) -> tuple[PageId, ...]:
        return tuple(PageId(i) for i in ids)

    a, b, c = RequestId("a"), RequestId("b"), RequestId("c")
    table = {a: pages(0, 9), b: pages(3, 7, 1), c: pages(10, 2, 5, 12)}
    prompt = {a: tokens(7), b: tokens(9), c: tokens(14)}
    nxt = {b: tokens(1), c: tokens(1)}

    def row(rid, toks, start):
        return PlanRow(rid, toks, start, table[rid], (LeaseId(1),) * len(table[rid]), True, params, 0)

    def run(with_kernels: bool) -> dict:
        for m in model.modules():
            if isinstance(m, (Attention, MLP, LlamaForCausalLM, OutputHead)):
                m.kernels = KernelOps(OPS) if with_kernels else None
        runner = ModelRunner(model, num_pages=16, page_size=4, dtype=torch.bfloat16, device="cpu")
        runner.run(Plan((row(b, prompt[b], 0), row(c, prompt[c], 0)), 1))
        result = runner.run(Plan((row(a, prompt[a], 0), row(b, nxt[b], 9), row(c, nxt[c], 14)), 2))
        return {rid: result.logprobs[rid] for rid in (a, b, c)} | {"sampled": result.sampled}

    with_kernels, without = run(True), run(False)
    assert with_kernels["sampled"] == without["sampled"]
    for rid in (a, b, c):
        chosen_k, top_k = with_kernels[rid]
        chosen_t, top_t = without[rid]
        assert abs(chosen_k - chosen_t) < 0.1
        assert [t for t, _ in top_k[:1]] == [t for t, _ in top_t[:1]]


def test_kernels_release_the_gil():
    """A kernel call lets other Python threads run (the server's event loop shares the process with steps).
    With a switch interval longer than the whole test, the worker thread would keep the GIL from the moment it
    signals until it ends if the kernels held it; the main thread then never sees it alive."""
    import sys
    import threading

    threads, interval = torch.get_num_threads(), sys.getswitchinterval()
    torch.set_num_threads(1)
    q, kv, tables, ctx = random_case(9, 3, 64, [230] * 64, num_pages=1200)
    out = torch.empty(64, 9, 64, dtype=torch.bfloat16)
    started, seen_alive = threading.Event(), []

    def work():
        started.set()
        for _ in range(20):
            OPS.paged_decode_attention(out, q, kv, tables, ctx, 0.125)

    worker = threading.Thread(target=work)
    sys.setswitchinterval(30.0)
    try:
        worker.start()
        started.wait()
        seen_alive.append(worker.is_alive())  # runs only once the worker lets go of the GIL
        worker.join()
    finally:
        sys.setswitchinterval(interval)
        torch.set_num_threads(threads)
    assert seen_alive == [True]


def test_write_kv_matches_the_torch_write_and_refuses_slots_outside_the_pool():
    """K and V as the fused projection leaves them (rows strided by the whole QKV width) land in the same slots,
    bit for bit, as PagedKV.write puts them; a slot past the pool raises before anything is written."""
    from kvfence.model.config import ModelConfig
    from kvfence.model.paged_kv import PagedKV

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=96, intermediate_size=128, num_layers=2,
                      num_heads=3, num_kv_heads=1, head_dim=32, rope_theta=1e4, rms_norm_eps=1e-5,
                      context_length=64, tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
                      eos_token_ids=(0,))  # fmt: skip
    g = torch.Generator().manual_seed(5)
    ours, reference = PagedKV(cfg, 9, 4, torch.bfloat16, "cpu"), PagedKV(cfg, 9, 4, torch.bfloat16, "cpu")
    heads = torch.randn(7, 5, 32, generator=g).bfloat16()  # [T, H + 2 Hkv, Dh]: q, q, q, k, v
    k, v = heads[:, 3:4], heads[:, 4:5]
    slots = torch.randperm(36, generator=g)[:7]
    OPS.write_kv(ours.kv[1], slots, k, v)
    reference.write(1, slots, k, v)
    assert torch.equal(ours.kv, reference.kv)
    before = ours.kv.clone()
    with pytest.raises(RuntimeError, match="slot outside the pool"):
        OPS.write_kv(ours.kv[0], torch.tensor([0, 1, 2, 3, 4, 5, 36]), k, v)
    assert torch.equal(ours.kv, before)
