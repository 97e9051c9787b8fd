"""I6 preflight: refuse, clamp or (explicitly) allow a pool smaller than one full-context request.

Unit tests on the pure function, then the `kvfence preflight` / `kvfence serve` commands on the tiny model
(the tiny model's context length is 256 tokens; 2 layers x 2 KV heads x head_dim 16 -> 512 bytes/token in f32).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest
import torch

from kvfence.cli import main
from kvfence.config import Config
from kvfence.engine.preflight import Verdict, preflight, preflight_config


@pytest.fixture(scope="module")
def cfg(tiny_model):
    return tiny_model.config


def test_pool_that_holds_the_context_is_ok(cfg):
    r = preflight(cfg, dtype="float32", num_pages=100, page_size=16)
    assert (r.verdict, r.context_length, r.num_full_context_requests) == (Verdict.OK, 256, 6)
    assert r.pool_tokens == 1600 and r.pool_bytes == 1600 * cfg.kv_bytes_per_token(4)
    text = r.summary()
    for piece in (
        "100 pages x 16 tokens = 1600 tokens",
        "context length  256",
        "fit at once: 6",
        "verdict         ok",
    ):
        assert piece in text


def test_undersized_pool_is_refused_with_an_explanation(cfg):
    r = preflight(cfg, dtype="float32", num_pages=10, page_size=16)
    assert r.verdict is Verdict.REFUSED and not r.can_start and r.num_full_context_requests == 0
    assert "160 tokens" in r.reason and "256 tokens" in r.reason and "--clamp-context-length" in r.reason


def test_clamp_lowers_the_context_to_the_pool(cfg):
    r = preflight(cfg, dtype="bfloat16", num_pages=10, page_size=16, clamp=True)
    assert (r.verdict, r.context_length, r.num_full_context_requests) == (Verdict.CLAMPED, 160, 1)
    assert r.can_start and "lowered to 160" in r.summary()
    assert r.pool_bytes == 160 * cfg.kv_bytes_per_token(2)


def test_allow_undersized_keeps_the_context(cfg):
    r = preflight(cfg, dtype="float32", num_pages=10, page_size=16, allow_undersized=True)
    assert (r.verdict, r.context_length, r.can_start) == (Verdict.UNDERSIZED_ALLOWED, 256, True)


def test_a_lower_requested_context_can_fit(cfg):
    r = preflight(cfg, dtype="float32", num_pages=10, page_size=16, context_length=128)
    assert (r.verdict, r.context_length, r.requested_context_length, r.num_full_context_requests) == (
        Verdict.OK,
        128,
        128,
        1,
    )
    big = preflight(
        replace(cfg, context_length=100), dtype="float32", num_pages=10, page_size=16, context_length=4096
    )
    assert big.context_length == 100  # never above what the model was trained for


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"context_length": 0}, "at least 1"),
        ({"context_length": -5}, "at least 1"),
        ({"num_pages": 0}, "page"),
    ],
)
def test_sizes_that_describe_nothing_are_refused(cfg, kw, needle):
    with pytest.raises(ValueError, match=needle):
        preflight(cfg, **{"dtype": "float32", "num_pages": 10, "page_size": 16, **kw})


def test_pool_size_from_memory_without_allocating(cfg):
    # 1 MiB at 512 bytes/token in f32 = 2048 tokens = 128 pages of 16
    r = preflight_config(cfg, Config.of(model="x", dtype="float32", kv_cache_memory=1 / 1024, page_size=16))
    assert (r.num_pages, r.verdict) == (128, Verdict.OK)


# ---- the commands -------------------------------------------------------------------------------------------


def test_preflight_command(tiny_dir, capsys):
    args = ["preflight", "--model", str(tiny_dir), "--kv-pages", "8", "--page-size", "16"]
    assert main(args) == 1
    assert "verdict         refused" in capsys.readouterr().out
    assert main([*args, "--clamp-context-length"]) == 0
    assert "context length  128" in capsys.readouterr().out
    assert main([*args, "--allow-undersized-pool"]) == 0
    assert main(["preflight", "--model", str(tiny_dir), "--kv-pages", "16", "--page-size", "16"]) == 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--context-length", "0"], "--context-length must be at least 1, got 0"),
        (["--context-length", "-5"], "--context-length must be at least 1, got -5"),
        (["--kv-pages", "0"], "--kv-pages must be at least 1, got 0"),
        (["--page-size", "12"], "--page-size must be a power of two, got 12"),
    ],
)
@pytest.mark.parametrize("command", ["preflight", "serve"])
def test_bad_sizes_are_refused_before_loading(tiny_dir, capsys, command, flags, message):
    port = ["--port", "0"] if command == "serve" else []
    assert main([command, "--model", str(tiny_dir), *flags, *port]) == 2
    assert f"kvfence {command}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["preflight", "serve"])
def test_a_missing_model_is_said_without_a_traceback(tmp_path, capsys, command):
    port = ["--port", "0"] if command == "serve" else []
    assert main([command, "--model", str(tmp_path / "none.gguf"), *port]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"kvfence {command}: {tmp_path}/none.gguf: no such file or directory")
    )


def test_serve_refuses_an_empty_queue(tiny_dir, capsys):
    assert main(["serve", "--model", str(tiny_dir), "--max-queue", "0", "--port", "0"]) == 2
    assert "--max-queue must be at least 1, got 0" in capsys.readouterr().err


def test_serve_refuses_to_start_with_an_undersized_pool(tiny_dir, capsys, monkeypatch):
    from kvfence.runtime import http

    def started(
        *args: object, **kw: object
    ) -> int:  # a regression fails here instead of serving (and hanging)
        raise AssertionError("the server started with a pool smaller than one full-context request")

    monkeypatch.setattr(http, "serve_http", started)
    assert (
        main(["serve", "--model", str(tiny_dir), "--kv-pages", "8", "--page-size", "16", "--port", "0"]) == 1
    )
    assert "Refusing to start" in capsys.readouterr().out


def test_serve_rejects_a_bad_keys_file(tiny_dir, tmp_path, capsys):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k": ""}))
    assert main(["serve", "--model", str(tiny_dir), "--api-keys", str(keys), "--port", "0"]) == 2
    assert "tenant" in capsys.readouterr().err


def test_serve_command_clamps_and_serves(tiny_dir, tmp_path):
    """The real `kvfence serve` process: clamped context advertised, API key required."""
    keys = tmp_path / "keys.toml"
    keys.write_text('"sk-test" = "team-a"\n')
    cmd = [
        sys.executable,
        "-m",
        "kvfence",
        "serve",
        "--model",
        str(tiny_dir),
        "--kv-pages",
        "8",
        "--page-size",
        "16",
    ]
    cmd += ["--clamp-context-length", "--port", "0", "--api-keys", str(keys), "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:  # blocks until uvicorn reports its address
            lines.append(line)
            if "Uvicorn running on" in line:
                break
        text = "".join(lines)
        assert "verdict         clamped" in text
        url = text.split("Uvicorn running on ")[1].split()[0]
        headers = {"Authorization": "Bearer sk-test"}
        assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
        (card,) = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
        assert (card["id"], card["max_model_len"]) == ("llama", 128)
        body = {"model": "llama", "prompt": "Hello", "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4
        proc.send_signal(signal.SIGINT)  # Ctrl+C: uvicorn shuts down, and the command ends quietly
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "Traceback" not in rest, rest[-2000:]
    finally:
        proc.terminate()
        proc.wait(30)


def test_dtype_auto_is_bfloat16_where_the_cpu_has_bfloat16_dot_products():
    """`--dtype auto` (the command line's default) resolves to one concrete dtype; others pass through."""
    from kvfence.cli import build_parser
    from kvfence.flags import config_from_args, resolve
    from kvfence.options import resolve_dtype

    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "").split()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype("float32", "cuda") == "float32"
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    config = config_from_args(args)
    assert config.model.dtype == "auto" and resolve(config).model.dtype == resolve_dtype("auto", "cpu")


def test_every_process_caps_onednn_primitive_cache_unless_told_otherwise():
    from kvfence.runtime.process import ONEDNN_CACHE_ENTRIES, TORCH_LINEAR_CACHE_ENTRIES, process_defaults

    environ: dict[str, str] = {}
    process_defaults(environ)
    assert environ == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": ONEDNN_CACHE_ENTRIES,
        "LRU_CACHE_CAPACITY": TORCH_LINEAR_CACHE_ENTRIES,
    }
    environ = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    process_defaults(environ)
    assert environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"


LINEAR_SHAPES_PROBE = """
import os, sys
from kvfence.runtime.process import process_defaults
if sys.argv[1] == "defaults":
    process_defaults(os.environ)
import torch
torch.set_num_threads(1)
def anon_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1]) >> 10
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), 8)
           for n, k in ((960, 576), (576, 576), (3072, 576), (576, 1536))]
def step(rows):
    for w in weights:
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, w.size(1)).bfloat16(), w, None, "none", [], "")
for rows in range(150, 160):
    step(rows)
start = anon_mib()
for rows in range(160, 260):  # a prefill chunk's token count differs from step to step
    step(rows)
print(anon_mib() - start)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")
def test_linear_layers_over_many_input_shapes_keep_memory_bounded():
    """torch keeps a oneDNN computation per input shape of each linear layer (about 0.6 MB each, 1,024 by
    default): without a cap, every new prefill length adds memory for good. Under kvfence's process defaults
    the growth stops at the cap."""
    from kvfence.model.linears import onednn_bf16_packing

    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    if not onednn_bf16_packing():  # a CPU (or ONEDNN_MAX_CPU_ISA) below AVX512-BW
        pytest.skip(
            "this CPU has no oneDNN bfloat16 weight packing, so the model has no packed layers and no oneDNN "
            "shape cache for this test to bound"
        )
    grown = {}
    for mode in ("defaults", "uncapped"):
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
        }
        out = subprocess.run([sys.executable, "-c", LINEAR_SHAPES_PROBE, mode], capture_output=True, text=True,
                             env=env, check=True)  # fmt: skip
        grown[mode] = int(out.stdout.split()[-1])
    assert grown["uncapped"] > 150, grown  # the probe does show the growth (about 280 MB here)
    assert grown["defaults"] < 60, grown  # about 33 MB here


def test_serve_refuses_an_unknown_int8_mode_before_loading(monkeypatch, capsys):
    monkeypatch.setenv("KVFENCE_INT8", "bogus")
    assert main(["serve", "--model", "/nonexistent.gguf"]) == 2
    assert "KVFENCE_INT8='bogus'" in capsys.readouterr().err
