"""The torch side of the configuration tree (kvfence/config.py): dtype names to torch dtypes."""

from __future__ import annotations

import torch

from kvfence.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(config: Config) -> torch.dtype:
    """The engine's dtype; `auto` must have been resolved (`kvfence.config.resolve`) before an engine is built."""
    dtype = config.model.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not resolved: call kvfence.config.resolve(config) first")
    return DTYPES[dtype]
