"""PD across real processes and real sockets: a router in this process, a prefill worker and a decode worker
as subprocesses talking ZeroMQ over TCP on loopback, on the tiny model. Output must equal colocated mode."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import subprocess
import sys

import pytest

from kvfence.engine.errors import ContextLengthExceeded
from kvfence.engine.request import SamplingParams
from kvfence.pd.router import Router
from tests.conftest import make_engine, run_all


@contextlib.contextmanager
def start_cluster(tiny_dir, prefill_faults: str = ""):
    router = Router()
    common = ["--model", str(tiny_dir), "--router", router.addr, "--threads", "1", "--page-size", "4"]
    env = {**os.environ, "KVFENCE_FAULTS": prefill_faults}
    procs = [
        subprocess.Popen([sys.executable, "-m", "kvfence.pd.cli", "prefill", *common, "--kv-pages", "64",
                          "--transfer-window", "2"], env=env),
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


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    with start_cluster(tiny_dir) as router:
        yield router


def jobs_for(model, n: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    return {f"r{i}": [rng.randrange(3, vocab) for _ in range(rng.randint(5, 30))] for i in range(n)}


def colocated_reference(model, jobs, params) -> dict:
    engine = make_engine(model)
    for rid, ids in jobs.items():
        engine.add_request(ids, params, request_id=rid)
    return {k: v.token_ids for k, v in run_all(engine).items()}


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
    assert prefill_limits.pool_pages == 64 and decode_limits.pool_pages == 96
    with pytest.raises(ContextLengthExceeded):
        cluster.submit([5] * 300, SamplingParams(max_tokens=4), "too-long", "t", lambda out: None)


def test_placeholder_prefill_and_corrupted_frame_fail_only_their_victims(tiny_dir, tiny_model):
    """The 2026 incident (prefill claims a one-page prompt) and a bit flipped in flight, across processes: both
    victims get kv_integrity_error and no tokens; every other request equals colocated output."""
    jobs = jobs_for(tiny_model, 6, seed=22)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = colocated_reference(tiny_model, jobs, params)
    with start_cluster(tiny_dir, prefill_faults="placeholder_prefill=1,corrupt_frame=1") as router:
        got = collect(router, jobs, params)
    victims = sorted(k for k, v in got.items() if v.error_code)
    assert len(victims) == 2 and all(got[k].error_code == "kv_integrity_error" for k in victims)
    assert all(got[k].token_ids == () and got[k].text == "" for k in victims)
    assert all(got[k].token_ids == expected[k] for k in got if k not in victims)
