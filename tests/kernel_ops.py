"""The C++ kernels for a test module, or a module-level skip that says why.

The kernels are optional at run time (the model falls back to torch), but `make test` sets
KVFENCE_REQUIRE_KERNELS=1 so that a build that stopped working fails the tests instead of silently serving
slower."""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType

import pytest

from kvfence.config import KernelOptions
from kvfence.model import kernels


def kernel_ops() -> ModuleType:
    """The compiled module itself (every kernel, `panel_linear_scalar` included), for the options of the
    environment (`KernelOptions.from_env()`: KVFENCE_KERNELS, KVFENCE_KERNELS_MARCH)."""
    options = KernelOptions.from_env()
    ops = kernels.library(options.kernels_march) if options.kernels else None
    if ops is None:
        if os.environ.get("KVFENCE_REQUIRE_KERNELS") == "1":
            raise RuntimeError(
                "KVFENCE_REQUIRE_KERNELS=1 but the C++ kernels could not be built (see the log)"
            )
        pytest.skip(
            "C++ kernels unavailable (KVFENCE_KERNELS=0, or no g++, or not x86-64); the model runs its torch path. "
            "`make test` sets KVFENCE_REQUIRE_KERNELS=1, which fails here instead",
            allow_module_level=True,
        )
    return ops


def kernel_options(**changes: object) -> KernelOptions:
    """The environment's options (the build `kernel_ops()` loads) with `changes`, for a model under test."""
    return dataclasses.replace(KernelOptions.from_env(), **changes)
