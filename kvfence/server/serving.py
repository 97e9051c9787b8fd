"""Serving one completions or chat request: prompt -> tokens -> admission -> engine -> JSON or SSE.

Boundary: between the validated request (protocol.py) and the response bytes (responses.py). Everything that
can refuse a request happens before `AsyncEngine.submit` returns, so a refused request never holds a page (I5).
After that, the request either finishes, fails loudly (I8: HTTP 500 `kv_integrity_error`, or in a stream an
error event and no `[DONE]`) or is aborted because its client went away.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvfence.engine.errors import AdmissionError, EngineUnavailable
from kvfence.engine.grammar import Grammars
from kvfence.engine.output import RequestOutput
from kvfence.engine.preflight import PreflightReport
from kvfence.model.tokenizer import ChatTemplateError, Tokenizer
from kvfence.server import responses as R
from kvfence.server.async_engine import AsyncEngine, QueueFull, Submission
from kvfence.server.errors import (
    OpenAIError,
    engine_failed,
    from_admission,
    invalid,
    overloaded,
    unavailable,
)
from kvfence.server.metrics import ServerMetrics
from kvfence.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    capacity,
    check_chat_options,
    sampling_params,
)
from kvfence.server.tenants import TenantGate, TenantLimits
from kvfence.server.tools import Function, ToolFormat, ToolStream, render_messages

Body = CompletionRequest | ChatCompletionRequest
log = logging.getLogger("kvfence.server")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    served_model_name: str
    api_keys: dict[str, str] | None = None  # key -> tenant; None: one anonymous tenant
    tenant_limits: Mapping[str, TenantLimits] | None = None  # the keys file's limits (server/tenants.py)
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 1
    admin_key: str | None = None  # opens GET /debug/kv (the KV page map); None: nobody may read it
    metrics_key: str | None = None  # opens GET /metrics only (a scrape credential), as the admin key does
    preflight: PreflightReport | None = None  # this node's I6 verdict, shown on the page map
    # what GET /debug/config returns (admin key): the effective configuration tree, and (PD) each worker's
    config_view: Callable[[], dict[str, Any]] | None = None
    cluster: ClusterControl | None = None  # PD: GET /cluster/status, POST /cluster/scale


@dataclass(frozen=True, slots=True)
class ClusterControl:
    """A PD deployment seen from its router's HTTP front (kvfence/runtime/pd.py): its workers and, where this
    process launched them, scaling (None: workers started by hand join and leave on their own)."""

    status: Callable[[], dict[str, Any]]
    scale: Callable[[int, int], dict[str, Any]] | None = None


class EngineStream(StreamingResponse):
    """A streaming response that aborts its engine requests however the stream ends (client gone included)."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass(slots=True)
class _Job:
    body: Body
    rid: str
    created: int
    num_choices: int
    submission: Submission
    echoes: list[R.Echo] | None = None  # completions with echo: each choice's prompt
    headers: dict[str, str] | None = None  # a limited tenant's x-ratelimit-* headers


def render_chat(
    tokenizer: Tokenizer,
    fmt: ToolFormat,
    messages: list[dict[str, Any]],
    functions: list[Function],
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of a chat request. A message's `name` is passed to the template; if the template does not
    render it (the same text without the names: SmolLM2's, for one), it is refused rather than ignored."""
    rendered, extra = render_messages(messages, functions, fmt)
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **extra)
        named = [i for i, m in enumerate(messages) if m.get("name") is not None]  # the client's indices
        if named:
            plain = [{k: v for k, v in m.items() if k != "name"} for m in rendered]
            if (
                tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra)
                == text
            ):
                raise invalid(
                    "messages",
                    f"messages[{named[0]}].name: this model's chat template does not render participant names, "
                    "so the name would be ignored; leave it out or write it into the content",
                )
    except ChatTemplateError as e:
        raise invalid("messages", str(e)) from e
    return text


class Serving:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.tokenizer = engine.engine.tokenizer
        self.vocab_size = engine.engine.vocab_size
        self.grammars = Grammars(self.tokenizer, self.vocab_size)  # checks grammars before admission
        self.tool_format = ToolFormat.for_template(self.tokenizer.chat_template)
        self.gate = TenantGate(settings.tenant_limits or {}, engine.in_flight)  # 429s before anything queues

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # ---- endpoints ----------------------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, http: HTTPRequest, tenant: str) -> Response:
        rid = f"cmpl-{uuid.uuid4().hex}"
        with self._rejections(rid, tenant, body.user):
            self.check_model(body.model)
            given = body.prompts()
            prompts = await asyncio.to_thread(self._tokenize, given)
            job = self._submit(body, prompts, rid, tenant)
        if body.echo:
            texts = await asyncio.to_thread(self._echo_texts, given)
            job.echoes = [
                R.Echo(t, ids) for t, ids in zip(texts, prompts, strict=True) for _ in range(body.n)
            ]
        if body.stream:
            return EngineStream(
                error_terminated(self._stream_completion(job)), job.submission.abort, job.headers
            )
        choices = await self._collect(job, http)
        if body.prompt_only:
            for c in choices:
                _nothing_generated(c)
        return JSONResponse(
            R.completion_body(
                rid, job.created, body.model, choices, body.n, self.token_text, body.logprobs is not None,
                job.echoes,
            ),
            headers=job.headers,
        )  # fmt: skip

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest, tenant: str) -> Response:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        with self._rejections(rid, tenant, body.user):
            self.check_model(body.model)
            check_chat_options(body)
            prompt = await asyncio.to_thread(self._render_chat, body.chat_messages(), body.functions())
            job = self._submit(body, [prompt], rid, tenant)
        if body.stream:
            return EngineStream(error_terminated(self._stream_chat(job)), job.submission.abort, job.headers)
        choices = await self._collect(job, http)
        fmt = self.tool_format if body.calls_tools else None
        return JSONResponse(
            R.chat_body(rid, job.created, body.model, choices, body.n, self.token_text, body.logprobs, fmt),
            headers=job.headers,
        )

    async def tokenize(self, body: TokenizeRequest, http: HTTPRequest, tenant: str) -> Response:
        """POST /tokenize: the token ids the engine would see (chat: after the template), their count, and the
        longest sequence one request may span. Nothing is queued or allocated."""
        self.check_model(body.model)
        if body.messages is not None:
            messages = [m.as_dict() for m in body.messages]
            ids = await asyncio.to_thread(self._render_chat, messages, [], body.add_generation_prompt)
        else:
            assert body.prompt is not None
            ids = await asyncio.to_thread(
                self.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        limit = capacity(self.engine.engine.limits)
        return JSONResponse({"tokens": list(ids), "count": len(ids), "max_model_len": limit})

    async def detokenize(self, body: DetokenizeRequest, http: HTTPRequest, tenant: str) -> Response:
        """POST /detokenize: the text of token ids (special tokens kept, as the engine's output shows them)."""
        self.check_model(body.model)
        if any(t >= self.vocab_size for t in body.tokens):
            raise invalid("tokens", f"tokens contains ids outside the vocabulary (size {self.vocab_size})")
        text = await asyncio.to_thread(self.tokenizer.decode, list(body.tokens), skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    def check_model(self, model: str) -> None:
        if model != self.settings.served_model_name:
            raise OpenAIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )

    # ---- before the engine ----------------------------------------------------------------------------

    def _rejections(self, rid: str, tenant: str, user: str | None) -> _RecordRejections:
        return _RecordRejections(self.metrics, rid, tenant, user)

    def _tokenize(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Runs in a worker thread: a 4 MiB prompt must not stall the event loop."""
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else p
            if any(t >= self.vocab_size for t in ids):
                raise invalid(
                    "prompt", f"prompt contains token ids outside the vocabulary (size {self.vocab_size})"
                )
            out.append(ids)
        return out

    def _echo_texts(self, prompts: list[str | list[int]]) -> list[str]:
        """What echo sends back: a text prompt as given, a token prompt as its text."""
        return [
            p if isinstance(p, str) else self.tokenizer.decode(p, skip_special_tokens=False) for p in prompts
        ]

    def _render_chat(
        self, messages: list[dict[str, Any]], functions: list[Function], add_generation_prompt: bool = True
    ) -> list[int]:
        """Length is measured after the chat template: the engine sees exactly these tokens (tools included)."""
        text = render_chat(self.tokenizer, self.tool_format, messages, functions, add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _submit(self, body: Body, prompts: list[list[int]], rid: str, tenant: str) -> _Job:
        limits = self.engine.engine.limits
        if param := body.token_ids_outside(self.vocab_size):
            raise invalid(param, f"{param} names token ids outside the vocabulary (size {self.vocab_size})")
        grammar_param, grammar = body.grammar()
        if isinstance(body, ChatCompletionRequest) and body.calls_tools:
            grammar_param, grammar = "tools", body.tool_grammar(self.tool_format)
        if grammar and (error := self.grammars.check(grammar)) is not None:
            raise invalid(grammar_param, f"the structured output cannot be built for this model: {error}")
        expanded = [ids for ids in prompts for _ in range(body.n)]
        params = [
            sampling_params(body, len(ids), limits, j, grammar) for ids in prompts for j in range(body.n)
        ]
        input_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        num_tokens = sum(len(ids) + p.max_tokens for ids, p in zip(expanded, params, strict=True))
        headers = self.gate.admit(tenant, len(expanded), num_tokens)
        try:
            submission = self.engine.submit(expanded, params, rid, tenant, user=body.user)
        except AdmissionError as e:
            self.gate.refund(tenant, num_tokens)
            raise from_admission(e, input_param, limits) from e
        except QueueFull as e:
            self.gate.refund(tenant, num_tokens)
            raise overloaded(self.settings.retry_after_s, str(e)) from e
        except EngineUnavailable as e:
            self.gate.refund(tenant, num_tokens)
            raise unavailable(str(e)) from e
        return _Job(body, rid, int(time.time()), len(expanded), submission, headers=headers)

    # ---- non-streaming --------------------------------------------------------------------------------

    async def _collect(self, job: _Job, http: HTTPRequest) -> list[R.Choice]:
        choices = [R.Choice() for _ in range(job.num_choices)]
        watcher = asyncio.create_task(_abort_on_disconnect(http, job.submission))
        try:
            async for index, out in job.submission.stream():
                choices[index].update(out)
                if out.error_code is not None:
                    break  # fail fast: the other choices are aborted below
        except EngineUnavailable as e:
            raise unavailable(str(e)) from e
        finally:
            watcher.cancel()
            if not job.submission.finished:
                job.submission.abort()
        failed = [c.error_code for c in choices if c.error_code]
        if failed:  # I8: one failed choice fails the whole response, and no text is returned
            raise engine_failed(failed[0])
        if any(c.finish_reason == "abort" for c in choices):
            raise OpenAIError(503, "the request was aborted", type="server_error", code="aborted")
        return choices

    # ---- streaming ------------------------------------------------------------------------------------

    async def _stream_completion(self, job: _Job) -> AsyncIterator[str]:
        body = job.body
        assert isinstance(body, CompletionRequest)
        choices = [R.Choice() for _ in range(job.num_choices)]
        offsets = [0] * job.num_choices
        async for index, out in self._checked(job, choices):
            if job.echoes is not None and out.num_output_tokens == len(out.new_token_ids):  # its first output
                echo, head = job.echoes[index], None
                if body.logprobs is not None:
                    head = R.echo_logprobs(echo, out.prompt_logprobs, self.token_text)
                    offsets[index] = sum(len(t) for t in head["tokens"])
                finish = None
                if body.prompt_only:
                    _nothing_generated(choices[index])
                    finish = "length"
                chunk = R.completion_chunk(
                    job.rid, job.created, body.model, index, echo.text, finish, head, body.include_usage
                )
                yield R.sse(chunk)
                if body.prompt_only:
                    continue
            lp = None
            if body.logprobs is not None and out.logprobs:
                lp = R.completion_logprobs(
                    list(out.new_token_ids), list(out.logprobs), self.token_text, offsets[index]
                )
                offsets[index] += sum(len(t) for t in lp["tokens"])
            if out.new_text or lp or out.finished:
                finish = out.finish_reason if out.finished else None
                chunk = R.completion_chunk(
                    job.rid, job.created, body.model, index, out.new_text, finish, lp, body.include_usage
                )
                yield R.sse(chunk)
        async for tail in self._stream_end(job, choices, "text_completion"):
            yield tail

    async def _stream_chat(self, job: _Job) -> AsyncIterator[str]:
        body = job.body
        assert isinstance(body, ChatCompletionRequest)
        choices = [R.Choice() for _ in range(job.num_choices)]

        def chunk(index: int, delta: dict[str, Any], finish: str | None, lp: Any = None) -> str:
            return R.sse(
                R.chat_chunk(job.rid, job.created, body.model, index, delta, finish, lp, body.include_usage)
            )

        # with tools, each choice's text goes through a parser that sends content and calls as deltas
        parsers = [ToolStream(self.tool_format) for _ in choices] if body.calls_tools else None
        for index in range(job.num_choices):
            yield chunk(index, {"role": "assistant", "content": ""}, None)
        async for index, out in self._checked(job, choices):
            lp = None
            if body.logprobs and out.logprobs:
                lp = R.chat_logprobs(list(out.new_token_ids), list(out.logprobs), self.token_text)
            if parsers is None:
                if out.new_text or lp:
                    yield chunk(index, {"content": out.new_text}, None, lp)
            else:
                deltas = (
                    parsers[index].feed(choices[index].text, out.finished)
                    if out.new_text or out.finished
                    else []
                )
                for delta in deltas or ([{}] if lp else []):
                    yield chunk(index, delta, None, lp)
                    lp = None
            if out.finished:
                finish = out.finish_reason
                if parsers is not None and parsers[index].called and finish == "stop":
                    finish = "tool_calls"
                yield chunk(index, {}, finish)
        async for tail in self._stream_end(job, choices, "chat.completion.chunk"):
            yield tail

    async def _checked(self, job: _Job, choices: list[R.Choice]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of a streamed job; stops at the first failure after emitting its error event (I8)."""
        try:
            async for index, out in job.submission.stream():
                choices[index].update(out)
                if out.error_code is not None:
                    raise engine_failed(out.error_code)
                if out.finish_reason == "abort":
                    raise OpenAIError(503, "the request was aborted", type="server_error", code="aborted")
                yield index, out
        except EngineUnavailable as e:
            raise _StreamFailed(unavailable(str(e))) from e
        except OpenAIError as e:
            raise _StreamFailed(e) from e

    async def _stream_end(self, job: _Job, choices: list[R.Choice], obj: str) -> AsyncIterator[str]:
        if job.body.include_usage:
            yield R.sse(R.usage_chunk(job.rid, job.created, job.body.model, obj, choices, job.body.n))
        yield R.DONE


def _nothing_generated(c: R.Choice) -> None:
    """echo with max_tokens 0: the engine ran one token to score the prompt; the client asked for none."""
    c.text, c.token_ids, c.logprobs, c.num_output_tokens, c.finish_reason = "", [], [], 0, "length"


class _StreamFailed(Exception):
    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.message)
        self.error = error


async def error_terminated(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn a failure inside a stream into one error event, then end the stream (never `[DONE]`)."""
    try:
        async for piece in stream:
            yield piece
    except _StreamFailed as e:
        yield e.error.sse()
    except Exception:  # a bug: still end with an error event, never with a stream that looks complete
        log.exception("stream failed")
        yield OpenAIError(500, "internal server error", type="server_error", code="internal_error").sse()


class _RecordRejections:
    """Context manager: an `OpenAIError` raised before submission counts as a rejection (metrics + log)."""

    def __init__(self, metrics: ServerMetrics, rid: str, tenant: str, user: str | None) -> None:
        self.metrics, self.rid, self.tenant, self.user = metrics, rid, tenant, user

    def __enter__(self) -> None:
        return None

    def __exit__(self, _t: object, exc: BaseException | None, _tb: object) -> None:
        if isinstance(exc, OpenAIError):
            self.metrics.on_rejected(self.rid, self.tenant, exc.code or exc.type, exc.status, user=self.user)


async def _abort_on_disconnect(http: HTTPRequest, submission: Submission) -> None:
    """Wait for the client to go away (the body has been read, so the next ASGI message is the disconnect)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            submission.abort()
            return
