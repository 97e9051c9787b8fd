"""Resident memory of a kvfence server after serving, per process, beyond its weights and KV pool.

    python bench/memory.py [--mode colocated|pd] [--idle 4] [--port 8199] [-- extra `kvfence serve` flags]

Starts `kvfence serve` with 2 threads, sends an untimed W1 on other prompts (the warm-up of bench/peers.sh) and
then W1 (bench/serve.py), waits --idle seconds (the server hands freed heap pages back after 2 s without work)
and reads VmRSS of the server and of every process under it (the PD workers). The server is stopped, and the
same engine is built in this process to count what the target leaves out:
  - weights: every tensor storage the model holds, once (parameters, oneDNN's packed copies, the int8 panels,
    the GGUF blocks), but not the rotary tables or step buffers;
  - the KV pool (`PagedKV.kv`; never written here, so it costs this process nothing).
Issue 7's target: RSS beyond weights + pool < 400 MB (381.5 MiB) per process. Environment variables such as
KVFENCE_INT8 reach the server and the count alike. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from torch import nn

from kvfence.config import KernelOptions

ROOT = Path(__file__).resolve().parent.parent
TARGET_MIB = 400e6 / 2**20


def rss_kib(pid: int) -> int:
    """VmRSS of a process; 0 once it is gone (or a zombie)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith("VmRSS:")), 0)


def descendants(pid: int) -> list[int]:
    """Every live process under `pid`, from /proc (children before grandchildren)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = sorted(p for p, pp in parents.items() if pp in frontier)
        found += kids
        frontier = kids
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def wait_healthy(url: str, proc: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited early ({proc.returncode})")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)  # polling a process we started, not synchronizing threads
    raise SystemExit(f"the server was not healthy after {seconds:.0f} s")


def w1(port: int, seed: int | None) -> str:
    cmd = [
        sys.executable,
        str(ROOT / "bench/serve.py"),
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--workload",
        "W1",
    ]
    cmd += ["--quiet"] + (["--seed", str(seed)] if seed is not None else [])
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def tensor_storages(obj: object, seen: dict[int, int]) -> None:
    """Record the storage (data pointer -> bytes) of every tensor reachable from `obj` through module attributes,
    dataclasses and containers; plain objects (the rotary tables) are not entered. oneDNN's packed weights hide
    their storage: they count as their elements."""
    if isinstance(obj, torch.Tensor):
        if obj.is_mkldnn:
            seen[id(obj)] = obj.numel() * obj.element_size()
        elif obj.device.type == "cpu" and obj.numel():
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, nn.Module):
        for value in vars(obj).values():
            tensor_storages(value, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            tensor_storages(getattr(obj, f.name), seen)
    elif isinstance(obj, dict):
        for value in obj.values():
            tensor_storages(value, seen)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            tensor_storages(value, seen)


def weights_and_pool(serve_flags: list[str]) -> tuple[float, float]:
    """MiB of weights and of the KV pool of the engine that `kvfence serve FLAGS` builds."""
    from kvfence.cli import build_parser
    from kvfence.engine.llm_engine import LLMEngine
    from kvfence.flags import config_from_args, resolve
    from kvfence.runtime.process import process_defaults

    process_defaults(os.environ)
    args = build_parser().parse_args(["serve", *serve_flags])
    runner = LLMEngine(resolve(config_from_args(args))).runner
    seen: dict[int, int] = {}
    tensor_storages(runner.model, seen)
    pool = runner.cache.kv
    seen.pop(pool.untyped_storage().data_ptr(), None)
    return sum(seen.values()) / 2**20, pool.untyped_storage().nbytes() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("colocated", "pd"), default="colocated")
    ap.add_argument("--port", type=int, default=8199)
    ap.add_argument("--idle", type=float, default=4.0, help="seconds without work before reading RSS")
    ap.add_argument("serve_flags", nargs="*", help="more `kvfence serve` flags (after --)")
    args = ap.parse_args()
    flags = ["--threads", "2", *args.serve_flags]
    cmd = [
        str(Path(sys.executable).parent / "kvfence"),
        "serve",
        "--port",
        str(args.port),
        "--mode",
        args.mode,
    ]
    server = subprocess.Popen(cmd + flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{args.port}/health", server, 300)
        w1(args.port, seed=7919)  # warm-up, other prompts
        report = w1(args.port, seed=None).strip().splitlines()
        time.sleep(args.idle)  # the server's idle trim runs 2 s after its last step
        rows = [(pid, command_line(pid), rss_kib(pid)) for pid in [server.pid, *descendants(server.pid)]]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    weights, pool = weights_and_pool(flags)
    int8 = KernelOptions.from_env().int8  # what the server was started with (the same environment)
    print(f"kvfence serve --mode {args.mode} {' '.join(flags)}  (KVFENCE_INT8={int8})")
    print("W1:", next((line.strip() for line in report if "tok/s" in line), "?"))
    print(f"weights {weights:.1f} MiB, KV pool {pool:.1f} MiB (per engine process)")
    print(f"{'pid':>8s} {'RSS MiB':>9s} {'beyond MiB':>11s}  process")
    for pid, line, kib in rows:
        mib = kib / 1024
        worker = " -m kvfence prefill " in line or " -m kvfence decode " in line  # PD workers: an engine each
        engine = worker or (args.mode == "colocated" and pid == server.pid)
        beyond = mib - weights - pool if engine else mib
        verdict = "" if beyond < TARGET_MIB else "  over the target"
        role = (
            "server"
            if pid == server.pid
            else (line.split(" -m kvfence ")[-1].split() or ["?"])[0] + " worker"
        )
        print(f"{pid:8d} {mib:9.1f} {beyond:11.1f}  {role}{verdict}")
    print(f"target: < {TARGET_MIB:.1f} MiB (400 MB) beyond weights and pool, per process")


if __name__ == "__main__":
    main()
