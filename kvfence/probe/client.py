"""One probe request over HTTP: send a job as tenant A or B, stream or not, abort when asked, time it.

Boundary: HTTP and the OpenAI wire format only (completions or chat); what a reply means is decided in
findings.py. Time to first token is the time to the first event that carries text or a finish reason (a chat
stream's opening role chunk does not count: some servers send it before the prefill). Everything a reply
delivered before an error event counts as delivered: the leak test reads it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvfence.probe.plan import Job


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str  # ends with /v1
    model: str
    key_a: str
    key_b: str
    chat: bool = False  # use /chat/completions (for chat-only servers)
    timeout_s: float = 120.0

    @property
    def root(self) -> str:
        return self.base_url.removesuffix("/v1")

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key_a if tenant == 'A' else self.key_b}"}


@dataclass(frozen=True, slots=True)
class Result:
    job: Job
    status: int | None  # HTTP status; None when no response came (connection error, timeout)
    text: str  # every piece of text the reply delivered
    prompt_tokens: int | None  # usage, as the server reports it
    completion_tokens: int | None
    ttft_s: float | None  # streamed replies only
    latency_s: float
    error_code: str | None = None  # the error object's code (or type), or "timeout" / "connection"
    aborted: bool = False  # we closed the stream on purpose

    @property
    def ok(self) -> bool:
        """A 2xx that delivered a complete reply (no error event)."""
        return self.status is not None and 200 <= self.status < 300 and self.error_code is None

    @property
    def rejected(self) -> bool:
        return self.status is not None and 400 <= self.status < 500

    @property
    def first_byte_s(self) -> float:
        """The best measure of the prefill this reply shows: TTFT when streamed, else the whole latency."""
        return self.ttft_s if self.ttft_s is not None else self.latency_s


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def request_body(target: Target, job: Job) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "max_tokens": job.max_tokens, "temperature": 0, "seed": 0}
    if target.chat:
        body["messages"] = [{"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = job.prompt
    if job.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def send(client: httpx.AsyncClient, target: Target, job: Job) -> Result:
    path = "/chat/completions" if target.chat else "/completions"
    url = f"{target.base_url}{path}"
    start = time.perf_counter()
    try:
        async with client.stream(
            "POST",
            url,
            json=request_body(target, job),
            headers=target.headers(job.tenant.value),
            timeout=target.timeout_s,
        ) as response:
            if job.stream and response.status_code == 200:
                return await _read_stream(response, job, start)
            raw = await response.aread()
            return _whole(job, response.status_code, raw, time.perf_counter() - start)
    except httpx.TimeoutException:
        return Result(job, None, "", None, None, None, time.perf_counter() - start, "timeout")
    except httpx.HTTPError:
        return Result(job, None, "", None, None, None, time.perf_counter() - start, "connection")


def _whole(job: Job, status: int, raw: bytes, latency: float) -> Result:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        code = None if 200 <= status < 300 else f"http_{status}"
        return Result(job, status, "", None, None, None, latency, code or "malformed")
    if status >= 300 or "error" in body:
        return Result(job, status, "", None, None, None, latency, _error_code(body))
    prompt, completion = _usage(body)
    return Result(job, status, _choice_text(body), prompt, completion, None, latency)


async def _read_stream(response: httpx.Response, job: Job, start: float) -> Result:
    pieces: list[str] = []
    ttft: float | None = None
    prompt = completion = None
    chunks, error = 0, None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            event = json.loads(data)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if "error" in event:
            error = _error_code(event)
            break
        if event.get("usage"):
            prompt, completion = _usage(event)
        text, finished = _chunk_text(event)
        if text or finished:
            ttft = ttft if ttft is not None else time.perf_counter() - start
        if text:
            pieces.append(text)
            chunks += 1
        if job.abort_after is not None and chunks >= job.abort_after:
            return Result(
                job,
                response.status_code,
                "".join(pieces),
                None,
                None,
                ttft,
                time.perf_counter() - start,
                aborted=True,
            )
    latency = time.perf_counter() - start
    return Result(job, response.status_code, "".join(pieces), prompt, completion, ttft, latency, error)


def _choice(body: dict[str, Any]) -> dict[str, Any]:
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return {}


def _choice_text(body: dict[str, Any]) -> str:
    choice = _choice(body)
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _chunk_text(event: dict[str, Any]) -> tuple[str, bool]:
    choice = _choice(event)
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return (text if isinstance(text, str) else ""), choice.get("finish_reason") is not None


def _usage(body: dict[str, Any]) -> tuple[int | None, int | None]:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None, None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) else None), (
        completion if isinstance(completion, int) else None
    )


def _error_code(body: dict[str, Any]) -> str:
    error = body.get("error")
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        return str(code) if code else "error"
    return str(error) if error else "error"
