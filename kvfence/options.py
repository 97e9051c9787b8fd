"""The machinery of the configuration tree's fields (kvfence/config.py): which commands an option belongs to, the
field helper that carries its flag's help, choices and environment variable, value parsing and checks. Torch-free.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import field
from typing import Any

# the commands an option belongs to (the generated flags of each command)
GENERATE, SERVE, PREFLIGHT, ROUTER, PREFILL, DECODE = (
    "generate",
    "serve",
    "preflight",
    "router",
    "prefill",
    "decode",
)
WORKERS = frozenset({PREFILL, DECODE})
ENGINE = frozenset({GENERATE, SERVE, PREFLIGHT}) | WORKERS  # the commands that build an engine
SIZED = frozenset({SERVE, PREFLIGHT}) | WORKERS  # the commands that run the preflight (I6)
HTTP = frozenset({SERVE, ROUTER})  # the commands that serve the OpenAI API

INT8_MODES = ("0", "decode", "all")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_KV_CACHE_GIB = 1.0


def option(
    default: Any,
    help: str,
    *,
    commands: frozenset[str] = ENGINE,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    env: str | None = None,
    group: str | None = None,
    alias_off: str | None = None,
    secret: bool = False,
    metavar: str | None = None,
) -> Any:
    """A field of the tree with what its flag needs. `flag`: the flag's name when it is not `--field-name`;
    `group`: flags of one group are mutually exclusive; `alias_off`: another flag that sets a boolean False;
    `secret`: never logged, returned or sent to a worker."""
    meta = dict(help=help, commands=commands, flag=flag, choices=choices, env=env, group=group,
                alias_off=alias_off, secret=secret, metavar=metavar)  # fmt: skip
    return field(default=default, metadata=meta)


def internal(default: Any) -> Any:
    """A field set by code (the simulator, PD pairs), never from the command line."""
    return field(default=default, metadata=dict(commands=frozenset(), help="", secret=False))


_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bfloat16 dot products


def resolve_dtype(dtype: str, device: str) -> str:
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    try:
        with open("/proc/cpuinfo", "rb") as f:
            line = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        line = b""
    flags = line.decode(errors="replace").split()
    return "bfloat16" if any(flag in _NATIVE_BF16_FLAGS for flag in flags) else "float32"


def parse_value(f: dataclasses.Field[Any], text: str) -> Any:
    """A field's value from text (an environment variable): booleans are 0/1/true/false/on/off."""
    kind_ = kind(f)
    if kind_ is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "on", "yes"):
            return True
        if lowered in ("0", "false", "off", "no"):
            return False
        raise ValueError(f"{f.metadata.get('env') or f.name}={text!r}: expected 0 or 1")
    if kind_ is int:
        return int(text)
    if kind_ is float:
        return float(text)
    return text


def kind(f: dataclasses.Field[Any]) -> type:
    """The Python type of a field's values (`int | None` -> int), from its annotation string."""
    annotation = str(f.type).replace(" | None", "")
    return {"bool": bool, "int": int, "float": float, "str": str}[annotation]


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def is_march(value: str) -> bool:
    return re.fullmatch(r"[a-z0-9][a-z0-9._+-]{0,63}", value) is not None


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object_pairs_hook: a key given twice is refused (json keeps the last one, silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice")
        out[key] = value
    return out
