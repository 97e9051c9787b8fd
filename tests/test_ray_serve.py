"""`kvfence serve --mode pd --ray ADDRESS` on the command line, as an operator runs it against a Ray cluster
(here a one-node `ray.cluster_utils.Cluster` of its own), with the default model (kvfence/runtime/ray_cluster.py).
A module of its own: the three-node cluster of tests/test_ray_cluster.py is gone before this one starts."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.pd_cluster import free_port

pytest.importorskip("ray", reason="kvfence[ray] is not installed (make test installs it)")
from ray.cluster_utils import Cluster


def wait_for(condition: Callable[[], Any], what: str, within_s: float = 300.0) -> Any:
    deadline = time.monotonic() + within_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)  # poll interval
    return value


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return 0


@pytest.mark.slow
def test_kvfence_serve_ray_on_the_command_line_serves_smollm2(tmp_path):
    """`kvfence serve --mode pd --ray ADDRESS` as an operator runs it, on a one-node cluster of its own, with the
    default model: the chat answer is float32's greedy one. Before it, the same command on a port in use exits 2
    with one line naming the port (the router actor binds it before anything else)."""
    from tests.conftest import float32_answer, require_default_model

    model = require_default_model()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"kvfence_prefill": 1, "kvfence_decode": 1},
            "object_store_memory": 80 << 20,
        },
    )
    port = free_port()
    cmd = [sys.executable, "-m", "kvfence", "serve", "--mode", "pd", "--ray", cluster.address, "--model",
           str(model), "--dtype", "float32", "--threads", "1", "--kv-pages", "64",
           "--context-length", "1024"]  # fmt: skip
    with socket.socket() as other:  # first, a port in use: the router actor says so, and nothing starts
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        taken = other.getsockname()[1]
        done = subprocess.run([*cmd, "--port", str(taken)], capture_output=True, text=True, timeout=300)
    said = f"kvfence serve --ray: cannot serve on --host 127.0.0.1 --port {taken}: Address already in use"
    assert done.returncode == 2 and said in done.stderr.splitlines(), done.stderr[-3000:]
    proc = subprocess.Popen([*cmd, "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(url + "/health") == 200 or proc.poll() is not None, "kvfence serve --ray")
        assert proc.poll() is None
        question = [{"role": "user", "content": "Complete the sentence: The capital of France is"}]
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        got = client.chat.completions.create(
            model=model.stem, messages=question, max_tokens=24, temperature=0
        )
        from kvfence.model.loader import load_model

        expected = float32_answer(load_model(model), question, "Paris")
        assert got.choices[0].message.content.startswith(expected)
        shown = subprocess.run(
            [sys.executable, "-m", "kvfence", "cluster", "status", "--url", url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert shown.returncode == 0 and "ready: yes" in shown.stdout and "prefill-0" in shown.stdout, shown
    finally:
        proc.terminate()
        proc.wait(timeout=120)
        cluster.shutdown()
