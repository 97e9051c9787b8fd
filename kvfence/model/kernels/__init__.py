"""Optional C++ kernels for the bfloat16 CPU path, built once with the system's C++ compiler and cached.

`ops()` returns the compiled module, or None when kernels are switched off (`KVFENCE_KERNELS=0`) or cannot be
built here (no compiler); the model then runs its plain torch code, which computes the same thing. The build
goes to `$KVFENCE_CACHE/kernels/<hash>` (default `~/.cache/kvfence/kernels/<hash>`), keyed by the source, the
flags, the torch version and the CPU's instruction sets (it is built with -march=native unless
`KVFENCE_KERNELS_MARCH` names another target), so a changed kernel or another CPU gets its own build, and an
unchanged one loads in about a millisecond.
`python -m kvfence.model.kernels` builds them ahead of time (`make` does, so the first request does not wait).

What they are for (docs/performance.md): decode attention read straight from the pages, instead of a gather,
a copy into head-major order and about eight small torch operators per layer; RMSNorm with the residual
add, rotary and silu(gate) * up, each one pass instead of three to eight operators; and linear layers that
multiply a decode step's few rows by the GGUF's own Q4_1/Q8_0 blocks, reading a third of the bytes of the
bfloat16 weights (`KVFENCE_QUANT_KERNELS=0` keeps the other kernels but multiplies by the bfloat16 weights).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("kvfence.kernels")
SOURCE = Path(__file__).with_name("cpu_ops.cpp")
NAME = "kvfence_cpu_ops"
_lock = threading.Lock()
_loaded: ModuleType | None = None
_tried = False
MARCH_PATTERN = re.compile(r"[a-z0-9][a-z0-9._+-]{0,63}")


def march() -> str:
    """`KVFENCE_KERNELS_MARCH`: the target the kernels are compiled for, `native` (the default: this CPU's
    instruction sets) or any gcc `-march` value, such as `x86-64-v3` (AVX2, no AVX-512) for a build that runs on
    any recent x86 CPU. Without AVX512-BF16 and VNNI the kernels take their scalar paths, which compute the
    same sums (docs/quality.md measures both). Anything that is not a plain target name is refused. Read once per
    process, when the kernels first load."""
    value = os.environ.get("KVFENCE_KERNELS_MARCH", "native")
    if not MARCH_PATTERN.fullmatch(value):
        raise ValueError(
            f"KVFENCE_KERNELS_MARCH={value!r}: expected a gcc -march target such as native or x86-64-v3"
        )
    return value


def cflags() -> list[str]:
    return ["-O3", f"-march={march()}", "-fopenmp", "-fno-math-errno"]


def enabled() -> bool:
    return os.environ.get("KVFENCE_KERNELS", "1") != "0"


def quant_enabled() -> bool:
    return os.environ.get("KVFENCE_QUANT_KERNELS", "1") != "0"


INT8_MODES = ("0", "decode", "all")


def int8_mode() -> str:
    """`KVFENCE_INT8`: "decode" (the default), "all" or "0"; anything else is refused rather than guessed."""
    mode = os.environ.get("KVFENCE_INT8", "decode")
    if mode not in INT8_MODES:
        raise ValueError(f"KVFENCE_INT8={mode!r}: expected one of {', '.join(INT8_MODES)}")
    return mode


def int8_enabled() -> bool:
    """Linear layers on the GGUF's blocks take int8 activations per block of 32 (`panel_linear`) in steps of few
    rows; off (`KVFENCE_INT8=0`), they take bfloat16 activations there (`quant_linear`)."""
    return int8_mode() != "0"


def int8_prefill() -> bool:
    """`KVFENCE_INT8=all`: longer steps (prefills) too, in one int8 level (llama.cpp's precision), instead of
    oneDNN on the bfloat16 weights, which are then dropped."""
    return int8_mode() == "all"


def supports(head_dim: int) -> bool:
    """Shapes the kernels take: head dimensions in whole 16-float vectors."""
    return head_dim % 16 == 0


def cpu_flags() -> bytes:
    """The `flags` line of /proc/cpuinfo (empty where there is none): the CPU's instruction sets."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def build_dir() -> Path:
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(cflags()).encode() + torch.__version__.encode() + cpu_flags()
    ).hexdigest()[:16]
    root = Path(os.environ.get("KVFENCE_CACHE", Path.home() / ".cache" / "kvfence"))
    return root / "kernels" / key


def ops() -> ModuleType | None:
    """The compiled kernels, building them on first use; None when off or not buildable (logged once)."""
    global _loaded, _tried
    if not enabled():
        return None
    march()  # a bad value is refused, not taken as "no kernels"
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _build()
            except Exception as exc:  # no compiler, no headers: the torch path serves instead
                log.warning("C++ kernels unavailable, using the torch path: %s", str(exc).splitlines()[0])
        return _loaded


def _build() -> ModuleType:
    """Load the built library directly when it exists (no compiler, no build lock: a worker killed while it
    held torch's build lock would otherwise leave every later process waiting on it); build it otherwise."""
    path = build_dir()
    library = path / f"{NAME}.so"
    if library.exists():
        try:
            return _import(library)
        except ImportError as exc:  # a partial file from an interrupted build: build again
            log.warning("rebuilding the C++ kernels: %s", exc)
    from torch.utils import cpp_extension

    path.mkdir(parents=True, exist_ok=True)
    module: ModuleType = cpp_extension.load(
        name=NAME,
        sources=[str(SOURCE)],
        extra_cflags=cflags(),
        extra_ldflags=["-fopenmp"],
        build_directory=str(path),
        verbose=False,
    )
    return module


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
