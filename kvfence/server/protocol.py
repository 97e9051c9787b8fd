"""OpenAI request bodies as pydantic v2 models, and their translation to engine `SamplingParams`.

Boundary: validation only. Anything malformed becomes a 400 `OpenAIError` naming the offending parameter; no
field here can name a tenant (I7: `user` is logged, never trusted). An optional parameter sent as JSON `null`
means "not given" and takes its default, as OpenAI's API allows (its client sends `temperature=None` as null).
Limits that protect the server (number of stop strings, n, prompts per request) are enforced here, before
tokenization.

Default `max_tokens` when the client sends none (documented in docs/server.md):
  - chat: everything left, `capacity - prompt tokens`, as vLLM does;
  - completions: 16, as OpenAI's legacy endpoint does, lowered if less room is left;
where capacity is the smaller of the context length and the KV pool's tokens.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvfence.engine.admission import Limits
from kvfence.engine.errors import InvalidSamplingParams
from kvfence.engine.grammar import grammar_text
from kvfence.engine.request import SamplingParams
from kvfence.server.errors import OpenAIError, invalid
from kvfence.server.tools import EMPTY_PARAMETERS, Function, ToolFormat
from kvfence.server.tools import grammar as tools_grammar

MAX_N = 16
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 128  # prompts x n: engine requests one HTTP request may create
MAX_STOP = 16  # OpenAI allows 4; more makes every decode step scan more text
MAX_STOP_LEN = 256
MAX_LOGPROBS = 20
DEFAULT_COMPLETION_TOKENS = 16
_INT64 = 1 << 63

_FRIENDLY = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": f"stop must be a string or a list of at most {MAX_STOP} non-empty strings",
    "messages": "messages must be a non-empty list of {role, content} objects",
}

M = TypeVar("M", bound=BaseModel)


# Fields of OpenAI's API that change nothing kvfence computes, accepted and ignored (docs/server.md, "Request
# fields"); every other field a model does not declare is refused with 400 `unsupported_parameter`.
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
MAX_TOOLS = 128  # OpenAI's limit on tools per request


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`null` for an optional field means the default (fields keep their plain types: no None reaches
        the engine). A required field sent as null stays an error."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, f in cls.model_fields.items() if not f.is_required()}
        return {k: v for k, v in data.items() if v is not None or k not in optional}


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=1 << 20)  # a JSON object, as text (OpenAI's shape)


class ToolCall(_Strict):
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    """One message. `developer` reads as `system`; an assistant turn may carry `tool_calls` (then its content
    may be empty); a `tool` message answers one of them by `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs a tool_call_id, and only a tool message has one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        for call in self.tool_calls or ():
            try:
                args = json.loads(call.function.arguments)
            except ValueError as exc:
                raise ValueError(f"tool_calls arguments must be a JSON object: {exc}") from exc
            if not isinstance(args, dict):
                raise ValueError("tool_calls arguments must be a JSON object")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def as_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it, before tools.render_messages."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema or grammar spec (json.dumps recurses: ~1,000 levels raise)


def nested_too_deep(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> bool:
    """Whether `value` (JSON: dicts, lists, scalars) nests more than `limit` levels; without recursion."""
    level: list[Any] = [value]
    for _ in range(limit + 1):
        level = [
            c
            for v in level
            for c in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())
        ]
        if not level:
            return False
    return True


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=1 << 16)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow `parameters` (the grammar enforces them)

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(
                "parameters must be the JSON schema of an object (the arguments are a JSON object)"
            )
        if nested_too_deep(v):
            raise ValueError(f"parameters nest more than {MAX_SCHEMA_DEPTH} levels")
        return v


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


TokenIds = list[Annotated[int, Field(ge=0, lt=_INT64)]]


class _Common(_Strict):
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, lt=_INT64)  # -1 / 0: off (vLLM's spelling)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    ignore_eos: bool = False  # vLLM extension, handy for benchmarks
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0, lt=_INT64)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    cache_salt: str = Field("", max_length=256)  # a sub-scope of the caller's prefix cache (never wider)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs (json, regex, choice, grammar)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def grammar(self) -> tuple[str | None, str]:
        """(the parameter that asked for it, the llguidance grammar) of a structured output, (None, "") for
        free text. Raises a 400 naming the parameter for a malformed request or a grammar that cannot be built;
        whether it compiles against the tokenizer is checked next (`Grammars.check`), still before any page."""
        rf, so = self.response_format, self.structured_outputs
        for param, value in (("response_format", rf), ("structured_outputs", so)):
            if nested_too_deep(value):
                raise invalid(param, f"{param} nests more than {MAX_SCHEMA_DEPTH} levels")
        if rf is not None and rf.get("type") != "text" and so is not None:
            raise invalid("structured_outputs", "give response_format or structured_outputs, not both")
        try:
            if rf is not None:
                return "response_format", _response_format_grammar(rf)
            if so is not None:
                extra = set(so) - {"json", "regex", "choice", "grammar"}
                given = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
                if extra or len(given) != 1:
                    raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar")
                kind = {"json": "json_schema", "grammar": "lark"}.get(given[0], given[0])
                spec = so[given[0]]
                if kind == "json_schema" and isinstance(spec, str):
                    try:
                        spec = json.loads(spec)
                    except RecursionError as exc:
                        raise ValueError("structured_outputs.json nests too deeply") from exc
                    if nested_too_deep(spec):
                        raise ValueError(f"structured_outputs.json nests more than {MAX_SCHEMA_DEPTH} levels")
                if kind == "choice" and (not isinstance(spec, list) or not spec or
                                         not all(isinstance(c, str) and c for c in spec)):  # fmt: skip
                    raise ValueError(
                        "structured_outputs.choice must be a non-empty list of non-empty strings"
                    )
                if kind in ("regex", "lark") and not isinstance(spec, str):
                    raise ValueError(f"structured_outputs.{given[0]} must be a string")
                return "structured_outputs", grammar_text(kind, spec)
        except ValueError as exc:  # json.JSONDecodeError is one
            raise invalid("response_format" if rf is not None else "structured_outputs", str(exc)) from exc
        return None, ""

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Common:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise invalid("stream_options", "stream_options is only allowed with stream: true")
        return self

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, v: str) -> str:
        if not v.isprintable():
            raise ValueError("cache_salt must be printable text (no control characters)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        """The harmless fields (IGNORED_FIELDS) go, and so does any field sent as null (it asks for nothing);
        `best_of` gets a message of its own."""
        if not isinstance(data, dict):
            return data
        if data.get("best_of") is not None:
            raise OpenAIError(400, "best_of is not supported: ask for n choices and pick among them",
                              param="best_of", code="unsupported_parameter")  # fmt: skip
        return {k: v for k, v in data.items() if k not in IGNORED_FIELDS and v is not None}

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float]) -> dict[str, float]:
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10) or not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias maps token ids (as strings) to biases in [-100, 100]")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be token ids (non-negative integers)")
        return v

    def token_ids_outside(self, vocab_size: int) -> str | None:
        """The parameter naming a token id beyond the vocabulary, if any (refused: it would do nothing)."""
        if any(int(k) >= vocab_size for k in self.logit_bias):
            return "logit_bias"
        if any(t >= vocab_size for t in self.stop_token_ids):
            return "stop_token_ids"
        return None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(
                f"at most {MAX_STOP} stop strings, each 1 to {MAX_STOP_LEN} characters, got {len(stops)}"
            )
        return v

    @property
    def stop_tuple(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(
        None, ge=0, lt=_INT64
    )  # 0 only with echo: score the prompt, generate nothing
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = (
        False  # the prompt comes back before the completion; with logprobs, the prompt's logprobs too
    )

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens", "max_tokens must be at least 1 (0 only with echo, to score a prompt)")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) and nothing generated."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings or token-id lists (at least one; each checked later for length)."""
        p = self.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items or len(items) > MAX_PROMPTS:
            raise invalid("prompt", f"prompt must hold 1 to {MAX_PROMPTS} prompts, got {len(items)}")
        if len(items) * self.n > MAX_CHOICES:
            raise invalid("n", f"prompts x n must be at most {MAX_CHOICES}, got {len(items) * self.n}")
        return items


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: int | None = Field(None, ge=1, lt=_INT64)
    max_completion_tokens: int | None = Field(None, ge=1, lt=_INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    tools: list[ToolDefinition] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _one_max_tokens(self) -> ChatCompletionRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise invalid("max_tokens", "max_tokens and max_completion_tokens differ: send one of them")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise OpenAIError(400, "tools: function names must be unique", param="tools")
        if "parallel_tool_calls" in self.model_fields_set and not self.tools:
            raise invalid("parallel_tool_calls", "parallel_tool_calls needs tools")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise invalid("tool_choice", "tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise invalid("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools")
        if self.calls_tools and (self.response_format or {}).get("type", "text") != "text":
            raise invalid("response_format", "response_format with tools needs tool_choice none")
        if self.calls_tools and self.structured_outputs is not None:
            raise invalid("structured_outputs", "structured_outputs with tools needs tool_choice none")
        answered = {c.id for m in self.messages for c in m.tool_calls or ()}
        for i, m in enumerate(self.messages):
            if m.tool_call_id is not None and m.tool_call_id not in answered:
                raise invalid(
                    f"messages[{i}].tool_call_id",
                    f"tool_call_id {m.tool_call_id!r} answers no tool call of an earlier assistant message",
                )
        return self

    @property
    def calls_tools(self) -> bool:
        """Tools are offered and the model may (auto) or must (required, named) call them."""
        return bool(self.tools) and self.tool_choice != "none"

    def functions(self) -> list[Function]:
        """The tools offered to the model (none for tool_choice none)."""
        if not self.calls_tools:
            return []
        return [
            Function(t.function.name, t.function.description, t.function.parameters or EMPTY_PARAMETERS)
            for t in self.tools or ()
        ]

    def tool_grammar(self, fmt: ToolFormat) -> str:
        """The grammar that makes the calls parse ("" when no tools are called)."""
        if not self.calls_tools:
            return ""
        functions, choice = self.functions(), self.tool_choice
        if isinstance(choice, NamedToolChoice):
            named = [f for f in functions if f.name == choice.function.name]
            return tools_grammar(fmt, named, only_calls=True, parallel=False)
        return tools_grammar(
            fmt, functions, only_calls=choice == "required", parallel=self.parallel_tool_calls
        )

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]


def _response_format_grammar(rf: dict[str, Any]) -> str:
    """OpenAI's response_format: text (no grammar), json_object (any JSON object), json_schema (its schema)."""
    kind = rf.get("type")
    if kind == "text" and set(rf) == {"type"}:
        return ""
    if kind == "json_object" and set(rf) == {"type"}:
        return grammar_text("json_schema", {"type": "object"})
    if kind == "json_schema" and set(rf) == {"type", "json_schema"} and isinstance(rf["json_schema"], dict):
        spec = rf["json_schema"]
        if "description" in spec:  # OpenAI shows it to the model; kvfence's grammar enforces the schema alone
            raise ValueError(
                "response_format.json_schema.description would not reach the model here: describe the output in "
                "the messages (the schema itself is enforced)"
            )
        if set(spec) - {"name", "schema", "strict"}:
            raise ValueError(f"response_format.json_schema takes name, schema and strict, got {sorted(spec)}")
        if not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema needs a name (string) and a schema (object)")
        return grammar_text("json_schema", spec["schema"])
    raise ValueError(
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
    )


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered with the model's template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=4096)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and "add_special_tokens" in self.model_fields_set:
            raise invalid("add_special_tokens", "add_special_tokens is for a prompt: with messages the chat "
                          "template places the special tokens, as for a chat completion")  # fmt: skip
        if self.prompt is not None and "add_generation_prompt" in self.model_fields_set:
            raise invalid("add_generation_prompt", "add_generation_prompt is for messages, not a prompt")
        return self


class DetokenizeRequest(_Strict):
    model: str
    tokens: TokenIds


# ---- parsing ------------------------------------------------------------------------------------------


def parse_body(raw: bytes, model: type[M]) -> M:
    """JSON bytes -> a validated request; any problem becomes a 400 naming the parameter."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        raise invalid(None, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise invalid(None, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from e
    except RecursionError as e:
        raise invalid(None, "the request body is nested too deeply", code="invalid_json") from e


def _validation_error(exc: ValidationError) -> OpenAIError:
    first = exc.errors(include_url=False)[0]
    loc = [p for p in first["loc"] if isinstance(p, int) or _is_field(p)]
    param = str(loc[0]) if loc else None
    for part in loc[1:]:
        param = f"{param}[{part}]" if isinstance(part, int) else f"{param}.{part}"
    if first["type"] == "missing":
        return invalid(param, f"missing required parameter: '{param}'", code="missing_required_parameter")
    if first["type"] == "extra_forbidden":
        unsupported = (
            f"unsupported parameter: '{param}': kvfence does not implement it, and ignoring it would change "
            'what you asked for (the supported fields: docs/server.md, "Request fields")'
        )
        if param and param.startswith("guided_"):
            unsupported = (
                f"unsupported parameter: '{param}': vLLM's older guided_* fields are not accepted; ask with "
                "structured_outputs (json, regex, choice, grammar) or response_format"
            )
        return invalid(param, unsupported, code="unsupported_parameter")
    top = str(loc[0]) if loc else ""
    message = _FRIENDLY.get(top) if top in _FRIENDLY and len(loc) <= 2 else None
    return invalid(param, message or f"invalid value for '{param}': {first['msg']}")


def _is_field(part: str | int) -> bool:
    # pydantic puts union members ("str", "list[int]", "function-after[...]") into error locations
    return isinstance(part, str) and part.isidentifier() and part not in {"str", "int", "float", "bool"}


# ---- sampling parameters ------------------------------------------------------------------------------


def capacity(limits: Limits) -> int:
    """Tokens one request may span: the context length, or less if the KV pool is smaller."""
    return min(limits.context_length, limits.pool_pages * limits.page_size)


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    limits: Limits,
    choice: int,
    grammar: str = "",
) -> SamplingParams:
    """Engine parameters for one choice. With a seed, choice i samples with seed + i so that n choices
    differ yet each is reproducible."""
    room = max(1, capacity(limits) - num_prompt_tokens)
    if isinstance(req, ChatCompletionRequest):
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = asked or room
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens = req.max_tokens or (1 if req.prompt_only else min(DEFAULT_COMPLETION_TOKENS, room))
        logprobs = req.logprobs
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k and req.top_k > 0 else None,
            seed=None if req.seed is None else req.seed + choice,
            stop=req.stop_tuple,
            stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.logprobs if isinstance(req, CompletionRequest) and req.echo else None,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            logit_bias=tuple(sorted((int(k), float(b)) for k, b in req.logit_bias.items())),
            min_p=req.min_p,
            min_tokens=req.min_tokens,
            cache_salt=req.cache_salt,
            grammar=grammar,
        )
    except InvalidSamplingParams as e:
        raise invalid(e.param, str(e)) from e


def check_chat_options(req: ChatCompletionRequest) -> None:
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
