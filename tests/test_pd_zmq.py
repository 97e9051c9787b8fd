"""PD across real processes and real sockets: a router in this process, a prefill worker and a decode worker
as subprocesses talking ZeroMQ over TCP on loopback, on the tiny model. Output must equal colocated mode."""

from __future__ import annotations

import os
import queue
import random
import signal
import time

import pytest

from kvfence.engine.errors import ContextLengthExceeded
from kvfence.engine.request import SamplingParams
from tests.conftest import make_engine, run_all
from tests.pd_cluster import collect, colocated_reference, jobs_for, start_cluster


@pytest.fixture(scope="module")
def cluster(tiny_dir, tmp_path_factory):
    # the workers share cores as under `serve --mode pd`: thread counts change between steps, results must not
    with start_cluster(tiny_dir, share_cores=tmp_path_factory.mktemp("cores") / "share") as router:
        yield router


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


def test_kill_9_of_a_decode_worker_fails_its_requests_and_the_cluster_keeps_serving(tiny_dir, tiny_model):
    params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
    jobs = jobs_for(tiny_model, 4, seed=23)
    jobs = {k: v[:8] for k, v in jobs.items()}  # short prompts, long generations: all four are decoding
    outputs: queue.Queue = queue.Queue()
    with start_cluster(tiny_dir, num_decode=2, dead_after_s=1.5) as router:
        for rid, ids in jobs.items():
            router.submit(ids, params, rid, "tenant-b", outputs.put)
        started: set[str] = set()
        while len(started) < len(jobs):
            started.add(outputs.get(timeout=120).request_id)
        victim_decode = router.placement("r1")[1]
        os.kill(victim_decode.pid, signal.SIGKILL)
        final = {}
        while len(final) < len(jobs):
            out = outputs.get(timeout=120)
            if out.finished:
                final[out.request_id] = out
        lost = {k for k, v in final.items() if v.error_code == "worker_unavailable"}
        assert "r1" in lost and all(final[k].finish_reason == "length" for k in final if k not in lost)
        # the cluster keeps serving on the surviving workers
        again = collect(router, {"after": jobs["r0"]}, SamplingParams(max_tokens=4, temperature=0.0))
        assert again["after"].error_code is None
        # and the prefill pool is whole again (as the prefill's heartbeats report it)
        prefill = next(w for w in router.workers.values() if w.role == "prefill")
        deadline = time.monotonic() + 30
        while prefill.pool_free != 64:
            assert time.monotonic() < deadline, f"prefill pool not whole: {prefill.pool_free} of 64 free"
            time.sleep(0.2)  # poll interval: the pool count arrives with the next heartbeat


def test_a_reused_transfer_id_fails_the_second_request_only(tiny_dir, tiny_model):
    """Bug 4 of the design brief (metadata collision): the router hands the next request the previous one's
    transfer id; decode refuses the reuse, so the second request fails and the first is untouched."""
    jobs = jobs_for(tiny_model, 2, seed=25)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = colocated_reference(tiny_model, jobs, params)
    with start_cluster(tiny_dir) as router:
        router.faults.reuse_transfer_id = 1
        got = {}
        for (
            rid,
            ids,
        ) in jobs.items():  # one at a time, so the first transfer is live or done when the second comes
            got.update(collect(router, {rid: ids}, params))
    assert got["r0"].token_ids == expected["r0"] and got["r0"].error_code is None
    assert got["r1"].error_code == "kv_integrity_error" and got["r1"].token_ids == ()
