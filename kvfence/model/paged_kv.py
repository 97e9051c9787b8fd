"""The KV pool's tensors (`PagedKV`): per layer, K and V for every slot of every page.

Boundary: tensors and bytes only; which pages a request owns is kvfence/kv's bookkeeping, and the model
(kvfence/model/llama.py) reads and writes the pool through the block tables and slot mapping of a step. Pages
leave and enter the pool as bytes (`read_page` / `write_page`, one transfer frame each) and are fingerprinted by
`page_digest`. On the CPU the pool is on transparent huge pages unless the backend says otherwise.

Shapes: L = layers, P = pages in the pool, S = page size (tokens per page), Hkv = KV heads, Dh = head dim.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash
from torch import Tensor

from kvfence.config import KernelOptions
from kvfence.model import hugepages
from kvfence.model.config import ModelConfig


class PagedKV:
    """The KV pool's tensors: per layer, K and V for every slot of every page."""

    def __init__(
        self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str,
        huge_pages: bool | None = None,
    ) -> None:  # fmt: skip
        """`huge_pages`: the model's `backend.hugepages` (None: `KernelOptions.from_env()`'s)."""
        self.page_size = page_size
        # kv: [L, 2, P, S, Hkv, Dh]; on CPU on huge pages (a decode step reads it at scattered pages)
        shape = (cfg.num_layers, 2, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        if torch.device(device).type == "cpu":
            huge = KernelOptions.from_env().hugepages if huge_pages is None else huge_pages
            self.kv = hugepages.empty(shape, dtype, huge=huge)
        else:
            self.kv = torch.empty(shape, dtype=dtype, device=device)
        # touch it all now so the pool exists for real before serving starts (fails at startup rather than
        # mid-request if the memory is not there, and keeps step latency steady)
        self.kv.fill_(0)

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        # k, v: [T, Hkv, Dh]; slots: [T]
        flat = self.kv[layer].view(2, -1, *self.kv.shape[-2:])  # [2, P*S, Hkv, Dh]
        flat.index_copy_(1, slots, torch.stack((k, v)))

    def page_bytes(self) -> int:
        """Bytes of one page across all layers, K and V: the payload of one transfer frame."""
        return self.kv[:, :, 0].numel() * self.kv.element_size()

    def read_page(self, page: int) -> bytes:
        """One page's K/V for all layers as bytes, layout [L, 2, S, Hkv, Dh] (independent of placement)."""
        return self._page_block(page).tobytes()

    def page_digest(self, page: int) -> int:
        """xxh3-64 of `read_page(page)`: the page's K/V for all layers, layout [L, 2, S, Hkv, Dh]."""
        return xxhash.xxh3_64_intdigest(self._page_block(page).data)

    def _page_block(self, page: int) -> np.ndarray:
        """The page as one contiguous uint8 array. On CPU the strided copy goes through numpy, single-threaded:
        torch's parallel copy of 60 small blocks costs ten times more on a busy machine (about 0.1 ms against
        1-8 ms for a 737 KB page here)."""
        if self.kv.device.type == "cpu":
            raw = self.kv.view(torch.uint8).numpy()  # [L, 2, P, S, Hkv, Dh * itemsize], a view
            return np.ascontiguousarray(raw[:, :, page])
        return self.kv[:, :, page].contiguous().view(torch.uint8).cpu().numpy()

    def write_page(self, page: int, payload: bytes) -> None:
        """Inverse of read_page: the receiving side of a transfer frame."""
        if self.kv.device.type == "cpu":
            raw = self.kv.view(torch.uint8).numpy()
            raw[:, :, page] = np.frombuffer(payload, dtype=np.uint8).reshape(raw[:, :, page].shape)
            return
        block = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv.dtype)
        self.kv[:, :, page] = block.view(self.kv[:, :, page].shape).to(self.kv.device)

    def gather(self, layer: int, pages: Tensor) -> tuple[Tensor, Tensor]:
        """K and V for the pages of a block table: pages [..., n] -> [..., n * S, Hkv, Dh]."""
        # index_select over [P, S*Hkv*Dh] rows copies whole pages; several times faster than advanced indexing
        num_pages = self.kv.shape[2]
        idx = pages.reshape(-1)
        k = self.kv[layer, 0].view(num_pages, -1).index_select(0, idx)
        v = self.kv[layer, 1].view(num_pages, -1).index_select(0, idx)
        shape = (*pages.shape[:-1], pages.shape[-1] * self.page_size, *self.kv.shape[-2:])
        return k.view(shape), v.view(shape)

    def gather_kv(self, layer: int, pages: Tensor) -> Tensor:
        """K and V together in one copy: pages [B, n] -> [2, B, n * S, Hkv, Dh]."""
        num_pages = self.kv.shape[2]
        kv = self.kv[layer].view(2, num_pages, -1).index_select(1, pages.reshape(-1))
        return kv.view(2, *pages.shape[:-1], pages.shape[-1] * self.page_size, *self.kv.shape[-2:])
