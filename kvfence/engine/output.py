"""Turning sampled tokens into what callers see: text deltas, stop strings, final outputs.

Boundary: the only engine part that knows about text. The scheduler stops on token ids (EOS, stop ids,
max_tokens); this module stops on stop strings, which it can only see after detokenizing. Text that could be the
start of a stop string is held back until it is clear it is not one, so a stream never shows a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.engine.plan import StepResult
from kvfence.engine.request import Request, RequestState
from kvfence.engine.scheduler import Scheduled, Scheduler
from kvfence.ids import RequestId
from kvfence.model.tokenizer import IncrementalDetokenizer, Tokenizer

LogprobEntry = tuple[float, tuple[tuple[int, float], ...]]  # (chosen token's logprob, top-k (id, logprob))


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: RequestId
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    error_code: str | None  # e.g. "kv_integrity_error"
    num_prompt_tokens: int
    num_output_tokens: int
    text: str  # all text so far (final text when finished)
    token_ids: tuple[int, ...]  # all output token ids so far
    logprobs: tuple[LogprobEntry, ...] = ()  # one entry per new token when the request asked for logprobs
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (its own cache scope: I7)
    # with params.prompt_logprobs, on the first output only: one entry per prompt token, None for the first
    prompt_logprobs: tuple[LogprobEntry | None, ...] = ()


class _TextState:
    __slots__ = ("cut", "detok", "emitted", "sent_tokens")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.cut: int | None = None  # where a stop string starts; text beyond it is never shown
        self.emitted = 0  # characters of detok.text already handed out
        self.sent_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._state: dict[RequestId, _TextState] = {}

    def add(self, request: Request) -> None:
        self._state[request.request_id] = _TextState(self.tokenizer)

    def remove(self, request: Request) -> None:
        self._state.pop(request.request_id, None)

    def process(
        self, scheduled: list[Scheduled], result: StepResult, scheduler: Scheduler
    ) -> list[RequestOutput]:
        outputs = []
        for item in scheduled:
            request = item.request
            if request.request_id not in result.sampled or request.state is RequestState.FAILED:
                continue
            outputs.append(self._advance(request, result, scheduler))
        return outputs

    def _advance(self, request: Request, result: StepResult, scheduler: Scheduler) -> RequestOutput:
        st = self._state[request.request_id]
        new_ids = request.output_token_ids[st.sent_tokens :]
        st.detok.push(new_ids)
        if request.state.terminal:
            st.detok.flush()  # a stream that ends mid-character shows the replacement character, as HF does
        stops = request.params.stop
        if stops:
            # also after EOS/max_tokens ended the request: the last token may have completed a stop string
            st.cut = _find_stop(st.detok.text, stops, start=max(0, st.emitted - max(map(len, stops))))
            if st.cut is not None and request.state.terminal:
                request.finish_reason = "stop"
            elif st.cut is not None and not request.prefill_only:
                # a PD prefill has handed the request to its transfer: the decode side, which gets the same
                # first token, finds the same stop string and ends the request there
                scheduler.finish(request, RequestState.FINISHED, "stop")
        text = st.detok.text if st.cut is None else st.detok.text[: st.cut]
        visible = len(text) if request.state.terminal else len(text) - _held_back(text, stops)
        lp = result.logprobs.get(request.request_id) if result.logprobs else None
        logprobs, request.pending_logprobs = (*request.pending_logprobs, *((lp,) if lp else ())), ()
        return self._output(request, st, text, max(visible, st.emitted), new_ids, logprobs)

    def final(self, request: Request) -> RequestOutput:
        """The last output of a request that ended outside a normal step (abort, integrity failure)."""
        st = self._state.get(request.request_id) or _TextState(self.tokenizer)
        text = st.detok.text if st.cut is None else st.detok.text[: st.cut]
        return self._output(request, st, text, len(text), [], ())

    def _output(
        self,
        request: Request,
        st: _TextState,
        text: str,
        upto: int,
        new_ids: list[int],
        logprobs: tuple[LogprobEntry, ...],
    ) -> RequestOutput:
        delta = text[st.emitted : upto]
        st.emitted = upto
        prompt_lp: tuple[LogprobEntry | None, ...] = ()
        scored = (
            len(request.prompt_logprobs) == request.num_prompt_tokens - 1
        )  # here, not on a PD decode worker
        if st.sent_tokens == 0 and new_ids and request.params.prompt_logprobs is not None and scored:
            prompt_lp = (None, *request.prompt_logprobs)
        st.sent_tokens = request.num_output_tokens
        failed = request.state in (RequestState.FAILED, RequestState.ABORTED)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tuple(new_ids),
            new_text="" if request.state is RequestState.FAILED else delta,
            finished=request.state.terminal,
            finish_reason=request.finish_reason,
            error_code=request.error_code,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            text="" if failed and request.error_code else text[:upto],
            token_ids=tuple(request.output_token_ids),
            logprobs=logprobs,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=prompt_lp,
        )


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
