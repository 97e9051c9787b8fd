"""Two hosts: the prefill worker runs in its own network namespace, joined to the decode worker's (the root
namespace, with the router) by a veth pair. KV pages cross a real (virtual) network link between them."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import sys

import pytest

from kvfence.engine.request import SamplingParams
from kvfence.pd.router import Router
from tests.test_pd_zmq import colocated_reference, jobs_for

NS = f"kvf-prefill-{os.getpid()}"
HOST_A, HOST_B = "10.77.0.1", "10.77.0.2"  # A: router + decode (root namespace); B: prefill (NS)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for network namespaces"
)


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@contextlib.contextmanager
def namespace():
    veth = f"kvf{os.getpid() % 100000}"
    sh("ip", "netns", "add", NS)
    try:
        sh("ip", "link", "add", f"{veth}a", "type", "veth", "peer", "name", f"{veth}b")
        sh("ip", "link", "set", f"{veth}b", "netns", NS)
        sh("ip", "addr", "add", f"{HOST_A}/24", "dev", f"{veth}a")
        sh("ip", "link", "set", f"{veth}a", "up")
        sh("ip", "netns", "exec", NS, "ip", "addr", "add", f"{HOST_B}/24", "dev", f"{veth}b")
        sh("ip", "netns", "exec", NS, "ip", "link", "set", f"{veth}b", "up")
        sh("ip", "netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield
    finally:
        subprocess.run(["ip", "link", "del", f"{veth}a"], capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)


def test_prefill_and_decode_on_two_hosts(tiny_dir, tiny_model):
    jobs = jobs_for(tiny_model, 4, seed=24)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = colocated_reference(tiny_model, jobs, params)
    with namespace():
        router = Router(bind=f"tcp://{HOST_A}:0")
        common = ["--model", str(tiny_dir), "--router", router.addr, "--threads", "1", "--page-size", "4",
                  "--kv-pages", "64"]  # fmt: skip
        procs = [
            subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-m", "kvfence.pd.cli", "prefill", *common,
                              "--data", f"tcp://{HOST_B}:0"]),
            subprocess.Popen([sys.executable, "-m", "kvfence.pd.cli", "decode", *common]),
        ]  # fmt: skip
        try:
            for _ in range(120):
                if router.wait_for_workers(1, 1, timeout=1.0):
                    break
                assert all(p.poll() is None for p in procs), "a worker exited before registering"
            prefill = next(w for w in router.workers.values() if w.role == "prefill")
            assert prefill.data_addr.startswith(f"tcp://{HOST_B}:"), prefill.data_addr
            outputs: queue.Queue = queue.Queue()
            for rid, ids in jobs.items():
                router.submit(ids, params, rid, "t", outputs.put)
            final = {}
            while len(final) < len(jobs):
                out = outputs.get(timeout=120)
                if out.finished:
                    final[out.request_id] = out
            assert {k: v.token_ids for k, v in final.items()} == expected
        finally:
            router.shutdown()
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
