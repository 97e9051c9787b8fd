"""Two hosts: the prefill worker runs in its own network namespace, joined to the decode worker's (the root
namespace, with the router) by a veth pair. KV pages cross a real (virtual) network link between them, and so do
the router's control messages to the prefill worker (prompts as token ids).

The cluster runs with keys (CURVE, I10), and tcpdump reads every byte on the link: no planted prompt (as text
or as its token-id sequence) crosses it in the clear. The same run with
--insecure-cluster is the control: there the capture finds them, so the capture does see what crosses."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

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


VETH = f"kvf{os.getpid() % 100000}"


@contextlib.contextmanager
def capture(interface: str, pcap: Path) -> Iterator[None]:
    """tcpdump on `interface` into `pcap` (every byte of every packet) for the duration of the block."""
    if shutil.which("tcpdump") is None:
        if os.environ.get("KVFENCE_REQUIRE_TCPDUMP") == "1":
            pytest.fail("tcpdump is missing (make test installs it)")
        pytest.skip("tcpdump is missing (make test installs it)")
    # immediate mode: without it libpcap hands packets over in ring blocks, and SIGINT can end tcpdump with a
    # block "received by filter" but never written (0 packets captured; seen on this machine)
    cmd = ["tcpdump", "-i", interface, "-s", "0", "-U", "--immediate-mode", "-w", str(pcap), "tcp"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # "listening on ...": capturing from here on
    assert "listening on" in line, line
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)  # flushes and closes the file
        proc.wait(timeout=30)


@contextlib.contextmanager
def namespace():
    veth = VETH
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


@pytest.mark.parametrize("secure", [True, False], ids=["keys", "insecure"])
def test_prefill_and_decode_on_two_hosts(tiny_dir, tiny_model, tmp_path, secure):
    jobs = jobs_for(tiny_model, 4, seed=24)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = colocated_reference(tiny_model, jobs, params)
    pcap = tmp_path / "link.pcap"
    with namespace(), capture(f"{VETH}a", pcap):
        netns = ["ip", "netns", "exec", NS]
        with start_cluster(tiny_dir, netns_prefill=netns, bind=f"tcp://{HOST_A}:0", prefill_data=f"tcp://{HOST_B}:0",
                           decode_pages=64, secure=secure) as router:  # fmt: skip
            prefill = next(w for w in router.workers.values() if w.role == "prefill")
            assert prefill.data_addr.startswith(f"tcp://{HOST_B}:"), prefill.data_addr
            got = collect(router, jobs, params)
            audit_clean(router)
    assert {k: v.token_ids for k, v in got.items()} == expected
    wire = pcap.read_bytes()
    assert len(wire) > 10_000  # registrations, requests and KV pages crossed the link
    # what a tenant sent: each prompt as text, and as its token ids the way the control plane writes them
    planted = {f"prompt {rid}": ",".join(map(str, ids)).encode() for rid, ids in jobs.items()}
    tokenizer = tiny_model.tokenizer
    planted |= {f"text {rid}": tokenizer.decode(list(ids)).encode() for rid, ids in jobs.items()}
    found = sorted(name for name, needle in planted.items() if needle in wire)
    if secure:
        assert found == []
    else:  # the control: without keys the same capture reads the prompts off the link
        assert any(name.startswith("prompt") for name in found), found
