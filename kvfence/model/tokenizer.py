"""Text <-> token ids, chat templates, and streaming detokenization.

Boundary: strings and lists of ints only; no torch, no model weights. A `Tokenizer` is immutable after
construction and safe to share between requests; an `IncrementalDetokenizer` holds one request's decode state.

Two sources build the same object: the `tokenizer.ggml.*` metadata of a GGUF file (gpt2-style byte-level BPE,
rebuilt with the `tokenizers` library) and a Hugging Face directory (`tokenizer.json` plus its configs).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special (skipped on decode), USER_DEFINED tokens
# are added tokens that are matched whole in text but decode like ordinary text.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Regexes of the Hugging Face pre-tokenizers that llama.cpp names by `tokenizer.ggml.pre`.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ModelLoadError(Exception):
    """A model file or directory cannot be loaded; the message names the file and what is wrong.

    Defined here rather than in `loader.py` because the loader imports this module; `loader` re-exports it.
    """


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the messages (`raise_exception`)."""


class Tokenizer:
    """A byte-level BPE tokenizer plus the special-token facts a server needs (BOS, EOS, chat template)."""

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._hf = hf
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # dedupe, keep the primary first
        self._add_bos = add_bos
        self._chat_template = chat_template

    # -- facts -----------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The tokenizer in the tokenizers library's JSON (what llguidance builds its view from)."""
        return str(self._hf.to_str())

    @property
    def vocab_size(self) -> int:
        return int(self._hf.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS."""
        return self._add_bos and self._bos_token_id is not None

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(token_id)

    # -- encode / decode -------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) map to their single ids."""
        # The post-processor is bypassed on purpose: BOS is the only thing we add, and only if the model asks.
        ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos:
            assert self._bos_token_id is not None
            ids.insert(0, self._bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # -- chat ------------------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's Jinja2 chat template, the way `transformers` does."""
        if self._chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        try:
            return self._compiled_template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self._bos_token_id),
                eos_token=self._token_text(self._eos_token_ids[0] if self._eos_token_ids else None),
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        assert self._chat_template is not None
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            return env.from_string(self._chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._hf.id_to_token(token_id) or ""

    # -- constructors ----------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        """Build from GGUF metadata values (`tokenizer.ggml.*`, `tokenizer.chat_template`), already decoded
        into Python strings, ints and lists. `source` names the file in error messages."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"{source}: tokenizer model {model!r} is not supported (only gpt2-style byte-level BPE)"
            )
        tokens: list[str] = list(fields.get("tokenizer.ggml.tokens") or [])
        merges_raw: list[str] = list(fields.get("tokenizer.ggml.merges") or [])
        if not tokens or not merges_raw:
            raise ModelLoadError(f"{source}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise ModelLoadError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

        pre = str(fields.get("tokenizer.ggml.pre", "default"))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        # Byte-level tokens never contain a raw space (it is written as "Ġ"), so the first space separates.
        merges = [(a, b) for a, sep, b in (m.partition(" ") for m in merges_raw) if sep]
        if len(merges) != len(merges_raw):
            raise ModelLoadError(
                f"{source}: tokenizer.ggml.merges has entries that are not 'left right' pairs"
            )
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre == "llama-bpe", fuse_unk=False)
        except Exception as e:  # e.g. a merge naming a token that is not in the vocabulary
            raise ModelLoadError(f"{source}: inconsistent BPE vocabulary and merges: {e}") from e
        hf = tokenizers.Tokenizer(bpe)
        _set_pre_tokenizer(hf, pre, source)
        hf.decoder = decoders.ByteLevel()
        hf.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _TOKEN_TYPE_CONTROL
            ]
        )
        hf.add_tokens(
            [
                AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty == _TOKEN_TYPE_USER_DEFINED
            ]
        )

        eos_ids = [
            int(fields[k])
            for k in (
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.eot_token_id",
                "tokenizer.ggml.eom_token_id",
            )
            if k in fields
        ]
        bos = fields.get("tokenizer.ggml.bos_token_id")
        return cls(
            hf,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build from `tokenizer.json`, `tokenizer_config.json` (chat template, BOS/EOS, add_bos_token),
        optional `chat_template.jinja` and optional `generation_config.json` (extra EOS ids)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{path}: tokenizer.json not found (slow tokenizers are not supported)")
        try:
            hf = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:
            raise ModelLoadError(f"{tok_file}: cannot parse: {e}") from e
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        bos_id = _token_id(hf, cfg.get("bos_token"))
        eos_ids = _as_id_list(gen.get("eos_token_id"))
        eos_id = _token_id(hf, cfg.get("eos_token"))
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # No explicit flag: the tokenizer.json post-processor is what asks for BOS (e.g. Llama 3).
            add_bos = bos_id is not None and hf.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
        return cls(
            hf,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos=bool(add_bos),
            chat_template=_hf_chat_template(path, cfg),
        )


class IncrementalDetokenizer:
    """Streams one request's output text, token ids in, text deltas out.

    Uses vLLM's prefix_offset/read_offset window: decode a few tokens before the unread ones as well, so that
    tokenizers which strip a leading space on decode still produce the right delta, and emit nothing while the
    text ends in U+FFFD (a multi-byte character split across tokens). `flush()` releases any held-back tail.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._prefix_offset = max(len(self._ids) - 5, 0)
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far (excludes a held-back incomplete character)."""
        return self._text

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At end of stream: return whatever was held back, replacement characters included."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)


# -- helpers -----------------------------------------------------------------------------------------------


def _set_pre_tokenizer(hf: tokenizers.Tokenizer, pre: str, source: str) -> None:
    """Reproduce the Hugging Face pre-tokenizer that llama.cpp recorded as `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        hf.pre_tokenizer = _split_then_bytes(_LLAMA3_REGEX)
    elif pre in ("qwen2", "deepseek-r1-qwen"):
        hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = _split_then_bytes(_QWEN2_REGEX)
    else:
        if pre != "gpt-2":
            logger.warning(
                "%s: unknown tokenizer.ggml.pre %r, using plain GPT-2 byte-level splitting", source, pre
            )
        hf.pre_tokenizer = byte_level


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False
) -> str:
    # transformers' own tojson: keeps non-ASCII text readable, unlike Jinja2's HTML-safe default.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot parse JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _token_id(hf: tokenizers.Tokenizer, token: Any) -> int | None:
    """Id of a token given as tokenizer_config.json writes it: a string, an AddedToken dict, or null."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    tid = hf.token_to_id(token)
    return None if tid is None else int(tid)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _hf_chat_template(path: Path, cfg: Mapping[str, Any]) -> str | None:
    jinja_file = path / "chat_template.jinja"  # newer transformers save the template beside the config
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
