"""A GGUF's Q4_1 and Q8_0 blocks as the C++ kernels read them (kvfence/model/kernels).

Boundary: layouts only, no file reading and no arithmetic on the weights. `QuantBlocks` is a linear weight as the
GGUF stores it, split into the arrays `quant_linear` reads (the GGUF reader makes them, kvfence/model/gguf_reader.py);
`QuantPanels` is the same weight repacked once, at load, for `panel_linear` (int8 activations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

QBLOCK = 32  # weights per Q4_1 / Q8_0 block, along a row
PANEL = 16  # output columns per panel of `QuantPanels`
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; Q8_0: fp16 d, 32 int8


@dataclass(frozen=True)
class QuantBlocks:
    """A linear weight [N, K] as the GGUF stores it, in blocks of 32 along each row, split into arrays the
    kernels read directly (`kvfence/model/kernels`): `qs` [N, K/2] (Q4_1: block element j in the low nibble of
    byte j, element j + 16 in its high nibble) or [N, K] (Q8_0: int8 as bytes); `d` and `m` [N, K/32] float16.
    Weight = d * q + m (Q4_1) or d * q (Q8_0, `m` is empty)."""

    kind: str  # "Q4_1" or "Q8_0"
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def kind_id(self) -> int:  # the kernels' enum
        return 0 if self.kind == "Q4_1" else 1

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.d.shape[1] * QBLOCK

    @staticmethod
    def split(raw: np.ndarray, kind: str) -> QuantBlocks:
        """From a GGUF tensor's bytes [N, K/32 * block bytes]."""
        n = raw.shape[0]
        blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[kind])
        d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, -1)
        if kind == "Q4_1":
            m, qs = blocks[:, :, 2:4].copy().view(np.float16).reshape(n, -1), blocks[:, :, 4:].reshape(n, -1)
        else:
            m, qs = np.zeros((0, 0), np.float16), blocks[:, :, 2:].reshape(n, -1)
        return QuantBlocks(kind, torch.from_numpy(qs.copy()), torch.from_numpy(d), torch.from_numpy(m))

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> QuantBlocks:
        """The same weight with its rows reordered by `fn` (a row permutation of [N, ...] arrays)."""
        m = self.m if self.kind == "Q8_0" else torch.from_numpy(np.ascontiguousarray(fn(self.m.numpy())))
        return QuantBlocks(
            self.kind,
            torch.from_numpy(np.ascontiguousarray(fn(self.qs.numpy()))),
            torch.from_numpy(np.ascontiguousarray(fn(self.d.numpy()))),
            m,
        )

    def panel_shapes(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """The shapes and dtypes of `panels()`' wp, d and m, without repacking."""
        n, k = self.shape
        nb, panels = k // QBLOCK, -(-n // PANEL)
        group_bytes = QBLOCK // 2 if self.kind == "Q4_1" else QBLOCK
        scales = (panels, nb, PANEL)
        m = scales if self.kind == "Q4_1" else (0,)
        return (
            ((panels * nb * group_bytes * PANEL,), torch.uint8),
            (scales, torch.float16),
            (m, torch.float16),
        )

    def panels(self) -> QuantPanels:
        """The same blocks repacked for `panel_linear` (int8 activations, kvfence/model/kernels): panels of 16
        output columns, one column per 32-bit lane, blocks of each panel one after another along K. Q4_1: 4 groups
        of 64 bytes per block, byte i of a lane's group g holding q[8g + i] | q[8g + 4 + i] << 4; Q8_0: 8 groups,
        byte i holding q[4g + i] + 128. d and m become [panels, K/32, 16]; columns past N are zero."""
        n, k = self.shape
        nb, panels = k // QBLOCK, -(-n // PANEL)
        pad = panels * PANEL - n
        if self.kind == "Q4_1":
            packed = self.qs.numpy().reshape(n, nb, 16)
            q = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # [n, nb, 32] in 0..15
            q = np.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(panels, PANEL, nb, 4, 2, 4)  # k = 8g + 4h + i
            nibbles = q[:, :, :, :, 0, :] | (q[:, :, :, :, 1, :] << 4)  # [panels, lane, nb, g, i]
            wp = nibbles.transpose(0, 2, 3, 1, 4)  # [panels, nb, g, lane, i]
        else:
            q = (self.qs.numpy().view(np.int8).astype(np.int16) + 128).astype(np.uint8)
            q = np.pad(q.reshape(n, nb, 8, 4), ((0, pad), (0, 0), (0, 0), (0, 0)))
            wp = q.reshape(panels, PANEL, nb, 8, 4).transpose(0, 2, 3, 1, 4)

        def scales(t: torch.Tensor) -> torch.Tensor:
            a = np.pad(t.numpy(), ((0, pad), (0, 0))).reshape(panels, PANEL, nb).transpose(0, 2, 1)
            return torch.from_numpy(np.ascontiguousarray(a))

        m = scales(self.m) if self.kind == "Q4_1" else torch.zeros((0,), dtype=torch.float16)
        return QuantPanels(
            self.kind, n, torch.from_numpy(np.ascontiguousarray(wp).reshape(-1)), scales(self.d), m
        )

    @staticmethod
    def cat(parts: Sequence[QuantBlocks]) -> QuantBlocks | None:
        """The rows of `parts` one after another (a fused projection); None unless all are of one kind."""
        if len({p.kind for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            return None
        m = parts[0].m if parts[0].kind == "Q8_0" else torch.cat([p.m for p in parts])
        return QuantBlocks(
            parts[0].kind, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m
        )


@dataclass(frozen=True)
class QuantPanels:
    """A linear weight's blocks laid out for `panel_linear` (`QuantBlocks.panels`): `wp` the repacked quants,
    `d` and `m` [ceil(N/16), K/32, 16] float16 (`m` empty for Q8_0), `n` the number of output columns."""

    kind: str
    n: int
    wp: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def kind_id(self) -> int:
        return 0 if self.kind == "Q4_1" else 1
