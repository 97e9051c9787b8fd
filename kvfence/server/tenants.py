"""Tenants from the API keys file, and the limits each one is held to at the front door (docs/fairness.md).

Boundary: what the keys file says and the per-tenant rate limits, decided before anything is queued or allocated
(a 429 changes no engine state). The engine's part of a tenant (weight, page shares) is a `TenantShare` handed
to the scheduler (engine/fairness.py).

Keys file: TOML or JSON. Either the flat form, `"key" = "tenant"` (no limits, weight 1), or tables per tenant:

    [tenants.alice]
    keys = ["sk-alice-1", "sk-alice-2"]
    weight = 2.0                # its part of the service under contention (virtual token counters)
    min_pages = 64              # KV pages guaranteed while it has work
    max_pages = 512             # KV pages it may hold at most
    max_in_flight = 16          # requests (choices) queued or running at once
    requests_per_minute = 600
    tokens_per_minute = 200000  # prompt tokens + max_tokens of each request, as OpenAI counts them

Any other field is refused (exit 2 naming it). Over a limit: 429 `rate_limit_exceeded` with Retry-After and
OpenAI's `x-ratelimit-*` headers; a limited tenant's successful responses carry the headers too.
"""

from __future__ import annotations

import json
import math
import time
import tomllib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvfence.engine.fairness import TenantShare
from kvfence.options import unique_keys
from kvfence.server.errors import OpenAIError

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_in_flight: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def any(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


@dataclass(frozen=True, slots=True)
class KeysFile:
    keys: dict[str, str]  # API key -> tenant
    shares: dict[str, TenantShare] = field(default_factory=dict)
    limits: dict[str, TenantLimits] = field(default_factory=dict)


_SHARE_FIELDS = {"weight": float, "min_pages": int, "max_pages": int}
_LIMIT_FIELDS = {"max_in_flight": int, "requests_per_minute": int, "tokens_per_minute": int}


def load_keys_file(path: str | Path) -> KeysFile:
    """Read a keys file; raises ValueError naming the file and the problem."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text, object_pairs_hook=unique_keys) if p.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{p}: cannot parse API keys file: {e}") from e
    if not isinstance(data, dict) or not data:
        raise ValueError(
            f"{p}: expected a non-empty mapping of API key -> tenant name, or [tenants.NAME] tables"
        )
    if isinstance(data.get("tenants"), dict) and all(isinstance(v, dict) for v in data["tenants"].values()):
        if set(data) != {"tenants"}:
            raise ValueError(
                f"{p}: with [tenants.NAME] tables nothing else may be at the top, got {sorted(data)}"
            )
        return _tables(p, data["tenants"])
    for key, tenant in data.items():
        if not isinstance(tenant, str) or not tenant or not key:
            raise ValueError(f"{p}: every entry must map a non-empty key to a non-empty tenant name")
        _check_name(p, tenant)
    return KeysFile(dict(data))


def _tables(p: Path, tenants: Mapping[str, Any]) -> KeysFile:
    keys: dict[str, str] = {}
    shares, limits = {}, {}
    for name, table in tenants.items():
        _check_name(p, name)
        where = f"{p}: [tenants.{name}]"
        unknown = set(table) - {"keys", *_SHARE_FIELDS, *_LIMIT_FIELDS}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
        given = table.get("keys")
        if not isinstance(given, list) or not given or not all(isinstance(k, str) and k for k in given):
            raise ValueError(f"{where}: keys must be a non-empty list of non-empty strings")
        for key in given:
            if key in keys:
                raise ValueError(f"{where}: a key is listed twice (also for tenant {keys[key]!r})")
            keys[key] = name
        values = {k: _number(where, k, table[k], t) for k, t in {**_SHARE_FIELDS, **_LIMIT_FIELDS}.items()
                  if k in table}  # fmt: skip
        try:
            shares[name] = TenantShare(**{k: v for k, v in values.items() if k in _SHARE_FIELDS})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        limits[name] = TenantLimits(**{k: v for k, v in values.items() if k in _LIMIT_FIELDS})
    if not keys:  # an empty [tenants] would let everyone in as `anonymous`: authentication off, silently
        raise ValueError(
            f"{p}: [tenants] names no tenant; without --api-keys the server is open, say so that way"
        )
    return KeysFile(keys, shares, limits)


def _number(where: str, name: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, int | float) and not isinstance(value, bool) if kind is float else (
        isinstance(value, int) and not isinstance(value, bool))  # fmt: skip
    if not ok or not math.isfinite(value) or (kind is int and value < (0 if name == "min_pages" else 1)):
        raise ValueError(
            f"{where}: {name} must be a {'positive number' if kind is float else 'positive integer'}"
        )
    return kind(value)


def _check_name(p: Path, tenant: str) -> None:
    if not tenant or not tenant.isprintable():  # control characters (NUL separates a tenant from its salt)
        raise ValueError(f"{p}: tenant name {tenant!r} is empty or has control characters")


# ---- the gate --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Usage:
    requests: deque[float] = field(default_factory=deque)  # arrival times in the last minute
    tokens: float = 0.0  # the token bucket's content (refills at tokens_per_minute / 60 per second)
    refilled: float = 0.0


class TenantGate:
    """Per-tenant request and token rates and requests in flight, checked when a request arrives. Event loop
    only (one thread: check and charge happen together). `in_flight(tenant)` counts what the engine still holds
    for the tenant."""

    def __init__(
        self,
        limits: Mapping[str, TenantLimits],
        in_flight: Callable[[str], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = {t: lim for t, lim in limits.items() if lim.any}
        self._in_flight = in_flight
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def admit(self, tenant: str, num_choices: int, num_tokens: int) -> dict[str, str]:
        """Charge one request of `num_choices` engine requests and `num_tokens` tokens to `tenant`, and return
        the x-ratelimit headers to send; raises a 429 `OpenAIError` (nothing charged) if a limit says no."""
        lim = self.limits.get(tenant)
        if lim is None:
            return {}
        now = self._clock()
        u = self._usage.setdefault(tenant, _Usage(tokens=float(lim.tokens_per_minute or 0), refilled=now))
        while u.requests and u.requests[0] <= now - WINDOW_S:
            u.requests.popleft()
        if lim.tokens_per_minute is not None:
            rate = lim.tokens_per_minute / WINDOW_S
            u.tokens = min(float(lim.tokens_per_minute), u.tokens + (now - u.refilled) * rate)
            u.refilled = now
        if lim.max_in_flight is not None and self._in_flight(tenant) + num_choices > lim.max_in_flight:
            if num_choices > lim.max_in_flight:
                raise _too_large(f"n = {num_choices} is more than the {lim.max_in_flight} requests in flight "
                                 "your key allows", "n")  # fmt: skip
            raise self._limited(f"requests in flight: {lim.max_in_flight} allowed", 1.0, lim, u, now)
        if lim.requests_per_minute is not None and len(u.requests) >= lim.requests_per_minute:
            wait = u.requests[0] + WINDOW_S - now
            raise self._limited(f"requests per minute: {lim.requests_per_minute} allowed", wait, lim, u, now)
        if lim.tokens_per_minute is not None:
            if num_tokens > lim.tokens_per_minute:
                message = (f"this request counts {num_tokens} tokens (prompt + max_tokens), more than the "
                           f"{lim.tokens_per_minute} tokens per minute your key allows")  # fmt: skip
                raise _too_large(message, "max_tokens")
            if num_tokens > u.tokens:
                wait = (num_tokens - u.tokens) / (lim.tokens_per_minute / WINDOW_S)
                raise self._limited(f"tokens per minute: {lim.tokens_per_minute} allowed", wait, lim, u, now)
            u.tokens -= num_tokens
        u.requests.append(now)
        return _headers(lim, u, now)

    def refund(self, tenant: str, num_tokens: int) -> None:
        """Undo the last `admit` of `tenant` (the engine refused the request after all)."""
        u = self._usage.get(tenant)
        lim = self.limits.get(tenant)
        if u is None or lim is None:
            return
        if u.requests:
            u.requests.pop()
        if lim.tokens_per_minute is not None:
            u.tokens = min(float(lim.tokens_per_minute), u.tokens + num_tokens)

    def _limited(self, what: str, wait: float, lim: TenantLimits, u: _Usage, now: float) -> OpenAIError:
        retry = max(1, math.ceil(wait))
        headers = {**_headers(lim, u, now), "Retry-After": str(retry)}
        message = f"Rate limit reached for your API key ({what}); try again in {retry} s."
        return OpenAIError(429, message, type="requests", code="rate_limit_exceeded", headers=headers)


def _too_large(message: str, param: str) -> OpenAIError:
    """A request no wait would let through: 429 as OpenAI answers it, without Retry-After."""
    return OpenAIError(429, f"Request too large: {message}.", type="tokens", param=param,
                       code="rate_limit_exceeded")  # fmt: skip


def _headers(lim: TenantLimits, u: _Usage, now: float) -> dict[str, str]:
    out = {}
    if lim.requests_per_minute is not None:
        out["x-ratelimit-limit-requests"] = str(lim.requests_per_minute)
        out["x-ratelimit-remaining-requests"] = str(max(0, lim.requests_per_minute - len(u.requests)))
        reset = (u.requests[0] + WINDOW_S - now) if u.requests else 0.0
        out["x-ratelimit-reset-requests"] = _duration(reset)
    if lim.tokens_per_minute is not None:
        out["x-ratelimit-limit-tokens"] = str(lim.tokens_per_minute)
        out["x-ratelimit-remaining-tokens"] = str(int(u.tokens))
        full = (lim.tokens_per_minute - u.tokens) / (lim.tokens_per_minute / WINDOW_S)
        out["x-ratelimit-reset-tokens"] = _duration(full)
    return out


def _duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: "1s", "6m0s", "120ms"."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.0f}s"
