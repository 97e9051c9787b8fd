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
    param = "messages"

    def __init__(self, num_prompt_tokens: int, max_tokens: int, context_length: int) -> None:
        self.num_prompt_tokens, self.max_tokens, self.context_length = (
            num_prompt_tokens,
            max_tokens,
            context_length,
        )
        super().__init__(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens."
        )


class PoolCapacityExceeded(AdmissionError):
    code = "context_length_exceeded"
    param = "messages"

    def __init__(self, num_tokens: int, num_pages: int, pool_pages: int, page_size: int) -> None:
        self.num_tokens, self.num_pages, self.pool_pages = num_tokens, num_pages, pool_pages
        super().__init__(
            f"This request needs {num_tokens} tokens of KV cache ({num_pages} pages of {page_size}), but the KV "
            f"pool holds only {pool_pages} pages ({pool_pages * page_size} tokens). Please reduce the prompt or "
            f"max_tokens."
        )


class InvalidSamplingParams(AdmissionError):
    code = "invalid_value"

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


class DuplicateRequestId(AdmissionError):
    code = "duplicate_request_id"
    param = "request_id"
