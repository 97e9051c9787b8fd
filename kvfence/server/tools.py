"""Tool calling: how a model family writes tool calls, the prompt that offers tools, the grammar that makes the
calls parse, and the parser (whole or streamed) that turns the text back into OpenAI `tool_calls`.

Boundary: text in, text out. The engine sees a prompt and a grammar (SamplingParams.grammar), nothing about
tools; this module renders the tools into the prompt and reads the calls back from the generated text, so tool
calling works unchanged in PD mode (the grammar travels with the request, as structured outputs do).

Formats (chosen from the model's chat template, `ToolFormat.for_template`):
  - `hermes` (Qwen2 / Qwen2.5 and others whose template writes `<tool_call>`): one
    `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` block per call, tools rendered by the template;
  - `llama3_json` (Llama 3.x templates): `{"name": ..., "parameters": {...}}`, calls separated by `; `;
  - `smollm2` (templates that know no tools, as SmolLM2's): kvfence's system prompt in SmolLM2's tool-calling
    format, `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`.

`tool_choice` decides the grammar: `none` renders no tools and constrains nothing; `required` and a named
function allow only calls (one or more, one if `parallel_tool_calls` is false), so the calls always parse;
`auto` allows either text that never opens a call or calls only. Each call's arguments follow its function's
`parameters` schema (llguidance `%json`), with the name first so a stream can send it before the arguments.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfence.engine.grammar import JSON_LAYOUT

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

SMOLLM2_PROMPT = """You are an expert in composing functions. You are given a question and a set of possible \
functions. Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \
If none of the functions can be used, point it out and refuse to answer. If the given question lacks the \
parameters required by the function, also point it out.

You have access to the following tools:
<tools>{tools}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How calls are written: `begin` + `sep`.join(`open` + call object + `close`) + `end`."""

    name: str
    begin: str
    end: str
    open: str
    close: str
    sep: str
    args_key: str  # the call object's member that holds the arguments
    in_template: bool  # the chat template renders tools and tool calls itself

    @property
    def tag(self) -> str:
        """Text that starts the calls: free text (tool_choice auto) may not start with it or, if it is a tag,
        contain it."""
        return self.begin or self.open or "{"

    @staticmethod
    def for_template(template: str | None) -> ToolFormat:
        if template and "tools" in template and "<tool_call>" in template:
            return HERMES
        if template and "tools" in template and ("<|python_tag|>" in template or '"parameters"' in template):
            return LLAMA3_JSON
        return SMOLLM2

    def write(self, calls: Sequence[tuple[str, str]]) -> str:
        """The text of (name, arguments JSON) calls, as the model writes them (assistant turns in history)."""
        body = self.sep.join(
            f'{self.open}{{"name": {json.dumps(name)}, "{self.args_key}": {args}}}{self.close}'
            for name, args in calls
        )
        return f"{self.begin}{body}{self.end}"


HERMES = ToolFormat("hermes", "", "", "<tool_call>\n", "\n</tool_call>", "\n", "arguments", True)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "", "", "; ", "parameters", True)
SMOLLM2 = ToolFormat("smollm2", "<tool_call>[", "]</tool_call>", "", "", ", ", "arguments", False)


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


# ---- the prompt ---------------------------------------------------------------------------------------


def render_messages(
    messages: Sequence[dict[str, Any]], functions: Sequence[Function], fmt: ToolFormat
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages for the chat template, extra template variables). `messages` are OpenAI's, already validated:
    `developer` reads as `system`; an assistant turn's `tool_calls` and the `tool` results are rendered the way
    the format writes them; `functions` (empty: offer none) go to the template or into kvfence's system prompt."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": m["content"]}
        calls = m.get("tool_calls") or []
        if calls and fmt.in_template:
            msg["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": json.loads(c["arguments"])}}
                for c in calls
            ]  # fmt: skip
        elif calls:
            text = fmt.write([(c["name"], c["arguments"]) for c in calls])
            msg["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if role == "tool" and fmt.in_template:
            msg["tool_call_id"] = m["tool_call_id"]
        elif role == "tool":  # a template that knows no tools knows no tool role either: a user turn, tagged
            msg = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        if m.get("name") is not None:
            msg["name"] = m["name"]  # the participant's name, for templates that render it
        out.append(msg)
    if not functions:
        return out, {}
    if fmt.in_template:
        return out, {"tools": [f.as_tool() for f in functions]}
    listed = json.dumps([f.as_tool()["function"] for f in functions], ensure_ascii=False)
    prompt = SMOLLM2_PROMPT.format(tools=listed)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{prompt}\n\n{out[0]['content']}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


# ---- the grammar --------------------------------------------------------------------------------------


def grammar(fmt: ToolFormat, functions: Sequence[Function], only_calls: bool, parallel: bool) -> str:
    """The llguidance Lark grammar for a tools request: calls only (`required`, a named function: pass just that
    one), or (`auto`) either calls or text that does not open one."""
    options = []
    for i, f in enumerate(functions):
        call = {
            "type": "object",
            "properties": {"name": {"const": f.name}, fmt.args_key: f.parameters},
            "required": ["name", fmt.args_key],
            "additionalProperties": False,
            "x-guidance": JSON_LAYOUT,
        }
        options.append(f"f{i}: %json {json.dumps(call, ensure_ascii=False)}")
    more = f"({json.dumps(fmt.sep)} call)*" if parallel else ""
    lines = [
        "%llguidance {}",
        f"calls: {_lit(fmt.begin)} call {more} {_lit(fmt.end)}",
        f"call: {_lit(fmt.open)} ({' | '.join(f'f{i}' for i in range(len(functions)))}) {_lit(fmt.close)}",
        *options,
    ]
    if only_calls:
        lines.insert(1, "start: calls")
    else:
        tag = _regex_text(fmt.tag)
        banned = f"(?s:.*){tag}(?s:.*)" if fmt.tag.startswith("<") else f"[ \\t\\n]*{tag}(?s:.*)"
        lines.insert(1, "start: calls | TEXT")
        lines.append(f"TEXT: /(?s:.*)/ & ~/{banned}/")
    return "\n".join(lines) + "\n"


def _lit(text: str) -> str:
    return json.dumps(text) if text else ""


def _regex_text(text: str) -> str:
    out = "".join(f"\\{c}" if c in "\\.^$|?*+()[]{}/" else c for c in text)
    return out.replace("\n", "\\n")


# ---- parsing ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Call:
    id: str
    name: str | None = None
    arguments: str = ""  # raw JSON text as generated (complete once `done`)
    done: bool = False

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class _Scan:
    """What the text says so far: content before the calls, the calls (the last may be partial), and whether
    the calls region is complete and well formed."""

    content: str
    started: bool
    calls: list[tuple[str | None, str, bool]]  # (name, arguments so far, arguments complete)
    complete: bool = False


def _scan(text: str, fmt: ToolFormat) -> _Scan:
    start = _find_start(text, fmt)
    if start is None:
        return _Scan(text, False, [])
    scan = _Scan(text[:start], True, [])
    pos, ok = _expect(text, start, fmt.begin)
    while ok:
        pos, ok = _expect(text, pos, fmt.open)
        if not ok:
            break
        name, args, args_done, end = _call_object(text, pos, fmt.args_key)
        if args is None and name is None and end is None:
            break  # not a call object
        scan.calls.append((name, args or "", args_done))
        if end is None:
            break  # still being written
        pos, ok = _expect(text, end, fmt.close)
        if not ok:
            break
        after_sep, ok = _expect(text, pos, fmt.sep)
        if ok and fmt.sep:
            pos = after_sep
            continue
        after_end, ok = _expect(text, pos, fmt.end)
        scan.complete = bool(ok) and text[after_end:].strip() == ""
        break
    return scan


def _find_start(text: str, fmt: ToolFormat) -> int | None:
    if fmt.tag == "{":  # llama3_json: the whole output is the calls
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("{") else None
    i = text.find(fmt.tag)
    return None if i < 0 else i


def _expect(text: str, pos: int, lit: str) -> tuple[int, bool]:
    """(position after `lit`, True) if the text has it at `pos`, else (pos, False)."""
    if text.startswith(lit, pos):
        return pos + len(lit), True
    return pos, False


def _call_object(text: str, pos: int, args_key: str) -> tuple[str | None, str | None, bool, int | None]:
    """(name, arguments text so far, arguments complete, position after the object or None if unfinished).
    All None: not a call object."""
    if pos >= len(text):
        return None, "", False, None
    if text[pos] != "{":
        return None, None, False, None
    name: str | None = None
    args: str | None = None
    args_done = False
    i = pos + 1
    while True:
        i = _skip_ws(text, i)
        if i >= len(text):
            return name, args, args_done, None
        if text[i] == "}":
            return name, args, args_done, i + 1
        if text[i] == ",":
            i += 1
            continue
        key_end = _value_end(text, i)
        if key_end is None:
            return name, args, args_done, None
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return None, None, False, None
        i = _skip_ws(text, key_end)
        if i >= len(text):
            return name, args, args_done, None
        if text[i] != ":":
            return None, None, False, None
        i = _skip_ws(text, i + 1)
        if i >= len(text):
            return name, args, args_done, None
        end = _value_end(text, i)
        if key == args_key:
            args, args_done = text[i : end if end is not None else len(text)], end is not None
        elif key == "name" and end is not None:
            value = json.loads(text[i:end])
            name = value if isinstance(value, str) else None
        if end is None:
            return name, args, args_done, None
        i = end


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """The position after the JSON value starting at `i`, or None if the text ends first (not validated:
    json.loads does that on complete calls)."""
    if text[i] == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if text[i] in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            c = text[j]
            if in_str:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(text) else None


def parse(text: str, fmt: ToolFormat) -> tuple[str | None, list[Call]]:
    """The whole generated text -> (content, calls). Text that does not hold complete, well-formed calls is all
    content (a call cut off by max_tokens included), as vLLM returns it."""
    scan = _scan(text, fmt)
    if not scan.started or not scan.complete or not _all_valid(scan.calls):
        return text, []
    calls = [Call(new_call_id(), name, args, True) for name, args, _ in scan.calls]
    return (scan.content or None), calls


def _all_valid(calls: list[tuple[str | None, str, bool]]) -> bool:
    for name, args, done in calls:
        if name is None or not done:
            return False
        try:
            if not isinstance(json.loads(args), dict):
                return False
        except ValueError:
            return False
    return True


@dataclass(slots=True)
class ToolStream:
    """One streamed choice: `feed(text so far)` returns the new deltas in OpenAI's shape (content, then each
    call's id and name, then its arguments as they are written). A call's name is sent once it is complete; its
    arguments character by character after that (the grammar writes the name first)."""

    fmt: ToolFormat
    sent_content: int = 0
    calls: list[Call] = field(default_factory=list)

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        scan = _scan(text, self.fmt)
        deltas: list[dict[str, Any]] = []
        content = scan.content
        if not scan.started and not final:
            content = content[: len(content) - _held_back(content, self.fmt.tag)]
        if final and scan.started and not scan.complete and not self.calls:
            content = text  # never became calls: all of it is text
        if len(content) > self.sent_content:
            deltas.append({"content": content[self.sent_content :]})
            self.sent_content = len(content)
        if content is text:
            return deltas
        for index, (name, args, _) in enumerate(scan.calls):
            if name is None:
                break
            if index == len(self.calls):
                call = Call(new_call_id(), name)
                self.calls.append(call)
                head = {"index": index, "id": call.id, "type": "function",
                        "function": {"name": name, "arguments": ""}}  # fmt: skip
                deltas.append({"tool_calls": [head]})
            call = self.calls[index]
            if len(args) > len(call.arguments):
                more = args[len(call.arguments) :]
                call.arguments = args
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": more}}]})
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.calls)


def _held_back(content: str, tag: str) -> int:
    """How many trailing characters might be the start of `tag` (not sent until the next token decides)."""
    if tag == "{":
        return len(content) if content.strip() == "" else 0
    for k in range(min(len(tag) - 1, len(content)), 0, -1):
        if tag.startswith(content[-k:]):
            return k
    return 0
