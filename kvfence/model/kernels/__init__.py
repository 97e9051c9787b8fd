"""Optional C++ kernels for the bfloat16 CPU path, built once with the system's C++ compiler and cached.

Which path a model computes on is chosen once, when it loads, from its `KernelOptions` (kvfence/config.py):
`configure(options, dtype, device, head_dim)` returns the `Backend` the model keeps (kvfence/model/kernels/ops.py):
the kernels' thin typed wrappers (`KernelOps`), or none when they are switched off (`kernels=False`), do not
apply (not bfloat16 on the CPU, a head dimension they do not take) or cannot be built here (no compiler); the
model then runs its plain torch code, which computes the same thing. Nothing here reads the kernel switches from
the environment: the `KVFENCE_*` variables feed `KernelOptions.from_env()`.

`library(march)` builds or loads the compiled module: one extension (`kvfence_cpu_ops`) from every source of
`SOURCES` (one .cpp per kernel family, `cpu_ops.h` for what they share, `bindings.cpp` for the Python module).
The build goes to `$KVFENCE_CACHE/kernels/<hash>` (default `~/.cache/kvfence/kernels/<hash>`), keyed by every
source and the header, the flags (-march=native unless `kernels_march` names another target), the torch version
and the CPU's instruction sets, so a changed kernel or another CPU gets its own build, and an unchanged one loads
in about a millisecond. `python -m kvfence.model.kernels` builds them ahead of time (`make` does, so the first
request does not wait).

What they are for (docs/performance.md): decode attention read straight from the pages, instead of a gather,
a copy into head-major order and about eight small torch operators per layer; RMSNorm with the residual
add, rotary and silu(gate) * up, each one pass instead of three to eight operators; and linear layers that
multiply a decode step's few rows by the GGUF's own Q4_1/Q8_0 blocks, reading a third of the bytes of the
bfloat16 weights (`quant_kernels=False` keeps the other kernels but multiplies by the bfloat16 weights).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from kvfence.config import KernelOptions
from kvfence.model.kernels.ops import Backend, KernelOps

__all__ = [
    "SOURCES",
    "Backend",
    "KernelOps",
    "build_dir",
    "configure",
    "cpu_flags",
    "library",
    "ops",
    "supports",
]

log = logging.getLogger("kvfence.kernels")
HERE = Path(__file__).parent
# every file the module is built from (the build directory's hash covers them all)
HEADER = HERE / "cpu_ops.h"
SOURCES = tuple(
    HERE / name
    for name in (
        "decode_attention.cpp",
        "write_kv.cpp",
        "prefill_attention.cpp",
        "fused_ops.cpp",
        "quant_linear.cpp",
        "panel_linear.cpp",
        "output_head.cpp",
        "tile_linear.cpp",
        "tile_attention.cpp",
        "bindings.cpp",
    )
)
NAME = "kvfence_cpu_ops"
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}  # march -> the module, or None when it could not be built


def cflags(march: str) -> list[str]:
    """`march`: `native` (this CPU's instruction sets) or any gcc `-march` value, such as `x86-64-v3` (AVX2, no
    AVX-512) for a build that runs on any recent x86 CPU. Without AVX512-BF16 and VNNI the kernels take their scalar
    paths, which compute the same sums (docs/quality.md measures both). `KernelOptions` refuses anything that is
    not a plain target name."""
    return ["-O3", f"-march={march}", "-fopenmp", "-fno-math-errno"]


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


def build_dir(march: str = "native") -> Path:
    digest = hashlib.sha256()
    for path in (HEADER, *SOURCES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(cflags(march)).encode() + torch.__version__.encode() + cpu_flags())
    root = Path(os.environ.get("KVFENCE_CACHE", Path.home() / ".cache" / "kvfence"))
    return root / "kernels" / digest.hexdigest()[:16]


def library(march: str = "native") -> ModuleType | None:
    """The compiled module for `march`, built on first use; None when it cannot be built here (logged once)."""
    with _lock:
        if march not in _loaded:
            _loaded[march] = None
            try:
                _loaded[march] = _build(march)
            except Exception as exc:  # no compiler, no headers: the torch path serves instead
                log.warning("C++ kernels unavailable, using the torch path: %s", str(exc).splitlines()[0])
        return _loaded[march]


def ops(options: KernelOptions) -> KernelOps | None:
    """The kernels' wrappers, or None when `options` switch them off or they cannot be built."""
    if not options.kernels:
        return None
    lib = library(options.kernels_march)
    return None if lib is None else KernelOps(lib)


def configure(options: KernelOptions, dtype: torch.dtype, device: str, head_dim: int) -> Backend:
    """The compute path of a model of this dtype, device and head dimension: decided here, once, at load."""
    applies = dtype == torch.bfloat16 and torch.device(device).type == "cpu" and supports(head_dim)
    kernel_ops = ops(options) if applies else None
    return Backend(
        ops=kernel_ops,
        quant=options.quant_kernels,
        int8=options.int8,
        hugepages=options.hugepages,
        tiles=options.amx_tiles and kernel_ops is not None and kernel_ops.head_tiles,
    )


def _build(march: str) -> ModuleType:
    """Load the built library directly when it exists (no compiler, no build lock: a worker killed while it
    held torch's build lock would otherwise leave every later process waiting on it); build it otherwise."""
    path = build_dir(march)
    built = path / f"{NAME}.so"
    if built.exists():
        try:
            return _import(built)
        except ImportError as exc:  # a partial file from an interrupted build: build again
            log.warning("rebuilding the C++ kernels: %s", exc)
    from torch.utils import cpp_extension

    path.mkdir(parents=True, exist_ok=True)
    module: ModuleType = cpp_extension.load(
        name=NAME,
        sources=[str(s) for s in SOURCES],
        extra_cflags=cflags(march),
        extra_include_paths=[str(HERE)],
        extra_ldflags=["-fopenmp"],
        build_directory=str(path),
        verbose=False,
    )
    return module


def _import(built: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, built)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {built}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
