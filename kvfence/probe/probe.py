"""`kvfence probe`: run the attack mix against a target and judge the replies.

Lifecycle:
1. Discovery and calibration (calibrate.py): exit status 2 if the target is unreachable or misconfigured.
2. The main phase: tenant A's plants and tenant B's attack mix, interleaved, at most `concurrency` in flight
   (a burst takes one slot and fires all its requests at once).
3. The timing phase: B's prefix probes and their controls, one at a time, alternating, after A's plants are done.
4. Findings (findings.py) and the report (report.py).

Bounded: `num_requests` jobs plus at most seven calibration requests, each with its own timeout, and the whole run
within `max_duration_s`; when the time runs out, requests in flight are cancelled and the report says so.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from kvfence.probe import findings as F
from kvfence.probe.calibrate import Calibration, calibrate, count_plan
from kvfence.probe.client import Result, Target, send
from kvfence.probe.plan import Job, Limits, Plan, build_plan
from kvfence.probe.report import ProbeReport


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    target: Target
    context_length: int | None = None  # None: what /v1/models says
    pool_tokens: int | None = None  # the smallest KV pool, if the operator knows it (kvfence audit says)
    num_requests: int = 200
    concurrency: int = 8
    max_duration_s: float = 900.0
    seed: int | None = None
    progress: bool = True


def run_probe(config: ProbeConfig) -> ProbeReport:
    """Probe the target. Raises calibrate.TargetError when it cannot be probed at all."""
    return asyncio.run(_probe(config))


async def _probe(config: ProbeConfig) -> ProbeReport:
    start = time.monotonic()
    rng = random.Random(config.seed)
    pool = httpx.Limits(max_connections=config.concurrency + 16, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(limits=pool) as client:
        cal = await calibrate(client, config.target, config.context_length, rng)
        plan = build_plan(
            rng, config.num_requests, Limits(cal.capacity, config.pool_tokens), cal.tokens, config.concurrency
        )
        if cal.count is not None:  # the server's own tokenizer: exact expectations for every prompt
            plan = await count_plan(plan, cal.count)
        results: list[Result] = []
        left = config.max_duration_s - (time.monotonic() - start)
        with tqdm(
            total=plan.num_requests, desc="kvfence probe", unit="req", disable=not config.progress
        ) as bar:
            complete = await _run_plan(client, config, plan, results, lambda: bar.update(1), left)
    return _judge(config, cal, plan, results, complete, time.monotonic() - start)


async def _run_plan(
    client: httpx.AsyncClient,
    config: ProbeConfig,
    plan: Plan,
    results: list[Result],
    tick: Callable[[], object],
    seconds: float,
) -> bool:
    """Run both phases, appending to `results` as replies arrive; False if the time budget ran out."""
    try:
        async with asyncio.timeout(max(seconds, 0.0)):
            await _main_phase(client, config, plan.main, results, tick)
            for job in plan.timing:  # one at a time: nothing else competes with a timed request
                results.append(await send(client, config.target, job))
                tick()
    except TimeoutError:
        return False
    return True


async def _main_phase(
    client: httpx.AsyncClient,
    config: ProbeConfig,
    items: list[Job | list[Job]],
    results: list[Result],
    tick: Callable[[], object],
) -> None:
    slots = asyncio.Semaphore(config.concurrency)

    async def run(item: Job | list[Job]) -> None:
        try:
            jobs = item if isinstance(item, list) else [item]
            replies = await asyncio.gather(*(send(client, config.target, j) for j in jobs))
        finally:
            slots.release()
        for reply in replies:
            results.append(reply)
            tick()

    async with asyncio.TaskGroup() as group:
        for item in items:
            await slots.acquire()
            group.create_task(run(item))


def _judge(
    config: ProbeConfig, cal: Calibration, plan: Plan, results: list[Result], complete: bool, elapsed: float
) -> ProbeReport:
    replies = [*cal.results, *results]
    limit_findings, limit_notes = F.limits(replies, cal.capacity)
    timing = F.timing_test(replies, cal.prefill_tokens_per_s)
    found = [
        *F.leaks(replies),
        *limit_findings,
        *F.usage(replies),
        *F.speed(replies, cal.prefill_tokens_per_s),
        *F.prefix_timing(timing),
    ]
    notes = [*cal.notes, *limit_notes, *F.failures(replies)]
    if not complete:
        notes.append(
            f"time budget of {config.max_duration_s:.0f} s ran out after {len(results)} of "
            f"{plan.num_requests} requests; the rest were not sent"
        )
    return ProbeReport(
        config.target, cal, replies, found, timing, notes, plan.num_requests, complete, elapsed
    )
