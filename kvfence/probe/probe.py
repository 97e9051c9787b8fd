"""`kvfence probe`: run the attack mix against a target and judge the replies.

Lifecycle:
1. Discovery and calibration (calibrate.py): exit status 2 if the target is unreachable or misconfigured.
2. The main phase: tenant A's plants and tenant B's attack mix, interleaved, at most `concurrency` in flight
   (a burst takes one slot and fires all its requests at once).
3. The timing phase: B's prefix probes and their controls, one at a time, alternating, after A's plants are done.
4. The load phase: B's short probes one at a time with A idle, then while A keeps a quarter of `flood` long
   prompts in flight, then while A keeps `flood` in flight (at each level B starts once one of A's requests sent
   at that level has come back: the queue has formed); the flood's requests still running are cancelled.
5. Findings (findings.py) and the report (report.py).

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
from kvfence.probe.plan import Job, Limits, LoadPlan, Plan, build_plan
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
    flood: int = 16  # A's requests in flight during the load-timing check; 0: no check


def run_probe(config: ProbeConfig) -> ProbeReport:
    """Probe the target. Raises calibrate.TargetError when it cannot be probed at all."""
    return asyncio.run(_probe(config))


async def _probe(config: ProbeConfig) -> ProbeReport:
    start = time.monotonic()
    rng = random.Random(config.seed)
    pool = httpx.Limits(max_connections=config.concurrency + 16, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(limits=pool) as client:
        cal = await calibrate(client, config.target, config.context_length, rng)
        limits = Limits(cal.capacity, config.pool_tokens)
        plan = build_plan(rng, config.num_requests, limits, cal.tokens, config.concurrency, config.flood)
        if cal.count is not None:  # the server's own tokenizer: exact expectations for every prompt
            plan = await count_plan(plan, cal.count)
        results: list[Result] = []
        left = config.max_duration_s - (time.monotonic() - start)
        with tqdm(
            total=plan.num_requests, desc="kvfence probe", unit="req", disable=not config.progress
        ) as bar:
            complete = await _run_plan(client, config, plan, results, lambda: bar.update(1), left)
    return _judge(config, cal, plan, results, complete, time.monotonic() - start)


async def _load_phase(
    client: httpx.AsyncClient,
    config: ProbeConfig,
    load: LoadPlan,
    results: list[Result],
    tick: Callable[[], object],
) -> None:
    """B's probes with A idle, under A's light load, then under its heavy load (see the module docstring)."""
    for job in load.quiet:
        results.append(await send(client, config.target, job))
        tick()
    slots = asyncio.Semaphore(load.light_in_flight)
    sent = 0  # flood requests started so far
    steady_after = 0  # the level is steady once a flood request started at or after this index comes back
    steady = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def flood_one(index: int, job: Job) -> None:
        try:
            result = await send(client, config.target, job)
        finally:
            slots.release()
        results.append(result)  # (no tick: the progress bar counts the attack mix, not the flood)
        if index >= steady_after:
            steady.set()

    async def feed() -> None:
        nonlocal sent
        for job in load.flood:
            await slots.acquire()
            tasks.append(asyncio.create_task(flood_one(sent, job)))
            sent += 1
        steady.set()  # out of flood requests: B goes on with what load is left

    async def level(probes: list[Job]) -> None:
        await steady.wait()  # one of A's requests that queued at this level came back: the queue has formed
        for job in probes:
            results.append(await send(client, config.target, job))
            tick()

    feeder = asyncio.create_task(feed())
    try:
        await level(load.light)
        steady.clear()
        steady_after = sent
        if feeder.done():  # the flood ran out at the light level: no request of the heavy one will come back
            steady.set()
        for _ in range(load.in_flight - load.light_in_flight):
            slots.release()
        await level(load.busy)
    finally:  # the rest of the flood is not needed: cancelled (the server sees its clients go)
        for task in (feeder, *tasks):
            task.cancel()
        await asyncio.gather(feeder, *tasks, return_exceptions=True)


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
            if plan.load is not None:
                await _load_phase(client, config, plan.load, results, tick)
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
    load = F.load_test(
        replies, plan.load.in_flight if plan.load else 0, plan.load.light_in_flight if plan.load else 0
    )
    found = [
        *F.leaks(replies),
        *limit_findings,
        *F.usage(replies),
        *F.speed(replies, cal.prefill_tokens_per_s),
        *F.prefix_timing(timing),
        *F.load_timing(load),
    ]
    notes = [*cal.notes, *limit_notes, *F.failures(replies)]
    if not complete:
        notes.append(
            f"time budget of {config.max_duration_s:.0f} s ran out after {len(results)} of "
            f"{plan.num_requests} requests; the rest were not sent"
        )
    return ProbeReport(
        config.target, cal, replies, found, timing, load, notes, plan.num_requests, complete, elapsed
    )
