"""From replies to findings. Pure: every check is a function of the results and the calibration numbers.

A finding is something a correct server never does:

- `leak`: a reply contains a secret (or a FRAGMENT_CHARS-long run of one) that another request carried. Across
  tenants that is the product's worst failure; between two requests of tenant A it is the same bug, seen sooner.
- `accepted_over_limit`: a 2xx to a prompt that leaves no room for its `max_tokens` within the context length,
  by the server's own count (`usage`) or by the probe's lower bound for the prompt.
- `past_context`: a reply whose prompt + completion tokens exceed the context length.
- `usage_mismatch`: `usage.prompt_tokens` outside the range the probe predicts for the prompt it sent.
- `too_fast`: a reply whose first token came sooner than FAST_FRACTION of the time the server's own prefill rate
  needs for that many prompt tokens (a placeholder served instead of the prompt: the 2026 incident's clue).
- `prefix_timing`: B's probes that share A's long prefixes get their first token significantly sooner than
  shuffled controls of the same length (one-sided Mann-Whitney U, p < ALPHA, a median ratio under RATIO_LIMIT
  and a difference of at least MIN_TIMING_DIFF_S): a prefix cache shared across tenants, readable through timing.
- `load_timing`: B's short probes get their first token significantly later while A keeps many long prompts in
  flight (more than the server serves at once) than while A keeps a few (one-sided Mann-Whitney U, p < ALPHA),
  by more than LOAD_RATIO_LIMIT times (median) and at least MIN_TIMING_DIFF_S: B waits in a queue that grows
  with A's load, so A crowds B out and B can read how much A sends. B's time with A idle is reported, not
  tested: on any server that shares its compute, B's request shares a step with A's work once A has any, so
  idle against busy always differs by about one step; what a fair scheduler bounds is the growth beyond it.

Failed requests (5xx, error events, timeouts) are not findings: failing closed is what a server should do when
its integrity checks fire. They are counted in the notes.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvfence.probe.canary import find_leak
from kvfence.probe.client import Result
from kvfence.probe.plan import Expect, Kind, Tenant
from kvfence.probe.stats import mann_whitney_less

FAST_FRACTION = 0.25
MIN_EXPECTED_PREFILL_S = 0.05  # shorter prefills are lost in network and scheduling noise
ALPHA = 0.01
RATIO_LIMIT = 0.7
MIN_TIMING_DIFF_S = 0.01  # a prefix cache hit on a prefix worth timing saves at least this much
MIN_TIMING_SAMPLES = 4
LOAD_RATIO_LIMIT = 2.0  # heavy over light: a fair scheduler keeps B's wait at about one step at both
_NO_USAGE_CHECK = (Kind.CALIBRATION,)


class FindingKind(Enum):
    LEAK = "leak"
    ACCEPTED_OVER_LIMIT = "accepted_over_limit"
    PAST_CONTEXT = "past_context"
    USAGE_MISMATCH = "usage_mismatch"
    TOO_FAST = "too_fast"
    PREFIX_TIMING = "prefix_timing"
    LOAD_TIMING = "load_timing"


@dataclass(frozen=True, slots=True)
class Finding:
    kind: FindingKind
    request_id: str | None
    message: str
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TimingTest:
    num_prefix: int
    num_fresh: int
    median_prefix_s: float | None
    median_fresh_s: float | None
    p_value: float | None  # None: not tested (see `skipped`)
    skipped: str | None = None

    @property
    def significant(self) -> bool:
        if self.p_value is None or self.median_prefix_s is None or not self.median_fresh_s:
            return False
        faster = self.median_prefix_s / self.median_fresh_s < RATIO_LIMIT
        return (
            self.p_value < ALPHA
            and faster
            and self.median_fresh_s - self.median_prefix_s >= MIN_TIMING_DIFF_S
        )


def leaks(results: Sequence[Result]) -> list[Finding]:
    """Every reply, scanned for every secret that another request carried."""
    secrets = [(r.job.id, r.job.secret) for r in results if r.job.secret is not None]
    found = []
    for r in results:
        if not r.text:
            continue
        for owner, secret in secrets:
            leak = None if owner == r.job.id else find_leak(secret, r.text, r.job.prompt)
            if leak is None:
                continue
            across = r.job.tenant is not Tenant.A
            whose = "tenant A's" if across else "another tenant-A request's"
            found.append(
                Finding(
                    FindingKind.LEAK,
                    r.job.id,
                    f"{r.job.id} (tenant {r.job.tenant.value}, {r.job.kind.value}) printed {whose} secret from "
                    f"{owner}: {'all of it' if leak.complete else repr(leak.fragment)}",
                    {
                        "secret_owner": owner,
                        "secret": secret.text,
                        "fragment": leak.fragment,
                        "complete": leak.complete,
                        "cross_tenant": across,
                        "reply": r.text[:400],
                        "status": r.status,
                    },
                )
            )
    return found


def limits(results: Sequence[Result], capacity: int) -> tuple[list[Finding], list[str]]:
    """2xx replies to prompts that should have been rejected, and replies that ran past the context."""
    found, notes = [], []
    for r in results:
        if r.status is None or not 200 <= r.status < 300:
            continue
        if r.job.kind in (Kind.AT_LIMIT, Kind.OVER_LIMIT):
            evidence = max(r.prompt_tokens or 0, r.job.tokens.lo)
            if evidence + r.job.max_tokens > capacity:
                found.append(_over_limit(r, evidence, capacity))
            else:
                notes.append(f"{r.job.id}: served; the server counts its prompt as {r.prompt_tokens} tokens")
        elif (r.prompt_tokens or 0) + (r.completion_tokens or 0) > capacity:
            found.append(_past_context(r, capacity))
        elif r.job.kind is Kind.OVER_OUTPUT:
            notes.append(f"{r.job.id}: max_tokens over the limit was served, stopping within the context")
    return found, notes


def _over_limit(r: Result, evidence: int, capacity: int) -> Finding:
    message = (
        f"{r.job.id} ({r.job.kind.value}): HTTP {r.status} for a {evidence}-token prompt with "
        f"max_tokens={r.job.max_tokens}; the context length is {capacity}"
    )
    details: dict[str, object] = {
        "status": r.status,
        "prompt_tokens": r.prompt_tokens,
        "predicted": str(r.job.tokens),
    }
    return Finding(FindingKind.ACCEPTED_OVER_LIMIT, r.job.id, message, details)


def _past_context(r: Result, capacity: int) -> Finding:
    message = (
        f"{r.job.id} ({r.job.kind.value}) was served {r.prompt_tokens} prompt + {r.completion_tokens} "
        f"completion tokens, over the context length of {capacity}"
    )
    details: dict[str, object] = {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens}
    return Finding(FindingKind.PAST_CONTEXT, r.job.id, message, details)


def usage(results: Sequence[Result]) -> list[Finding]:
    found = []
    for r in results:
        accepted = r.status is not None and 200 <= r.status < 300
        if not accepted or r.prompt_tokens is None or r.job.kind in _NO_USAGE_CHECK:
            continue
        if r.prompt_tokens not in r.job.tokens:
            found.append(
                Finding(
                    FindingKind.USAGE_MISMATCH,
                    r.job.id,
                    f"{r.job.id} ({r.job.kind.value}): usage.prompt_tokens is {r.prompt_tokens}, the prompt sent "
                    f"is {r.job.tokens} tokens",
                    {
                        "prompt_tokens": r.prompt_tokens,
                        "predicted_lo": r.job.tokens.lo,
                        "predicted_hi": r.job.tokens.hi,
                    },
                )
            )
    return found


def speed(results: Sequence[Result], tokens_per_s: float | None) -> list[Finding]:
    """Replies far faster than the server's own prefill of their prompt."""
    if not tokens_per_s:
        return []
    found = []
    for r in results:
        if not r.ok or r.job.kind in (Kind.CALIBRATION, Kind.PREFIX):
            continue
        n = max(r.prompt_tokens or 0, r.job.tokens.lo)
        expected = n / tokens_per_s
        if expected >= MIN_EXPECTED_PREFILL_S and r.first_byte_s < FAST_FRACTION * expected:
            found.append(
                Finding(
                    FindingKind.TOO_FAST,
                    r.job.id,
                    f"{r.job.id} ({r.job.kind.value}): first token after {r.first_byte_s * 1000:.0f} ms for a "
                    f"{n}-token prompt; the server's own prefill needs ~{expected * 1000:.0f} ms for that",
                    {"first_byte_s": r.first_byte_s, "expected_prefill_s": expected, "prompt_tokens": n},
                )
            )
    return found


def timing_test(results: Sequence[Result], tokens_per_s: float | None) -> TimingTest:
    """Prefix probes vs fresh controls. Not tested when either side has too few replies, or when the shared
    prefix prefills so fast (by the server's own rate) that a cache could not save a measurable time."""
    prefix = [r for r in results if r.job.kind is Kind.PREFIX and r.ok and r.ttft_s is not None]
    fresh = [r.ttft_s for r in results if r.job.kind is Kind.FRESH and r.ok and r.ttft_s is not None]
    times = [r.ttft_s for r in prefix if r.ttft_s is not None]
    med_p = statistics.median(times) if times else None
    med_f = statistics.median(fresh) if fresh else None
    saving = (
        statistics.median(r.job.tokens.lo for r in prefix) / tokens_per_s if prefix and tokens_per_s else None
    )
    skipped = None
    if min(len(times), len(fresh)) < MIN_TIMING_SAMPLES:
        skipped = f"too few replies ({len(times)} prefix, {len(fresh)} fresh)"
    elif saving is not None and saving < MIN_EXPECTED_PREFILL_S:
        skipped = f"the shared prefixes prefill in ~{saving * 1000:.0f} ms, too fast for a cache to show"
    p = None if skipped else mann_whitney_less(times, fresh)
    return TimingTest(len(times), len(fresh), med_p, med_f, p, skipped)


def prefix_timing(test: TimingTest) -> list[Finding]:
    if not test.significant:
        return []
    assert test.median_prefix_s is not None and test.median_fresh_s is not None
    return [
        Finding(
            FindingKind.PREFIX_TIMING,
            None,
            f"B's probes sharing A's prefixes got their first token in {test.median_prefix_s * 1000:.0f} ms "
            f"(median) against {test.median_fresh_s * 1000:.0f} ms for fresh prompts of the same length "
            f"(Mann-Whitney U, one-sided p = {test.p_value:.2g}): a prefix cache shared across tenants",
            {
                "p_value": test.p_value,
                "median_prefix_s": test.median_prefix_s,
                "median_fresh_s": test.median_fresh_s,
            },
        )
    ]


@dataclass(frozen=True, slots=True)
class LoadTest:
    in_flight: int  # A's heavy level; 0: the check did not run
    light_in_flight: int
    median_quiet_s: float | None  # B's median time to first token with A idle (shown, not tested)
    median_light_s: float | None
    median_busy_s: float | None
    num_light: int
    num_busy: int
    p_value: float | None  # None: not tested (see `skipped`)
    skipped: str | None = None

    @property
    def ratio(self) -> float | None:
        """B's median time to first token under A's heavy load over the same under its light load."""
        if self.median_light_s is None or self.median_busy_s is None or self.median_light_s <= 0:
            return None
        return self.median_busy_s / self.median_light_s

    @property
    def significant(self) -> bool:
        if self.p_value is None or self.ratio is None:
            return False
        assert self.median_busy_s is not None and self.median_light_s is not None
        return (
            self.p_value < ALPHA
            and self.ratio > LOAD_RATIO_LIMIT
            and self.median_busy_s - self.median_light_s >= MIN_TIMING_DIFF_S
        )


def load_test(results: Sequence[Result], in_flight: int, light_in_flight: int) -> LoadTest:
    """B's probes under A's light load against B's probes under its heavy load (with A idle: shown). Not tested
    without the flood (`in_flight` 0) or with too few replies on either side."""

    def ttfts(kind: Kind) -> list[float]:
        return [r.ttft_s for r in results if r.job.kind is kind and r.ok and r.ttft_s is not None]

    quiet, light, busy = ttfts(Kind.LOAD_QUIET), ttfts(Kind.LOAD_LIGHT), ttfts(Kind.LOAD_BUSY)
    skipped = None
    if in_flight < 1:
        skipped = "no flood (--flood below 2, or a budget of requests too small for it)"
    elif min(len(light), len(busy)) < MIN_TIMING_SAMPLES:
        skipped = f"too few replies ({len(light)} under A's light load, {len(busy)} under its heavy load)"
    p = None if skipped else mann_whitney_less(light, busy)
    return LoadTest(
        in_flight,
        light_in_flight,
        _median(quiet),
        _median(light),
        _median(busy),
        len(light),
        len(busy),
        p,
        skipped,
    )


def load_timing(test: LoadTest) -> list[Finding]:
    if not test.significant:
        return []
    assert test.median_light_s is not None and test.median_busy_s is not None and test.ratio is not None
    return [
        Finding(
            FindingKind.LOAD_TIMING,
            None,
            f"B's first token took {test.median_busy_s * 1000:.0f} ms (median) while A kept {test.in_flight} "
            f"requests in flight, against {test.median_light_s * 1000:.0f} ms while A kept "
            f"{test.light_in_flight} ({test.ratio:.1f}x, Mann-Whitney U, one-sided p = {test.p_value:.2g}): B's "
            "latency grows with A's load, which crowds B out and is readable through its latency",
            {
                "p_value": test.p_value,
                "median_quiet_s": test.median_quiet_s,
                "median_light_s": test.median_light_s,
                "median_busy_s": test.median_busy_s,
                "ratio": test.ratio,
                "in_flight": test.in_flight,
                "light_in_flight": test.light_in_flight,
            },
        )
    ]


def failures(results: Sequence[Result]) -> list[str]:
    """Notes: failed requests by code (not findings), and served-length prompts the server refused."""
    codes = Counter(r.error_code or f"http_{r.status}" for r in results if not r.ok and not r.rejected)
    notes = []
    if codes:
        listed = ", ".join(f"{code} x{n}" for code, n in codes.most_common())
        notes.append(
            f"{sum(codes.values())} request(s) failed (a server failing closed is not a finding): {listed}"
        )
    refused = [
        r.job.id
        for r in results
        if r.rejected and r.job.expect is Expect.SERVE and r.job.kind is not Kind.CALIBRATION
    ]
    if refused:
        notes.append(
            f"{len(refused)} prompt(s) within the advertised context were refused: {', '.join(refused[:8])}"
        )
    return notes


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
