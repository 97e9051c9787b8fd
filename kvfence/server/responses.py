"""OpenAI response bodies and stream chunks, built from engine outputs. Plain dicts; no I/O.

Boundary: formatting only. The serving code decides *when* a chunk is sent; this module decides what it looks
like, so that the official `openai` client parses every byte of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfence.engine.output import LogprobEntry, RequestOutput
from kvfence.server import tools
from kvfence.server.tools import ToolFormat

TokenText = Callable[[int], str]  # token id -> its text, special tokens included


@dataclass(slots=True)
class Choice:
    """One choice's result, accumulated from its outputs."""

    text: str = ""
    finish_reason: str | None = None
    error_code: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: tuple[LogprobEntry | None, ...] = ()  # echo: from the output that brought them

    def update(self, out: RequestOutput) -> None:
        self.prompt_logprobs = self.prompt_logprobs or out.prompt_logprobs
        self.text = out.text
        self.num_prompt_tokens, self.num_output_tokens = out.num_prompt_tokens, out.num_output_tokens
        # PD: the prefill worker's first token carries the hits; the decode worker's outputs say 0
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason, self.error_code = out.finish_reason, out.error_code


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens count each prompt once (not once per choice), as OpenAI does; `cached_tokens`: those of
    them whose K/V came from the caller's own prefix cache (the cache is scoped by tenant, I7)."""
    prompt = sum(c.num_prompt_tokens for c in choices[::n])
    cached = sum(c.num_cached_tokens for c in choices[::n])
    completion = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


# ---- completions --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Echo:
    """A completions choice's prompt, sent back before its completion (`echo`)."""

    text: str
    token_ids: list[int]


def completion_body(
    rid: str,
    created: int,
    model: str,
    choices: list[Choice],
    n: int,
    token_text: TokenText,
    want_lp: bool,
    echoes: list[Echo] | None = None,
) -> dict[str, Any]:
    out = []
    for i, c in enumerate(choices):
        echo = echoes[i] if echoes else None
        lp = None
        if want_lp:
            head = echo_logprobs(echo, c.prompt_logprobs, token_text) if echo else None
            offset = sum(len(t) for t in head["tokens"]) if head else 0
            lp = join_logprobs(head, completion_logprobs(c.token_ids, c.logprobs, token_text, offset))
        text = (echo.text if echo else "") + c.text
        out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage(choices, n),
    }


def echo_logprobs(
    echo: Echo, entries: tuple[LogprobEntry | None, ...], token_text: TokenText
) -> dict[str, Any]:
    """The prompt's part of a completion's logprobs: the first token has none (null), as OpenAI's has."""
    tokens = [token_text(t) for t in echo.token_ids]
    padded = list(entries) + [None] * (len(tokens) - len(entries))
    return {
        "tokens": tokens,
        "token_logprobs": [e[0] if e else None for e in padded],
        "top_logprobs": [{token_text(t): v for t, v in e[1]} if e else None for e in padded],
        "text_offset": _offsets(tokens, 0),
    }


def _offsets(tokens: list[str], start: int) -> list[int]:
    """Where each token's text starts, counting from `start`."""
    out = []
    for tok in tokens:
        out.append(start)
        start += len(tok)
    return out


def join_logprobs(head: dict[str, Any] | None, tail: dict[str, Any]) -> dict[str, Any]:
    if head is None:
        return tail
    return {key: head[key] + tail[key] for key in head}


def completion_chunk(
    rid: str, created: int, model: str, index: int, text: str, finish: str | None, logprobs: Any, usage: bool
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = None
    return chunk


def completion_logprobs(
    token_ids: list[int], entries: list[LogprobEntry], token_text: TokenText, offset: int
) -> dict[str, Any]:
    """Legacy completions format: parallel lists, top alternatives as {token: logprob}."""
    tokens = [token_text(t) for t in token_ids[: len(entries)]]
    offsets = _offsets(tokens, offset)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": [{token_text(t): v for t, v in top} for _, top in entries],
        "text_offset": offsets,
    }


# ---- chat ---------------------------------------------------------------------------------------------


def chat_body(
    rid: str,
    created: int,
    model: str,
    choices: list[Choice],
    n: int,
    token_text: TokenText,
    want_lp: bool,
    tool_format: ToolFormat | None = None,
) -> dict[str, Any]:
    """`tool_format`: the request offered tools, so each choice's text is parsed into content and tool calls."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": i,
                **chat_message(c, tool_format),
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, token_text) if want_lp else None,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(choices, n),
    }


def chat_message(c: Choice, tool_format: ToolFormat | None) -> dict[str, Any]:
    """The message and finish reason of one choice: calls that parse become `tool_calls` (finish reason
    `tool_calls`); anything else, a call cut off by max_tokens included, stays text."""
    if tool_format is None:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    content, calls = tools.parse(c.text, tool_format)
    if not calls:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    message = {"role": "assistant", "content": content, "tool_calls": [call.as_openai() for call in calls]}
    return {
        "message": message,
        "finish_reason": "tool_calls" if c.finish_reason == "stop" else c.finish_reason,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish: str | None,
    logprobs: Any,
    usage: bool,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    }
    if usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(
    rid: str, created: int, model: str, obj: str, choices: list[Choice], n: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(choices, n),
    }


def chat_logprobs(token_ids: list[int], entries: list[LogprobEntry], token_text: TokenText) -> dict[str, Any]:
    def item(tid: int, lp: float) -> dict[str, Any]:
        text = token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(tid, lp), "top_logprobs": [item(t, v) for t, v in top]}
            for tid, (lp, top) in zip(token_ids, entries, strict=False)
        ]
    }
