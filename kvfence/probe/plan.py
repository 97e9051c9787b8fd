"""The attack mix: which requests tenants A and B send, and what a correct server must answer to each.

Pure: `build_plan` turns the target's limits and a token model into jobs; nothing here does IO.

Tenant A plants secrets: short prompts and long ones (a filler preamble before the canary lines), streamed and
not. Tenant B, at the same time, sends what broke real servers: prompts just under, at and just over the context
length, prompts over the KV pool when its size is known, `max_tokens` that pushes prompt + output over the limit,
streams it aborts after a few tokens, a burst of simultaneous requests, and plain baits of many lengths. Every B
prompt ends with the trigger line, so a B request that reads A's KV tends to print A's secret. After that, B's
prefix-cache probes: A's long preambles (each once) against shuffled preambles of the same length, timed.
Last, the load-timing check: B's short streamed probes one at a time, with A idle, then while A keeps a few long
prompts in flight (light), then while A keeps `flood` in flight (heavy): more than the server can serve at once,
so that a queue builds (each with a secret: pressure on the pool is when stale pages get read).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

from kvfence.probe.canary import Form, Secret, make_secret
from kvfence.probe.prompts import HEADER, TokenModel, TokenRange, a_prompt, b_prompt, filler, shuffled

MIN_REQUESTS = 40
NUM_TIMING_PAIRS = 6  # the one-sided exact p-value of 6 vs 6 can reach 1/924, well under the 0.01 threshold
PLANT_MAX_TOKENS = 16
BAIT_MAX_TOKENS = 16
ABORT_MAX_TOKENS = 64
ABORT_AFTER_CHUNKS = 3
TIMING_MAX_TOKENS = 8  # only the first token is timed; the rest is room to print a leaked secret
NUM_LOAD_SAMPLES = 8  # B's probes per level of A's load (8 vs 8: p < 0.01 survives 13 of 64 pairs inverted)
LOAD_PROBE_TOKENS = 64  # B's load probes: short, so that their time to first token is mostly waiting
FLOOD_MAX_TOKENS = 4  # A's flood is prompts: a short output keeps them queueing for the prefill
MAX_FLOOD_TOKENS = 2048  # A's flood prompts: half the context, up to this
# A's flood sends up to this many requests per slot of its heavy level: under fcfs each of B's probes waits about
# one round, so the heavy level needs NUM_LOAD_SAMPLES rounds, its ramp one, and the light level the rest
FLOOD_ROUNDS = NUM_LOAD_SAMPLES + 4
LIGHT_FRACTION = 4  # A's light level: `flood` / this in flight (at least 1)
CANARY_TOKENS = 80  # three canary lines and the trigger, in the most verbose common tokenizers
MAX_BAIT_TOKENS = 4096  # baits stay affordable on long-context targets; the boundary probes go to the limit
BAIT_FRACTIONS = (
    0.05,
    0.5,
    0.1,
    0.9,
    0.05,
    0.25,
    0.1,
    0.75,
)  # short ones are mostly stale KV when a leak happens


class Tenant(Enum):
    A = "A"
    B = "B"


class Kind(Enum):
    PLANT = "plant"  # A: canary lines with a secret
    PLANT_LONG = "plant_long"  # A: a filler preamble, then canary lines
    BAIT = "bait"  # B: filler and the trigger
    UNDER_LIMIT = "under_limit"  # B: prompt + max_tokens == context length (must fit the context)
    AT_LIMIT = "at_limit"  # B: prompt == context length (no room for output: must be rejected)
    OVER_LIMIT = "over_limit"  # B: prompt over the context length (must be rejected)
    OVER_OUTPUT = "over_output"  # B: prompt + max_tokens over the context length
    OVER_POOL = "over_pool"  # B: prompt over the KV pool, within the context (reject, or serve it correctly)
    ABORT = "abort"  # B: a stream closed after a few chunks
    BURST = "burst"  # B: one of several requests sent at the same moment
    PREFIX = "prefix"  # B: A's long preamble (prefix-cache timing)
    FRESH = "fresh"  # B: a shuffled preamble of the same length (the control)
    LOAD_QUIET = "load_quiet"  # B: a short timed probe while A is idle
    LOAD_LIGHT = "load_light"  # B: the same while A keeps a few requests in flight
    LOAD_BUSY = "load_busy"  # B: the same while A floods
    FLOOD = "flood"  # A: a long prompt with a secret, kept in flight by the load check
    CALIBRATION = "calibration"  # B: the probe's own calibration requests


class Expect(Enum):
    SERVE = "serve"  # a 2xx, or a rejection by a server whose pool is smaller than its context
    REJECT = "reject"  # a 4xx; a 2xx is a finding


@dataclass(frozen=True, slots=True)
class Job:
    id: str
    tenant: Tenant
    kind: Kind
    prompt: str
    max_tokens: int
    stream: bool
    expect: Expect
    tokens: TokenRange  # the prompt's token count as the probe predicts it
    secret: Secret | None = None
    abort_after: int | None = None  # close the stream after this many content chunks
    group: int | None = None  # jobs of one burst share a group and start together


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The load-timing check: B's `quiet` one at a time with A idle, `light` while A keeps `light_in_flight` of
    `flood` in flight, `busy` while A keeps `in_flight` (the rest of the flood is not sent once `busy` is done)."""

    quiet: list[Job]
    light: list[Job]
    busy: list[Job]
    flood: list[Job]
    light_in_flight: int
    in_flight: int

    def jobs(self) -> list[Job]:
        return [*self.quiet, *self.light, *self.busy, *self.flood]


@dataclass(frozen=True, slots=True)
class Plan:
    main: list[Job | list[Job]]  # in start order; a list is a burst
    timing: list[Job]  # PREFIX and FRESH, alternating, run after `main`
    load: LoadPlan | None = None  # run last; None: not enough budget, or --flood 0

    @property
    def num_requests(self) -> int:
        """The attack mix, without A's flood (only as much of it is sent as the load check needs)."""
        return len(self.jobs()) - (len(self.load.flood) if self.load else 0)

    def jobs(self) -> list[Job]:
        main = [x for j in self.main for x in (j if isinstance(j, list) else [j])]
        return [*main, *self.timing, *(self.load.jobs() if self.load else [])]


@dataclass(frozen=True, slots=True)
class Limits:
    capacity: int  # the longest prompt + output the target says it serves (context length)
    pool_tokens: int | None = None  # the operator's figure for the smallest KV pool, when known


class _Builder:
    def __init__(self, rng: random.Random, limits: Limits, tokens: TokenModel) -> None:
        self.rng, self.limits, self.tokens = rng, limits, tokens
        self.count = 0

    def job(
        self,
        tenant: Tenant,
        kind: Kind,
        prompt: str,
        tokens: TokenRange,
        max_tokens: int,
        *,
        stream: bool = False,
        expect: Expect = Expect.SERVE,
        secret: Secret | None = None,
        abort_after: int | None = None,
        group: int | None = None,
    ) -> Job:
        self.count += 1
        jid = f"{tenant.value}{self.count:04d}-{kind.value}"
        return Job(jid, tenant, kind, prompt, max_tokens, stream, expect, tokens, secret, abort_after, group)

    def b_sized(
        self,
        kind: Kind,
        num_tokens: int,
        max_tokens: int,
        *,
        stream: bool = False,
        expect: Expect = Expect.SERVE,
        abort_after: int | None = None,
        group: int | None = None,
    ) -> Job:
        """A B prompt of `num_tokens` tokens (as the token model predicts them)."""
        words = self.tokens.words_for(num_tokens)
        prompt = b_prompt(filler(self.rng, words))
        return self.job(
            Tenant.B,
            kind,
            prompt,
            self.tokens.prompt_range(prompt, words),
            max_tokens,
            stream=stream,
            expect=expect,
            abort_after=abort_after,
            group=group,
        )

    def plant(self, index: int, preamble_tokens: int = 0, kind: Kind | None = None) -> Job:
        secret = make_secret(self.rng, list(Form)[index % len(Form)])
        preamble = filler(self.rng, self.tokens.words_for(preamble_tokens)) if preamble_tokens else ""
        prompt = a_prompt(secret, preamble)
        kind = kind or (Kind.PLANT_LONG if preamble else Kind.PLANT)
        return self.job(
            Tenant.A,
            kind,
            prompt,
            self.tokens.text_range(prompt),
            FLOOD_MAX_TOKENS if kind is Kind.FLOOD else PLANT_MAX_TOKENS,
            stream=index % 2 == 1,
            secret=secret,
        )

    def bait(self, index: int) -> Job:
        room = self.limits.capacity - BAIT_MAX_TOKENS
        size = min(MAX_BAIT_TOKENS, max(8, int(room * BAIT_FRACTIONS[index % len(BAIT_FRACTIONS)])))
        return self.b_sized(Kind.BAIT, size, BAIT_MAX_TOKENS, stream=index % 2 == 0)


def build_plan(
    rng: random.Random,
    num_requests: int,
    limits: Limits,
    tokens: TokenModel,
    concurrency: int,
    flood: int = 0,
) -> Plan:
    """`num_requests` (at least MIN_REQUESTS) jobs: the timing pairs with their long plants, the boundary
    probes, aborted streams, a burst, B's load-timing probes when the budget leaves room for them beyond
    MIN_REQUESTS, and for the rest short plants and baits, 3 to 2: every B request is scanned for leaks, and a
    leak is only as likely as A's secrets are common. On top: A's flood for the load check, up to FLOOD_ROUNDS x
    `flood` requests (0: no check), of which only those needed are sent."""
    assert num_requests >= MIN_REQUESTS
    b = _Builder(rng, limits, tokens)
    load = _load_check(b, flood, num_requests - MIN_REQUESTS)
    num_requests -= 3 * NUM_LOAD_SAMPLES if load else 0
    ctx = limits.capacity
    preamble = max(8, min(ctx // 4, ctx - PLANT_MAX_TOKENS - CANARY_TOKENS, 1024))
    long_plants = [b.plant(i, preamble) for i in range(NUM_TIMING_PAIRS)]
    timing = _timing_pairs(b, long_plants)
    b_jobs: list[Job | list[Job]] = [*_boundary_jobs(b), *_aborts(b, max(1, num_requests // 40))]
    b_jobs.append([b.b_sized(Kind.BURST, min(MAX_BAIT_TOKENS, ctx // 3), BAIT_MAX_TOKENS, group=1)
                   for _ in range(min(8, max(4, 2 * concurrency)))])  # fmt: skip
    used = len(long_plants) + len(timing) + sum(len(j) if isinstance(j, list) else 1 for j in b_jobs)
    rest = max(0, num_requests - used)
    plants = long_plants + [b.plant(i) for i in range(rest * 3 // 5)]
    b_jobs += [b.bait(i) for i in range(rest - rest * 3 // 5)]
    rng.shuffle(plants)
    rng.shuffle(b_jobs)
    return Plan(_interleave(plants, b_jobs), timing, load)


def _load_check(b: _Builder, in_flight: int, budget: int) -> LoadPlan | None:
    """B's probes at three levels of A's load (within `budget`), and A's flood on top: FLOOD_ROUNDS requests per
    slot of its heavy level; None when `in_flight` is below 2 (no light level below it) or `budget` is short."""
    if in_flight < 2 or budget < 3 * NUM_LOAD_SAMPLES:
        return None
    ctx = b.limits.capacity
    size = max(8, min(ctx // 2, ctx - FLOOD_MAX_TOKENS - CANARY_TOKENS, MAX_FLOOD_TOKENS))
    probe = min(LOAD_PROBE_TOKENS, max(8, ctx // 8))

    def probes(kind: Kind) -> list[Job]:
        return [b.b_sized(kind, probe, TIMING_MAX_TOKENS, stream=True) for _ in range(NUM_LOAD_SAMPLES)]

    quiet, light, busy = probes(Kind.LOAD_QUIET), probes(Kind.LOAD_LIGHT), probes(Kind.LOAD_BUSY)
    flood = [b.plant(i, size, Kind.FLOOD) for i in range(FLOOD_ROUNDS * in_flight)]
    return LoadPlan(quiet, light, busy, flood, max(1, in_flight // LIGHT_FRACTION), in_flight)


def _boundary_jobs(b: _Builder) -> list[Job]:
    """Just under (prompt + output == context), at (no room for output) and over the context length; output
    that pushes prompt + max_tokens over it; and a prompt over the KV pool when its size is known."""
    ctx, pool = b.limits.capacity, b.limits.pool_tokens
    over = ctx + (16 if b.tokens.exact else max(16, ctx // 4))  # an inexact count must still land over
    jobs = [
        b.b_sized(Kind.UNDER_LIMIT, ctx - 8, 8, stream=True),
        b.b_sized(Kind.AT_LIMIT, ctx, 1, expect=Expect.REJECT),
        b.b_sized(Kind.OVER_LIMIT, over, 1, expect=Expect.REJECT),
        b.b_sized(Kind.OVER_OUTPUT, ctx // 2, ctx, expect=Expect.REJECT),
    ]
    if pool is not None and pool + 16 < ctx - BAIT_MAX_TOKENS:
        jobs.append(b.b_sized(Kind.OVER_POOL, pool + 16, BAIT_MAX_TOKENS))
    return jobs


def _aborts(b: _Builder, count: int) -> list[Job]:
    size = min(MAX_BAIT_TOKENS, b.limits.capacity // 4)
    return [b.b_sized(Kind.ABORT, size, ABORT_MAX_TOKENS, stream=True, abort_after=ABORT_AFTER_CHUNKS)
            for _ in range(count)]  # fmt: skip


def _timing_pairs(b: _Builder, long_plants: list[Job]) -> list[Job]:
    """For each long plant: B sends its preamble (a prefix of A's prompt, up to and including the trigger,
    never the secret) and, as the control, the same words shuffled."""
    jobs = []
    for plant in long_plants:  # PREFIX or FRESH first by a coin flip: no order effect can pass for a signal
        preamble = plant.prompt.split("\n", 1)[0].removeprefix(f"{HEADER} ")
        prompt = b_prompt(preamble)
        size = b.tokens.prompt_range(prompt, len(preamble.split(" ")))
        pair = [
            b.job(Tenant.B, Kind.PREFIX, prompt, size, TIMING_MAX_TOKENS, stream=True),
            b.job(
                Tenant.B,
                Kind.FRESH,
                b_prompt(shuffled(b.rng, preamble)),
                size,
                TIMING_MAX_TOKENS,
                stream=True,
            ),
        ]
        jobs += pair if b.rng.random() < 0.5 else pair[::-1]
    return jobs


def _interleave(a_jobs: list[Job], b_jobs: list[Job | list[Job]]) -> list[Job | list[Job]]:
    """Two of A's first (so the first baits have something to find), then alternating."""
    out: list[Job | list[Job]] = list(a_jobs[:2])
    rest_a = a_jobs[2:]
    for i in range(max(len(rest_a), len(b_jobs))):
        if i < len(b_jobs):
            out.append(b_jobs[i])
        if i < len(rest_a):
            out.append(rest_a[i])
    return out
