"""Two hosts: the prefill worker runs in its own network namespace, joined to the decode worker's (the root
namespace, with the router) by a veth pair. KV pages cross a real (virtual) network link between them."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest

from kvfence.engine.request import SamplingParams
from tests.pd_cluster import audit_clean, collect, colocated_reference, jobs_for, start_cluster

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
        netns = ["ip", "netns", "exec", NS]
        with start_cluster(tiny_dir, netns_prefill=netns, bind=f"tcp://{HOST_A}:0", prefill_data=f"tcp://{HOST_B}:0",
                           decode_pages=64) as router:  # fmt: skip
            prefill = next(w for w in router.workers.values() if w.role == "prefill")
            assert prefill.data_addr.startswith(f"tcp://{HOST_B}:"), prefill.data_addr
            got = collect(router, jobs, params)
            audit_clean(router)
    assert {k: v.token_ids for k, v in got.items()} == expected
