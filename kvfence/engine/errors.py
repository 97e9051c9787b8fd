"""Typed admission errors (I5). Each names both numbers so the client sees what limit it hit."""

from __future__ import annotations


class AdmissionError(ValueError):
    """A request that must be rejected before anything is allocated. `code` follows OpenAI's error codes."""

    code = "invalid_request_error"
    param: str | None = None


class EmptyPromptError(AdmissionError):
    code = "invalid_prompt"
    param = "prompt"

    def __init__(self) -> None:
        super().__init__("prompt must contain at least one token")


class ContextLengthExceeded(AdmissionError):
    code = "context_length_exceeded"
    param = "messages"  # the HTTP layer names its own input field (`prompt` for completions)

    def __init__(
        self, num_prompt_tokens: int, max_tokens: int, context_length: int, pool_tokens: int | None = None
    ) -> None:
        """`pool_tokens`: what the KV pool holds, named too when it is the smaller limit."""
        self.num_prompt_tokens, self.max_tokens, self.context_length = (
            num_prompt_tokens,
            max_tokens,
            context_length,
        )
        limit = f"This model's maximum context length is {context_length} tokens"
        if pool_tokens is not None and pool_tokens < context_length:
            limit += (
                f", and this server's KV pool holds only {pool_tokens} tokens, the most one request may use"
            )
        super().__init__(
            f"{limit}. However, you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
            f"the prompt, {max_tokens} for the completion). Please reduce the prompt or max_tokens."
        )


class PoolCapacityExceeded(AdmissionError):
    code = "context_length_exceeded"
    param = "messages"

    def __init__(
        self,
        num_tokens: int,
        num_pages: int,
        pool_pages: int,
        page_size: int,
        context_length: int | None = None,
    ) -> None:
        """`context_length`: the model's, named too (a pool smaller than it is the limit that was hit)."""
        self.num_tokens, self.num_pages, self.pool_pages = num_tokens, num_pages, pool_pages
        self.page_size = page_size
        context = (
            "" if context_length is None else f", less than the context length of {context_length} tokens"
        )
        super().__init__(
            f"This request needs {num_tokens} tokens of KV cache ({num_pages} pages of {page_size}), but the KV "
            f"pool holds only {pool_pages} pages ({pool_pages * page_size} tokens){context}. Please reduce the "
            f"prompt or max_tokens."
        )


class TenantCapExceeded(AdmissionError):
    """The request's whole sequence needs more pages than its tenant may hold (max_pages in the keys file)."""

    code = "context_length_exceeded"
    param = "messages"

    def __init__(self, num_tokens: int, num_pages: int, max_pages: int, page_size: int) -> None:
        self.num_tokens, self.num_pages, self.max_pages = num_tokens, num_pages, max_pages
        super().__init__(
            f"This request needs {num_tokens} tokens of KV cache ({num_pages} pages of {page_size}), but your "
            f"tenant may hold at most {max_pages} pages ({max_pages * page_size} tokens) at once. Please reduce "
            "the length of the messages or max_tokens."
        )


class InvalidSamplingParams(AdmissionError):
    code = "invalid_value"

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


class DuplicateRequestId(AdmissionError):
    code = "duplicate_request_id"
    param = "request_id"


class TooManyChoices(AdmissionError):
    """prompts x n engine requests can never all be queued: more than the server's queue holds."""

    code = "invalid_value"
    param = "n"

    def __init__(self, num_requests: int, max_queue: int) -> None:
        super().__init__(
            f"this request needs {num_requests} engine requests (prompts x n) but the server queues at most "
            f"{max_queue}; lower n or send fewer prompts per request"
        )


class EngineUnavailable(Exception):
    """The engine cannot take requests: its loop stopped (shutdown, or a crash in `step`), or (PD) no worker of a
    stage is registered. Nothing more can be served until that changes."""
