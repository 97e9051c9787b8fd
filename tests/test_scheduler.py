"""Scheduling policy that is not covered through the engine: how prefills of several waiting requests share a
step under `prefill_batch_tokens`."""

from __future__ import annotations

from kvfence.config import SchedulerOptions
from kvfence.engine.request import Request, SamplingParams
from kvfence.engine.scheduler import Scheduler
from kvfence.ids import RequestId
from kvfence.kv.pool import PagePool


def scheduler(prefill_batch_tokens: int, lengths: list[int]) -> Scheduler:
    config = SchedulerOptions(
        max_num_seqs=16, max_num_batched_tokens=512, prefill_batch_tokens=prefill_batch_tokens
    )
    sched = Scheduler(config, 1024, PagePool(512, 4, lease_prefix=5), ())
    for i, n in enumerate(lengths):
        sched.add(Request(RequestId(f"r{i}"), list(range(3, 3 + n)), SamplingParams(max_tokens=4)))
    return sched


def first_step(prefill_batch_tokens: int, lengths: list[int]) -> list[int]:
    return [s.num_new_tokens for s in scheduler(prefill_batch_tokens, lengths).schedule()]


def test_long_prefills_run_one_per_step_short_ones_together():
    assert first_step(0, [196, 196, 196]) == [196, 196, 120]  # no limit: the burst fills the step (512)
    assert first_step(256, [196, 196, 196]) == [196]  # each fills the matmuls alone: one per step
    assert first_step(256, [20] * 20) == [20] * 12  # short prompts still batch, up to the limit
    assert first_step(256, [1000]) == [512]  # one long prompt alone still takes the whole step budget


def test_a_held_back_prefill_goes_first_in_the_next_step_and_decodes_do_not_count():
    sched = scheduler(256, [196, 196])
    assert [s.request.request_id for s in sched.schedule()] == ["r0"]
    r0 = sched.running[0]
    r0.num_computed_tokens = 196  # as if the step ran and sampled a token: r0 now decodes, one token a step
    r0.token_ids.append(50)
    step = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in step] == [("r0", 1), ("r1", 196)]
