"""Colocated overlap: prefill chunks on the prefill lane while decode steps go on (kvfence/engine/lane.py).

Two harnesses (the prefix cache is off in the second: the oracle counts a shared page as a foreign read):
  - the real engine on a tiny model, with the real `ThreadLane`: the same tokens as steps run one at a time;
  - the engine on the simulator's provenance runner (kvfence/sim/runner.py), with a lane whose plan runs only
    when it lands, a seeded number of steps later: every write the lane makes lands late, after whatever the
    engine did meanwhile (aborts, failures, preemptions, other requests' allocations). The runner's oracle sees
    every read of a foreign or stale slot, independently of the engine's own checks.
"""

from __future__ import annotations

import random
from typing import cast

import pytest

from kvfence.engine.config import EngineConfig
from kvfence.engine.lane import ThreadLane
from kvfence.engine.llm_engine import LLMEngine
from kvfence.engine.model_runner import ModelRunner
from kvfence.engine.output import RequestOutput
from kvfence.engine.plan import Plan, StepResult
from kvfence.engine.request import SamplingParams
from kvfence.faults import Faults
from kvfence.sim.cluster import VOCAB, sim_model
from kvfence.sim.runner import ProvenanceRunner, expected_token
from tests.conftest import make_engine, run_all


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class CountingLane(ThreadLane):
    def __init__(self, runner: ModelRunner) -> None:
        super().__init__(runner, threads=1)
        self.launched = 0

    def launch(self, plan: Plan) -> None:
        self.launched += 1
        super().launch(plan)


def test_overlap_gives_the_tokens_of_serial_steps(tiny_model):
    """Float32: the lane changes when a prefill runs, never what it computes."""
    import torch

    before = torch.get_num_threads()
    rng = random.Random(3)
    vocab = tiny_model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    try:
        results = []
        for overlap in (False, True):
            engine = make_engine(tiny_model, num_threads=2, overlap_prefill=overlap)
            if overlap:
                engine.lane = CountingLane(engine.runner)
            engine.add_request(prompts[0], greedy(12), request_id="r0")
            engine.step()  # r0's prefill, alone: on this thread
            for i, prompt in enumerate(prompts[1:], 1):  # each joins while others decode
                engine.add_request(prompt, greedy(12), request_id=f"r{i}")
                engine.step()
            final = run_all(engine)
            results.append({rid: out.token_ids for rid, out in final.items()})
            if overlap:
                assert cast(CountingLane, engine.lane).launched >= 2
        assert results[0] == results[1]
    finally:
        torch.set_num_threads(before)


class LateLane:
    """A lane whose plan runs when it lands, `rng`-many polls after its launch: all of its writes are late."""

    def __init__(self, runner: ProvenanceRunner, rng: random.Random) -> None:
        self.runner, self.rng = runner, rng
        self.plan: Plan | None = None
        self.polls = 0
        self.launched = 0

    def launch(self, plan: Plan) -> None:
        assert self.plan is None
        self.plan, self.polls = plan, self.rng.randint(0, 6)
        self.launched += 1

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def land(self) -> StepResult:
        assert self.plan is not None
        plan, self.plan = self.plan, None
        return self.runner.run(plan)


def run_overlap_seed(seed: int, checks: bool = True, faults: Faults | None = None) -> dict[str, object]:
    """A seeded colocated workload with aborts, on a pool small enough to preempt; returns what happened."""
    rng = random.Random(seed)
    faults = faults or Faults()
    page_size, num_pages = 2, rng.randint(14, 24)
    runner = ProvenanceRunner(num_pages, page_size, VOCAB, faults)
    config = EngineConfig(
        model="sim", page_size=page_size, kv_pages=num_pages, context_length=40, max_num_seqs=6,
        max_num_batched_tokens=24, prefill_batch_tokens=12, integrity_checks=checks, faults=faults,
        enable_prefix_cache=False, overlap_prefill=True,
    )  # fmt: skip
    lane = LateLane(runner, rng)
    engine = LLMEngine(config, sim_model(), runner=cast(ModelRunner, runner), lane=lane)
    prompts: dict[str, list[int]] = {}
    final: dict[str, RequestOutput] = {}
    for _ in range(rng.randint(20, 60)):
        if rng.random() < 0.5 and len(prompts) < 14:
            rid = f"s{seed}-{len(prompts)}"
            prompts[rid] = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 14))]
            engine.add_request(prompts[rid], greedy(rng.randint(1, 10)), rid, tenant=rng.choice("ab"))
        live = [r.request_id for r in engine.live_requests()]
        if live and rng.random() < 0.15:
            engine.abort(rng.choice(live))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity() if checks else engine.pool.check_integrity()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity() if checks else engine.pool.check_integrity()
    stats = engine.pool.stats()
    assert stats.num_free == stats.num_pages, f"pages leaked: {stats}"
    wrong = []
    for rid, out in final.items():
        if out.finish_reason != "length":
            continue
        n = len(prompts[rid])
        want = tuple(expected_token(rid, n + i, VOCAB) for i in range(len(out.token_ids)))
        if out.token_ids != want:
            wrong.append(rid)
    return {
        "foreign_reads": runner.foreign_reads,
        "wrong": wrong,
        "failed": [rid for rid, o in final.items() if o.error_code],
        "aborted": [rid for rid, o in final.items() if o.finish_reason == "abort"],
        "launched": lane.launched,
    }


@pytest.mark.parametrize("start", range(0, 300, 100))
def test_late_lane_writes_never_reach_anyone(start):
    """Every seed: no foreign read, every finished request has exactly its tokens, nothing fails, no page
    leaks; across the seeds the lane carried prefills and requests were aborted while it ran."""
    launched = aborted = 0
    for seed in range(start, start + 100):
        got = run_overlap_seed(seed)
        assert not got["foreign_reads"], (seed, got["foreign_reads"])
        assert not got["wrong"] and not got["failed"], (seed, got)
        launched += cast(int, got["launched"])
        aborted += len(cast(list[str], got["aborted"]))
    assert launched > 500 and aborted > 50


def test_an_unfenced_lane_leaks_and_the_tags_catch_it():
    """Fault knob `unfenced_lane` (no hold on the lane's pages): with the checks off, some seed's late write
    reaches another request (the provenance oracle sees it); with the checks on, the same seeds read nothing
    foreign, and the victims fail with kv_integrity_error instead."""
    leaked = [
        s for s in range(300) if run_overlap_seed(s, False, Faults(unfenced_lane=10**6))["foreign_reads"]
    ]
    assert leaked, "no seed exercised an abort whose pages were reused before the lane landed"
    for seed in leaked[:10]:
        got = run_overlap_seed(seed, True, Faults(unfenced_lane=10**6))
        assert not got["foreign_reads"] and not got["wrong"], (seed, got)
        assert got["failed"], seed
