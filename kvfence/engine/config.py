"""Engine configuration: one frozen record, filled from the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfence.faults import Faults
from kvfence.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_KV_CACHE_GIB = 1.0
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bfloat16 dot products


def resolve_dtype(dtype: str, device: str) -> str:
    """The command line's `--dtype auto` (its default): bfloat16 on CUDA and on CPUs with native bfloat16 dot
    products (AVX512-BF16 or AMX, where the C++ kernels run; 2-4x faster than float32 here), float32 on
    other CPUs, where bfloat16 is emulated and slower. Any other value is returned as it is."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    from kvfence.model.kernels import cpu_flags

    flags = cpu_flags().decode().split()
    return "bfloat16" if any(flag in _NATIVE_BF16_FLAGS for flag in flags) else "float32"


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    page_size: int = 16
    kv_pages: int | None = None  # pool size in pages; or derive it from kv_cache_memory
    kv_cache_memory: float | None = None  # GiB for K and V across all layers
    context_length: int | None = None  # lower the model's own context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_batch_tokens: int = 0  # another request's prefill joins a step only within this (0: no limit)
    integrity_checks: bool = (
        True  # I1 checks before/after every step and tag stamping; off only to measure cost
    )
    num_threads: int | None = None
    # torch threads for steps with no prefill token (None: num_threads). Stepping on another thread than the one
    # that loaded the model? Load with `on_passing_thread` (llm_engine.py), or OpenMP workers sleep per operator.
    decode_threads: int | None = None
    seed: int = 0
    lease_prefix: int | None = None
    faults: Faults | None = None
    enable_prefix_cache: bool = True  # tenant-scoped prefix cache over sealed pages (docs/prefix-cache.md)
    kv_canary_interval: int = 64  # steps between canary re-checks of cached pages' digests; 0: never

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_pages is not None and self.kv_cache_memory is not None:
            raise ValueError("give either kv_pages or kv_cache_memory, not both")
        if self.kv_canary_interval < 0:
            raise ValueError(
                f"kv_canary_interval must be 0 (off) or a number of steps, got {self.kv_canary_interval}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolve_num_pages(self, model: ModelConfig) -> int:
        if self.kv_pages is not None:
            if self.kv_pages < 1:
                raise ValueError(f"kv_pages must be positive, got {self.kv_pages}")
            return self.kv_pages
        gib = self.kv_cache_memory if self.kv_cache_memory is not None else DEFAULT_KV_CACHE_GIB
        page_bytes = self.page_size * model.kv_bytes_per_token(self.torch_dtype.itemsize)
        num_pages = int(gib * (1 << 30)) // page_bytes
        if num_pages < 1:
            raise ValueError(f"kv_cache_memory {gib} GiB holds no page of {page_bytes} bytes")
        return num_pages
