"""Our paged forward pass against Hugging Face transformers on the same weights.

Three attention paths are compared: a first prefill chunk (no cache), a later chunk on top of cached pages, and
single-token decodes. Each must reproduce transformers' logits at the same positions.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

from kvfence.config import KernelOptions
from kvfence.engine.plan import Plan, PlanRow
from kvfence.engine.request import SamplingParams
from kvfence.ids import LeaseId, PageId, RequestId
from kvfence.model.isa import cpu_flags
from kvfence.model.llama import AttentionMetadata, LlamaForCausalLM, PrefillSeq
from kvfence.model.loader import LoadedModel, load_model
from kvfence.model.paged_kv import PagedKV
from tests.model_factory import write_tiny_hf_dir


def hf_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    cfg = loaded.config
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.context_length,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.architecture == "qwen2":
        hf_cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.LlamaConfig(**common, head_dim=cfg.head_dim, attention_bias=cfg.attention_bias)
        model = transformers.LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def run_paged(
    loaded: LoadedModel,
    ids: list[int],
    chunks: list[int],
    page_size: int = 4,
    dtype: torch.dtype = torch.float32,
    kernels: KernelOptions | None = None,
) -> torch.Tensor:
    """Feed `ids` through our model in the given chunk sizes (1 = decode path); logits at every position.
    `kernels`: the model's compute path (None: the options `loaded` was loaded with)."""
    options = loaded.kernels if kernels is None else kernels
    model = LlamaForCausalLM.from_weights(
        loaded.config, loaded.weights, dtype, "cpu", loaded.quantized, options
    )
    num_pages = -(-len(ids) // page_size)
    cache = PagedKV(loaded.config, num_pages + 3, page_size, dtype, "cpu", options.hugepages)
    pages = [PageId(p) for p in reversed(range(3, num_pages + 3))]  # non-contiguous, out of order
    out, start = [], 0
    for n in chunks:
        positions = torch.arange(start, start + n)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in positions.tolist()])
        block = torch.tensor(pages[: -(-(start + n) // page_size)])
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            prefills=[PrefillSeq(0, n, start, block)] if n > 1 else [],
            decode_idx=torch.tensor([0]) if n == 1 else None,
            decode_pages=block.unsqueeze(0) if n == 1 else None,
            decode_lens=torch.tensor([start + 1]) if n == 1 else None,
            sample_idx=torch.arange(n),
        )
        out.append(model(torch.tensor(ids[start : start + n]), meta, cache))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "arch,tie,bias", [("llama", False, False), ("llama", True, False), ("qwen2", False, True)]
)
def test_tiny_model_matches_transformers(tmp_path, arch, tie, bias):
    loaded = load_model(write_tiny_hf_dir(tmp_path / arch, arch=arch, seed=1, tie=tie, bias=bias))
    ids = torch.randint(
        0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    expected = hf_logits(loaded, ids)
    got = run_paged(loaded, ids, chunks=[13, 9, 1, 1, 1, 7, 1, 1, 1, 1, 1])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sky blue?"}])
    ids = smollm2.tokenizer.encode(prompt)
    expected = hf_logits(smollm2, ids)
    got = run_paged(smollm2, ids, chunks=[len(ids) - 3, 1, 1, 1], page_size=16)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.slow
def test_smollm2_bfloat16_tracks_float32(smollm2):
    """bfloat16 is an approximation: the next-token choice should agree with float32 almost everywhere."""
    text = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Tokyo is"
    ids = smollm2.tokenizer.encode(text)
    f32 = run_paged(smollm2, ids, chunks=[len(ids) - 2, 1, 1], page_size=16)
    bf16 = run_paged(smollm2, ids, chunks=[len(ids) - 2, 1, 1], page_size=16, dtype=torch.bfloat16)
    agree = (f32.argmax(-1) == bf16.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree
    assert torch.isfinite(bf16).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16 decodes through the C++ kernel
def test_runner_reads_and_writes_only_block_table_pages(tiny_model, dtype):
    """Poison every page outside the block table with NaN: results are unchanged. Poison one page inside it:
    they change. Writes never land outside the block table either. The prompt comes in two chunks, so a
    prefill reading pages back is covered too (bfloat16: the C++ prefill attention)."""
    from kvfence.engine.model_runner import ModelRunner

    model = LlamaForCausalLM.from_weights(tiny_model.config, tiny_model.weights, dtype, "cpu")
    table = (PageId(5), PageId(2), PageId(7))
    greedy = SamplingParams(temperature=0, logprobs=0)

    def run(
        poison: list[int], poison_after_prefill: list[int] = (), poison_after_chunk: list[int] = ()
    ) -> tuple[float, float]:
        """The log-probabilities of the second prompt chunk's last token and of the decode."""
        runner = ModelRunner(model, num_pages=8, page_size=4, dtype=dtype, device="cpu")
        runner.cache.kv[:, :, poison] = float("nan")
        rid = RequestId("r")
        # the prompt in two chunks: the second attends over the first's K/V read back from the pages
        first = PlanRow(rid, tuple(range(3, 9)), 0, table, (LeaseId(1),) * 3, False, greedy, 0)
        assert runner.run(Plan((first,), 1)).written == ((0, 1),)
        runner.cache.kv[:, :, list(poison_after_chunk)] = float("nan")
        second = PlanRow(rid, tuple(range(9, 13)), 6, table, (LeaseId(1),) * 3, True, greedy, 0)
        result = runner.run(Plan((second,), 2))
        assert result.written == ((1, 2),) and result.logprobs is not None
        chunk = result.logprobs[rid][0]
        runner.cache.kv[:, :, list(poison_after_prefill)] = float("nan")
        decode = PlanRow(rid, (13,), 10, table, (LeaseId(1),) * 3, True, greedy, 0)
        result = runner.run(Plan((decode,), 3))
        assert result.logprobs is not None
        return chunk, result.logprobs[rid][0]

    clean = run([])
    outside = [0, 1, 3, 4, 6, 8]  # every page outside the table, and the scratch page
    assert run(outside) == clean
    assert math.isnan(run([], poison_after_prefill=[2])[1])  # the decode reads page 2: it is in the table
    assert math.isnan(run([], poison_after_chunk=[5])[0])  # the second chunk reads the first's page back


@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_packed_bfloat16_linears_equal_plain_ones(tmp_path, monkeypatch, tie, bias):
    """bfloat16 on CPU without AMX tiles runs every projection through oneDNN with the weight packed once at load
    (with them, `--no-amx-tiles` does); the logits must
    be those of plain F.linear, bit for bit, on every attention path (a tied head gets its own packed copy). Where
    oneDNN cannot pack bfloat16 (no AVX512-BW, or ONEDNN_MAX_CPU_ISA capped below it) the model is built of plain
    layers instead, and the same comparison holds."""
    from kvfence.model.linears import PackedLinear

    supported = PackedLinear.supported(torch.bfloat16, "cpu")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    below = cap.startswith(("SSE", "AVX2", "AVX_")) or cap == "AVX" or "avx512bw" not in cpu_flags()
    assert supported or below, (
        "the pinned CPU torch build has oneDNN and this CPU AVX512-BW: packing must run"
    )
    arch = "qwen2" if bias else "llama"
    loaded = load_model(write_tiny_hf_dir(tmp_path / arch, arch=arch, seed=2, tie=tie, bias=bias))
    ids = torch.randint(
        0, loaded.config.vocab_size, (29,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    chunks = [11, 7, 1, 1, 8, 1]
    onednn = dataclasses.replace(loaded.kernels, amx_tiles=False)  # AMX tiles: tests/test_tile_linear.py
    packed = run_paged(loaded, ids, chunks, dtype=torch.bfloat16, kernels=onednn)
    model = LlamaForCausalLM.from_weights(
        loaded.config, loaded.weights, torch.bfloat16, "cpu", kernels=onednn
    )
    assert any(isinstance(m, PackedLinear) for m in model.modules()) == supported
    assert not any(isinstance(m, PackedLinear) and m.tiles is not None for m in model.modules())
    monkeypatch.setattr(PackedLinear, "supported", staticmethod(lambda *_: False))
    plain = run_paged(loaded, ids, chunks, dtype=torch.bfloat16, kernels=onednn)
    assert torch.equal(packed, plain)
    model = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.bfloat16, "cpu")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


BUILD_WITHOUT_INIT = """
import sys
import torch
from kvfence.model.llama import LlamaForCausalLM
from kvfence.model.loader import load_model
loaded = load_model(sys.argv[1])
model = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.float32, "cpu")
assert model.lm_head.weight is model.model.embed_tokens.weight
assert not any(p.is_meta for p in model.parameters())
heavy = sorted(m for m in ("sympy", "torch._dynamo", "torch._inductor", "torch.distributed.tensor") if m in sys.modules)
print(" ".join(heavy))
"""


def test_building_a_model_runs_no_random_init(tmp_path):
    """The model is built on the meta device and takes the loader's tensors as its parameters. Random init or
    `to_empty` there would run torch's Python reference kernels, whose first call imports sympy, torch._dynamo and
    some 900 other modules: about 40 MiB more in every server process (docs/performance.md, session 10)."""
    path = write_tiny_hf_dir(tmp_path / "tied", seed=1, tie=True)
    out = subprocess.run(
        [sys.executable, "-c", BUILD_WITHOUT_INIT, str(path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"building the model imported {out.stdout.strip()}"


@pytest.mark.parametrize("chunks", [[200], [40, 160], [150, 50], [120, 1, 79]])
def test_bfloat16_prefill_attention_routes_agree(tmp_path, monkeypatch, chunks):
    """Where oneDNN has AMX, bfloat16 prefill chunks take the C++ kernel below `SDPA_MIN_SCORES` query x key
    scores and torch's scaled_dot_product_attention above (first chunks and later ones with a mask): both routes
    track float32 as closely as the kernel alone does, whichever a chunk of these splits takes. (The SDPA route
    is forced here, so that it is checked on every CPU.)"""
    import kvfence.model.llama as llama
    from kvfence.model.kernels.ops import KernelOps

    loaded = load_model(write_tiny_hf_dir(tmp_path / "m", arch="llama", seed=3))
    ids = torch.randint(
        0, loaded.config.vocab_size, (200,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    f32 = run_paged(loaded, ids, chunks=[200])
    init = KernelOps.__init__

    def with_sdpa(self, lib):
        init(self, lib)
        self.prefill_sdpa = True

    monkeypatch.setattr(KernelOps, "__init__", with_sdpa)
    routed = run_paged(loaded, ids, chunks=chunks, dtype=torch.bfloat16)
    monkeypatch.setattr(KernelOps, "__init__", init)
    monkeypatch.setattr(llama, "SDPA_MIN_SCORES", 10**12)  # every chunk through the kernel
    kernel = run_paged(loaded, ids, chunks=chunks, dtype=torch.bfloat16)
    err_routed, err_kernel = (routed - f32).abs().max().item(), (kernel - f32).abs().max().item()
    assert err_routed <= 2 * err_kernel + 1e-3, (err_routed, err_kernel)
    assert (routed.argmax(-1) == f32.argmax(-1)).float().mean() >= 0.95


def test_long_prefill_chunks_take_torchs_attention_only_where_onednn_has_amx(monkeypatch):
    """SDPA for long chunks where oneDNN runs it on AMX tiles; the C++ kernel everywhere else (faster without
    AMX at every size), also where `ONEDNN_MAX_CPU_ISA` caps oneDNN below AMX."""
    from kvfence.model.kernels.ops import KernelOps, onednn_may_use_amx
    from tests.kernel_ops import kernel_ops

    for cap, amx in (("", True), ("ALL", True), ("avx512_core_amx", True), ("AVX512_CORE_BF16", False),
                     ("AVX2", False)):  # fmt: skip
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert onednn_may_use_amx() is amx, cap
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setenv(
        "DNNL_MAX_CPU_ISA", "AVX512_CORE_BF16"
    )  # the older name, read when the new one is unset
    assert not onednn_may_use_amx()
    monkeypatch.delenv("DNNL_MAX_CPU_ISA")
    ops = KernelOps(kernel_ops())
    assert ops.prefill_sdpa == (ops.head_tiles and onednn_may_use_amx())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_steps_compute_the_mlp_in_slices_of_rows(tmp_path, monkeypatch, dtype):
    """A step longer than `MLP_CHUNK_ROWS` runs its MLP a slice of rows at a time (activations stay in cache):
    every slice boundary, and a last short slice, gives the logits of one whole product."""
    import kvfence.model.llama as llama

    loaded = load_model(write_tiny_hf_dir(tmp_path / "m", arch="qwen2", seed=5, bias=True))
    ids = torch.randint(
        0, loaded.config.vocab_size, (70,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    whole = run_paged(loaded, ids, chunks=[70], dtype=dtype)
    calls: list[int] = []
    rows = llama.MLP._rows
    monkeypatch.setattr(llama.MLP, "_rows", lambda self, x: calls.append(x.shape[0]) or rows(self, x))
    monkeypatch.setattr(llama, "MLP_CHUNK_ROWS", 16)
    sliced = run_paged(loaded, ids, chunks=[70], dtype=dtype)
    assert calls[:5] == [16, 16, 16, 16, 6]  # the first layer's slices
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)
