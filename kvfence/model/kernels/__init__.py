"""Optional C++ kernels for the bfloat16 CPU path, built once with the system's C++ compiler and cached.

`ops()` returns the compiled module, or None when kernels are switched off (`KVFENCE_KERNELS=0`) or cannot be
built here (no compiler); the model then runs its plain torch code, which computes the same thing. The build
goes to `$KVFENCE_CACHE/kernels/<hash>` (default `~/.cache/kvfence/kernels/<hash>`), keyed by the source and
the torch version, so a changed kernel is rebuilt and an unchanged one loads in well under a second.
`python -m kvfence.model.kernels` builds them ahead of time (`make` does, so the first request does not wait).

What they are for (docs/performance.md): decode attention read straight from the pages, instead of a gather,
a copy into head-major order and about eight small torch operators per layer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("kvfence.kernels")
SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_lock = threading.Lock()
_loaded: ModuleType | None = None
_tried = False
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def enabled() -> bool:
    return os.environ.get("KVFENCE_KERNELS", "1") != "0"


def supports(head_dim: int) -> bool:
    """Shapes the kernels take: head dimensions in whole 16-float vectors."""
    return head_dim % 16 == 0


def build_dir() -> Path:
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("KVFENCE_CACHE", Path.home() / ".cache" / "kvfence"))
    return root / "kernels" / key


def ops() -> ModuleType | None:
    """The compiled kernels, building them on first use; None when off or not buildable (logged once)."""
    global _loaded, _tried
    if not enabled():
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                _loaded = _build()
            except Exception as exc:  # no compiler, no headers: the torch path serves instead
                log.warning("C++ kernels unavailable, using the torch path: %s", str(exc).splitlines()[0])
        return _loaded


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    module: ModuleType = cpp_extension.load(
        name="kvfence_cpu_ops",
        sources=[str(SOURCE)],
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(path),
        verbose=False,
    )
    return module
