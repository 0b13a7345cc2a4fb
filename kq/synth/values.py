"""Deterministic, realistic tensor values for synthetic checkpoints.

Every tensor group (a Linear's weight + its scale, a norm, ...) draws from its own
torch.Generator seeded by (seed, group name[, row block]). So a tensor's bytes depend
only on the seed and its name: generation order, shard layout and the other options
never change them, and a streamed writer can regenerate a tensor rather than keep it.

Linear weights are drawn and quantized 128 rows at a time (one FP8 block row), each
row block from its own generator: a full-size layer streams through bounded memory and
the values do not depend on how the writer chunks its work.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterator

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value; DeepSeek-style scales are amax / 448
BLOCK = 128
ROWS = 128  # rows per draw: one FP8 block row, so block scales never straddle draws


def generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"kq-synth/{seed}/{key}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def weight_rows(seed: int, key: str, out: int, inn: int, std: float = 0.02) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first row, float32 [<=128, in]) covering a [out, in] weight ~ N(0, std) with a
    mild per-row spread. Trained weights have rows of different magnitude; the log-normal
    row factor makes per-channel and per-block scales differ, as in real checkpoints, so a
    reader that mixes up scale rows or blocks gets visibly wrong values."""
    for r0 in range(0, out, ROWS):
        n = min(ROWS, out - r0)
        g = generator(seed, f"{key}#{r0}")
        w = torch.randn(n, inn, generator=g, dtype=torch.float32)
        row = torch.exp(0.25 * torch.randn(n, 1, generator=g, dtype=torch.float32))
        yield r0, w.mul_(row.mul_(std))


def fp8_block_rows(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """One block row of DeepSeek/GLM-5 block FP8.

    w float32 [r<=128, in] -> (q F8_E4M3 [r, in], scale_inv F32 [1, ceil(in/128)]) with
    w ~= q * scale_inv[block]: `weight_scale_inv` is a multiplier despite its name. A last
    partial block (in not a multiple of 128) gets its own scale from its own columns.
    """
    r, inn = w.shape
    ib = math.ceil(inn / block)
    pad = ib * block - inn
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    amax = wp.abs().view(r, ib, block).amax(dim=(0, 2))  # [ib]
    scale = (amax / FP8_MAX).clamp_min(1e-12)  # an all-zero block must not divide by 0
    q = (wp.view(r, ib, block) / scale.view(1, ib, 1)).view(r, ib * block)[:, :inn]
    return q.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.view(1, ib)


def fp8_channel_rows(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 (compressed-tensors float-quantized, strategy channel).

    w float32 [r, in] -> (q F8_E4M3 [r, in], scale [r, 1] in scale_dtype). The scale is
    rounded to its storage dtype *before* quantizing, so q * scale is exactly what a
    reader reconstructs from the stored bytes.
    """
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(1e-12).to(scale_dtype)
    q = (w / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def int4_rows(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 group quantization as Kimi K2.5+ ships it (codes in [-7, 7]).

    w float32 [r, in] -> (packed int32 [r, in/8], scale BF16 [r, in/group]).
    Packing per compressed-tensors pack-quantized: nibble = q + 8, input column 8w+k
    in bits [4k, 4k+4) of word w. Written here independently of kq.checkpoint.pack
    so the synthetic input does not share code (or bugs) with the packer under test.
    """
    r, inn = w.shape
    amax = w.view(r, inn // group, group).abs().amax(dim=2)
    scale = (amax / 7.0).clamp_min(1e-12).to(torch.bfloat16)  # [r, in/group]
    q = torch.round(w.view(r, inn // group, group) / scale.float().unsqueeze(2))
    nib = (q.clamp_(-7, 7).to(torch.int64) + 8).view(r, inn // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (nib << shifts).sum(dim=2)  # < 2**32, fits int64
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as int32
    return words.to(torch.int32), scale


def norm_weight(g: torch.Generator, n: int) -> torch.Tensor:
    """RMSNorm gain: around 1, BF16."""
    return (1.0 + 0.05 * torch.randn(n, generator=g)).to(torch.bfloat16)


def small(g: torch.Generator, shape: tuple[int, ...], std: float, dtype: torch.dtype) -> torch.Tensor:
    return (std * torch.randn(*shape, generator=g)).to(dtype)
