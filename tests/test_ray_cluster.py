"""PD on a multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`; kvfence/runtime/ray_cluster.py):
the router and every worker are Ray actors placed by node resources, talking kvfence's own CURVE sockets.

Nodes: the head (the router; prefill resources for two workers) and two decode nodes, one `kvfence_decode` each.
Shown, through the official openai client: 1 prefill x 2 decode gives colocated's greedy outputs, both decode
workers take traffic; a decode node removed mid-run fails only the requests placed on it (503) while the others
finish and every surviving pool audits clean; a node added at run time gets the lost worker back (Ray restarts
the actor there) and it takes traffic; scaled to 2 prefill x 1 decode at run time, outputs still equal
colocated's, and drained actors leave; placement by load spreads long prompts over prefill actors."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvfence.config import Config
from kvfence.engine.request import SamplingParams
from tests.pd_cluster import colocated_reference, free_port, jobs_for

ray = pytest.importorskip("ray", reason="kvfence[ray] is not installed (make test installs it)")
from ray.cluster_utils import Cluster  # noqa: E402

from kvfence.runtime.ray_cluster import start_router  # noqa: E402

KEYS = {"key-a": "tenant-a"}
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def wait_for(condition: Callable[[], Any], what: str, within_s: float = 180.0) -> Any:
    deadline = time.monotonic() + within_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # poll interval
    return value


@pytest.fixture(scope="module")
def deployment(tiny_dir, tmp_path_factory) -> Iterator[dict[str, Any]]:
    keys_file = tmp_path_factory.mktemp("ray") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"kvfence_prefill": 2}, "object_store_memory": 80 << 20},
    )
    decode_nodes = [
        cluster.add_node(num_cpus=2, resources={"kvfence_decode": 1}, object_store_memory=80 << 20)
        for _ in range(2)
    ]
    ray.init(address=cluster.address, namespace="kvfence", log_to_driver=False)
    port = free_port()
    config = Config.of(
        model=str(tiny_dir), dtype="float32", page_size=4, kv_pages=96, threads=1, mode="pd",
        prefill_workers=1, decode_workers=2, api_keys=str(keys_file), port=port, ray="auto",
    )  # fmt: skip
    router = start_router(config, ray)
    try:
        assert ray.get(router.wait_ready.remote(180.0))
        served = router.serve.remote()
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(url + "/health") == 200, "the HTTP front")
        yield {
            "url": url,
            "router": router,
            "cluster": cluster,
            "decode_nodes": decode_nodes,
            "served": served,
        }
    finally:
        ray.get(router.stop.remote(), timeout=60)
        ray.kill(router)
        ray.shutdown()
        cluster.shutdown()


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return 0


def status(d: dict[str, Any]) -> dict[str, Any]:
    return dict(ray.get(d["router"].status.remote()))


def decoders(d: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((w for w in status(d)["workers"] if w["role"] == "decode"), key=lambda w: w["name"])


def client(d: dict[str, Any]) -> OpenAI:
    return OpenAI(base_url=f"{d['url']}/v1", api_key="key-a", max_retries=0, timeout=120)


def complete(d: dict[str, Any], prompt: list[int]) -> Any:
    return client(d).completions.create(
        model="llama", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )


def test_one_prefill_two_decode_actors_match_colocated_and_share_the_traffic(deployment, tiny_model):
    jobs = jobs_for(tiny_model, 8, seed=61)
    expected = colocated_reference(tiny_model, jobs, PARAMS)
    tokenizer_free = {rid: complete(deployment, ids) for rid, ids in jobs.items()}
    for rid, got in tokenizer_free.items():
        assert got.usage.completion_tokens == 8
        assert got.choices[0].text == client_text(tiny_model, expected[rid])
    workers = status(deployment)["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill"]
    assert all(w["placed_total"] > 0 for w in workers)  # placement by load used both decode workers
    supervised = status(deployment)["supervised"]
    assert len({s["node"] for s in supervised if s["role"] == "decode"}) == 2  # one per decode node


def client_text(model: Any, token_ids: tuple[int, ...]) -> str:
    return str(model.tokenizer.decode(list(token_ids)))


def test_a_decode_node_removed_mid_run_fails_only_its_requests_and_a_new_node_brings_it_back(
    deployment, tiny_model
):
    d = deployment
    victim, survivor = decoders(d)
    node_of = {s["name"]: s["node"] for s in status(d)["supervised"]}
    victim_node = next(n for n in d["decode_nodes"] if n.node_id.startswith(node_of[victim["name"]]))
    os.kill(victim["pid"], signal.SIGSTOP)  # its requests stay in flight until the node goes
    jobs = jobs_for(tiny_model, 6, seed=62)
    before = [w["placed_total"] for w in decoders(d)]
    placed = lambda: [w["placed_total"] - b for w, b in zip(decoders(d), before, strict=True)]  # noqa: E731
    with ThreadPoolExecutor(6) as pool:
        answers = {rid: pool.submit(_complete_or_error, d, ids) for rid, ids in jobs.items()}
        wait_for(lambda: sum(placed()) == len(jobs), "every request placed")
        placed_on_victim = placed()[0]
        assert placed_on_victim >= 1 and decoders(d)[0]["in_flight"] == placed_on_victim
        d["cluster"].remove_node(victim_node)
        results = {rid: a.result() for rid, a in answers.items()}
    failed = [r for r in results.values() if r == 503]
    assert len(failed) == placed_on_victim and len(failed) < len(jobs)  # only the victim's requests
    assert all(r == 200 for r in results.values() if r != 503)
    audits, late = ray.get(d["router"].audit.remote(10.0))
    assert late == [] and audits and all(a["ok"] for a in audits), audits  # every surviving pool is clean
    assert [w["name"] for w in decoders(d)] == [survivor["name"]]
    # a node with the resource joins: Ray restarts the lost actor there; it registers and takes traffic
    d["decode_nodes"].append(
        d["cluster"].add_node(num_cpus=2, resources={"kvfence_decode": 1}, object_store_memory=80 << 20)
    )
    wait_for(lambda: len(decoders(d)) == 2, "the restarted decode worker")
    back = next(w for w in decoders(d) if w["name"] == victim["name"])
    assert back["pid"] != victim["pid"]
    os.kill(survivor["pid"], signal.SIGSTOP)  # busy: the next request goes to the worker that came back
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(complete, d, [5, 6, 7])
            wait_for(lambda: any(w["in_flight"] for w in decoders(d)), "a request on the survivor")
            assert complete(d, [8, 9, 10]).usage.completion_tokens == 8
            os.kill(survivor["pid"], signal.SIGCONT)
            assert held.result().usage.completion_tokens == 8
    finally:
        os.kill(survivor["pid"], signal.SIGCONT)
    wait_for(lambda: all(w["pool_free"] is not None for w in decoders(d)), "heartbeats from both")
    assert next(w for w in decoders(d) if w["name"] == victim["name"])["placed_total"] >= 1


def _complete_or_error(d: dict[str, Any], prompt: list[int]) -> int:
    answer = httpx.post(
        f"{d['url']}/v1/completions",
        json={"model": "llama", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
        headers={"Authorization": "Bearer key-a"},
        timeout=120,
    )
    if answer.status_code == 503:
        assert answer.json()["error"]["code"] == "worker_unavailable"
    return answer.status_code


def test_two_prefill_one_decode_after_scaling_match_colocated_and_drained_actors_leave(
    deployment, tiny_model
):
    """Scale 1P x 2D to 2P x 1D at run time (a prefill actor added, the newest decode actor drained): greedy
    outputs equal colocated's and both prefill actors serve; then back to 1P x 2D."""
    d = deployment
    by_role = lambda role: [w for w in status(d)["workers"] if w["role"] == role]  # noqa: E731
    changed = ray.get(d["router"].scale.remote(2, 1))
    assert changed["added"] == ["prefill-1"] and len(changed["draining"]) == 1
    wait_for(lambda: len(by_role("prefill")) == 2 and len(by_role("decode")) == 1, "2 prefill x 1 decode")
    wait_for(lambda: all(s["name"] not in changed["draining"] for s in status(d)["supervised"]), "the drain")
    rng = random.Random(63)
    jobs = {
        f"long{n}": [rng.randrange(3, tiny_model.config.vocab_size) for _ in range(200)] for n in range(2)
    }  # 51 of 96 pages each
    jobs |= jobs_for(tiny_model, 4, seed=63)
    expected = colocated_reference(tiny_model, jobs, PARAMS)
    held = [w["pid"] for w in by_role("prefill")]
    for pid in held:  # both long prompts placed before either finishes: one on each prefill actor
        os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = {}
            for n, (rid, ids) in enumerate(jobs.items()):
                answers[rid] = pool.submit(complete, d, ids)
                if n < 2:
                    wait_for(
                        lambda n=n: sum(w["in_flight"] for w in by_role("prefill")) == n + 1, "placement"
                    )
            for pid in held:
                os.kill(pid, signal.SIGCONT)
            got = {rid: a.result() for rid, a in answers.items()}
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    for rid, answer in got.items():
        assert answer.choices[0].text == client_text(tiny_model, expected[rid]), rid
    assert all(w["placed_total"] > 0 for w in by_role("prefill"))  # both prefill actors served
    changed = ray.get(d["router"].scale.remote(1, 2))
    assert changed == {"added": [changed["added"][0]], "draining": ["prefill-1"]}
    wait_for(
        lambda: len(by_role("prefill")) == 1 and len(by_role("decode")) == 2, "1 prefill x 2 decode again"
    )
    wait_for(lambda: all(s["name"] != "prefill-1" for s in status(d)["supervised"]), "the actor to leave")
    assert complete(d, [9, 9, 9]).usage.completion_tokens == 8


def test_placement_by_load_spreads_long_prompts_over_the_prefill_actors(deployment):
    """A skewed workload (long and short prompts alternating, one tenant) while both prefill workers are held:
    the router puts one long prompt on each (round-robin would put both on the same one, and the tenant's prefix
    affinity yields once a worker is clearly busier: tests/test_invariants_router.py), read from the pages it
    committed to each worker."""
    d = deployment
    ray.get(d["router"].scale.remote(2, 2))
    prefills = lambda: sorted(  # noqa: E731
        (w for w in status(d)["workers"] if w["role"] == "prefill"), key=lambda w: w["name"]
    )
    wait_for(
        lambda: len(prefills()) == 2 and all(w["pool_free"] is not None for w in prefills()), "prefill-2"
    )
    pids = [w["pid"] for w in prefills()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(4) as pool:
            held = []
            for n, length in enumerate((200, 5, 200, 5)):  # one at a time, each placed before the next
                held.append(pool.submit(complete, d, [7 + n] * length))
                wait_for(lambda n=n: sum(w["in_flight"] for w in prefills()) == n + 1, "the placement")
            committed = [w["committed_pages"] for w in prefills()]
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            assert all(h.result().usage.completion_tokens == 8 for h in held)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    long_pages, short_pages = -(-(200 + 1) // 4), -(-(5 + 1) // 4)
    assert sum(committed) == 2 * (long_pages + short_pages)
    assert min(committed) >= long_pages  # one long prompt on each prefill worker (round-robin: both on one)
    assert ray.get(d["router"].scale.remote(1, 2))["draining"] == ["prefill-2"]
    wait_for(lambda: len(prefills()) == 1, "the drain")
