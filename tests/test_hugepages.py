"""Big CPU buffers ask for transparent huge pages (kvfence/model/hugepages.py): the KV pool and the GGUF blocks."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from kvfence.model import hugepages
from kvfence.model.config import ModelConfig
from kvfence.model.paged_kv import PagedKV

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="reads /proc/self/smaps, which only Linux has"
)


def kernel_takes_the_advice() -> bool:
    """Whether this kernel accepts MADV_HUGEPAGE at all (built with transparent huge pages, no sandbox refusing
    it). Where it does not, every buffer must come back as plain memory instead."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    buf = mmap.mmap(-1, hugepages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
        return True
    except OSError:
        return False
    finally:
        buf.close()


THP = kernel_takes_the_advice()


def advised_for_huge_pages(t: torch.Tensor) -> bool:
    """Whether the mapping that holds `t` carries MADV_HUGEPAGE (`hg` in its VmFlags in /proc/self/smaps)."""
    address = t.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def test_big_buffers_ask_for_huge_pages_and_small_ones_do_not():
    big = hugepages.empty((hugepages.MIN_BYTES // 2,), torch.bfloat16)
    assert big.shape == (hugepages.MIN_BYTES // 2,) and big.dtype == torch.bfloat16
    assert advised_for_huge_pages(big) == THP
    assert not THP or big.data_ptr() % hugepages.HUGE_PAGE == 0  # starts on a huge page boundary
    big.fill_(1.5)
    assert float(big.float().sum()) == 1.5 * big.numel()
    small = hugepages.empty((1024,), torch.float32)
    assert not advised_for_huge_pages(small)


def test_a_refused_advice_gives_plain_memory(monkeypatch):
    """A kernel built without transparent huge pages (or a sandbox) refuses MADV_HUGEPAGE: plain memory then."""

    class Refusing(mmap.mmap):
        def madvise(self, *args: int) -> None:
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(hugepages.mmap, "mmap", Refusing)
    t = hugepages.empty((hugepages.MIN_BYTES,), torch.uint8)
    assert t.shape == (hugepages.MIN_BYTES,) and not advised_for_huge_pages(t)


def test_switched_off_gives_plain_memory():
    assert not advised_for_huge_pages(hugepages.empty((hugepages.MIN_BYTES,), torch.uint8, huge=False))
    assert not advised_for_huge_pages(
        hugepages.pack([torch.zeros(hugepages.MIN_BYTES, dtype=torch.uint8)], False)[0]
    )


def test_pack_copies_each_tensor_aligned_into_one_buffer():
    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randint(0, 256, (49152, 288), generator=g, dtype=torch.uint8),  # Q4_1 nibbles of a big head
        torch.randn(3072, 18, generator=g).half(),
        torch.empty(0, dtype=torch.float16),  # Q8_0 has no m
        torch.randn(49152, 18, generator=g).half(),
        torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),
    ]
    placed = hugepages.pack(parts)
    for src, dst in zip(parts, placed, strict=True):
        assert dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src)
        assert dst.data_ptr() % hugepages.ALIGN == 0
        assert dst.numel() == 0 or dst.data_ptr() != src.data_ptr()
    assert advised_for_huge_pages(placed[0]) == THP and advised_for_huge_pages(placed[-1]) == THP


def test_the_kv_pool_is_on_huge_pages_and_zeroed():
    cfg = ModelConfig(
        architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5, context_length=256,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=(0,),
    )  # fmt: skip
    cache = PagedKV(cfg, num_pages=2048, page_size=16, dtype=torch.bfloat16, device="cpu", huge_pages=True)
    assert cache.kv.shape == (4, 2, 2048, 16, 2, 16)
    assert advised_for_huge_pages(cache.kv) == THP
    assert not cache.kv.any()
