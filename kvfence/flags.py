"""Command-line flags generated from the configuration tree (kvfence/config.py), and the tree built back from
them: a flag's name, type, default, choices and help exist once, as the field's.

Precedence, lowest first: the field's default, its environment variable (documented override), `--config FILE`
(a JSON tree, what a PD worker receives from `serve --mode pd`), then the flags given on this command line.
Torch-free: parsing never loads the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfence import config as tree
from kvfence import options
from kvfence.config import Config
from kvfence.options import resolve_dtype, unique_keys


def flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def dest(section: str, name: str) -> str:
    return f"{section}.{name}"


def add_flags(p: argparse.ArgumentParser, command: str) -> None:
    """Every field of the tree that belongs to `command`, as a flag whose default is "not given" (SUPPRESS):
    the tree's own default then applies, so it lives in one place. `--config FILE` reads a JSON tree."""
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="a JSON configuration tree (`-`: standard input); flags given here win over it",
    )  # fmt: skip
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for section, f in tree.all_fields():
        meta = f.metadata
        if command not in meta.get("commands", ()):
            continue
        target: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup = p
        if meta.get("group"):
            if meta["group"] not in groups:  # made on first use: argparse refuses to print an empty group
                groups[meta["group"]] = p.add_mutually_exclusive_group()
            target = groups[meta["group"]]
        help_text = _help(f)
        kind = options.kind(f)
        name = flag_name(f)
        key = dest(section, f.name)
        if kind is bool:
            if f.default is False:  # a switch that turns something on
                target.add_argument(name, dest=key, action="store_const", const=True, default=argparse.SUPPRESS,
                                    help=help_text)  # fmt: skip
            else:
                target.add_argument(name, dest=key, action=argparse.BooleanOptionalAction,
                                    default=argparse.SUPPRESS, help=help_text)  # fmt: skip
            if meta.get("alias_off"):
                target.add_argument(meta["alias_off"], dest=key, action="store_const", const=False,
                                    default=argparse.SUPPRESS, help=f"same as --no-{name[2:]}")  # fmt: skip
            continue
        target.add_argument(name, dest=key, type=kind, default=argparse.SUPPRESS, choices=meta.get("choices"),
                            metavar=meta.get("metavar") or (None if meta.get("choices") else f.name.upper()),
                            help=help_text)  # fmt: skip


def _help(f: dataclasses.Field[Any]) -> str:
    text = str(f.metadata.get("help", ""))
    env = f.metadata.get("env")
    default = f.default
    quiet = f.metadata.get("secret") or default is None or isinstance(default, bool)
    shown = "" if quiet else f" (default: {default})"
    return text + shown + (f"; ${env} overrides the default" if env else "")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Config:
    """The effective tree: defaults <- environment <- `--config` file <- flags given. Raises ValueError (the
    message names the flag) for a bad value, an unknown field in the file or a conflict."""
    config = tree.from_env(Config(), environ)
    path = getattr(args, "config", None)
    if path:
        config = merge(config, _read_json(path))
    given: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            given.setdefault(section, {})[name] = value
    if given:
        config = merge(config, given)
    return config


def merge(config: Config, nested: Mapping[str, Mapping[str, Any]]) -> Config:
    """`config` with the values of `nested` ({section: {field: value}}) on top; unknown names are refused."""
    base = config.to_dict()
    for section, values in nested.items():
        if section not in base:
            raise ValueError(f"unknown configuration section {section!r}")
        unknown = sorted(set(values) - set(base[section]))
        if unknown:
            raise ValueError(f"unknown field(s) in section {section!r}: {', '.join(unknown)}")
        base[section].update(values)
    return tree.from_dict(base)


def _read_json(path: str) -> dict[str, Any]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except ValueError as e:  # JSONDecodeError is one
        raise ValueError(f"--config {path}: not JSON: {e}") from e
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"--config {path}: expected an object of sections, each an object of fields")
    return data


def defaults_for(command: str) -> dict[str, Any]:
    """What a command's parser leaves to the tree: {section.field: default} for each of its flags (tests)."""
    return {
        dest(section, f.name): getattr(getattr(Config(), section), f.name)
        for section, f in tree.all_fields()
        if command in f.metadata.get("commands", ())
    }


def resolve(config: Config) -> Config:
    """The tree with `dtype=auto` (the command line's default) made concrete, once, where it is read: bfloat16
    on CUDA and on CPUs with native bfloat16 dot products (AVX512-BF16 or AMX, where the C++ kernels run; 2-4x
    faster than float32 here), float32 on other CPUs, where bfloat16 is emulated and slower. PD workers get the
    resolved tree, so both sides of a transfer hold the same dtype."""
    if config.model.dtype != "auto":
        return config
    return config.replace(dtype=resolve_dtype("auto", config.model.device))
