"""PD across real processes and real sockets: a router in this process, a prefill worker and a decode worker
as subprocesses talking ZeroMQ over TCP on loopback, on the tiny model. Output must equal colocated mode."""

from __future__ import annotations

import queue
import random
import subprocess
import sys

import pytest

from kvfence.engine.errors import ContextLengthExceeded
from kvfence.engine.request import SamplingParams
from kvfence.pd.router import Router
from tests.conftest import make_engine, run_all


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    router = Router()
    common = ["--model", str(tiny_dir), "--router", router.addr, "--threads", "1", "--page-size", "4"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "kvfence.pd.cli", "prefill", *common, "--kv-pages", "48",
                          "--transfer-window", "2"]),
        subprocess.Popen([sys.executable, "-m", "kvfence.pd.cli", "decode", *common, "--kv-pages", "96"]),
    ]  # fmt: skip
    try:
        for _ in range(120):  # wait for registration, but fail at once if a worker died
            if router.wait_for_workers(1, 1, timeout=1.0):
                break
            assert all(p.poll() is None for p in procs), "a worker exited before registering"
        else:
            pytest.fail("workers did not register")
        yield router
    finally:
        router.shutdown()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def collect(router: Router, jobs: dict[str, list[int]], params: SamplingParams) -> dict:
    outputs: queue.Queue = queue.Queue()
    for rid, ids in jobs.items():
        router.submit(ids, params, rid, "tenant-a", outputs.put)
    final = {}
    while len(final) < len(jobs):
        out = outputs.get(timeout=120)
        if out.finished:
            final[out.request_id] = out
    return final


def test_pd_over_zeromq_equals_colocated(cluster, tiny_model):
    rng = random.Random(21)
    jobs = {
        f"r{i}": [rng.randrange(3, tiny_model.config.vocab_size) for _ in range(rng.randint(3, 30))]
        for i in range(6)
    }
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    colocated = make_engine(tiny_model)
    for rid, ids in jobs.items():
        colocated.add_request(ids, params, request_id=rid)
    expected = {k: v.token_ids for k, v in run_all(colocated).items()}
    got = collect(cluster, jobs, params)
    assert {k: v.token_ids for k, v in got.items()} == expected
    assert all(v.error_code is None for v in got.values())


def test_router_admission_counts_every_stage(cluster):
    prefill_limits, decode_limits = cluster.limits()
    assert prefill_limits.pool_pages == 48 and decode_limits.pool_pages == 96
    with pytest.raises(ContextLengthExceeded):
        cluster.submit([5] * 300, SamplingParams(max_tokens=4), "too-long", "t", lambda out: None)
