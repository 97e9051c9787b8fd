"""kvfence: an LLM inference server whose paged KV cache is tenant-isolated by construction."""

__version__ = "0.1.0"
