"""Deterministic, realistic tensor values for synthetic checkpoints.

Every tensor group (a Linear's weight + its scale, a norm, ...) draws from its own
torch.Generator seeded by (seed, group name). So a tensor's bytes depend only on the
seed and its name: generation order, shard layout and the other options never change
them, and a streamed writer can regenerate a tensor instead of keeping it in RAM.
"""

from __future__ import annotations

import hashlib
import math

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value; DeepSeek-style scales are amax / 448
BLOCK = 128


def generator(seed: int, group: str) -> torch.Generator:
    digest = hashlib.sha256(f"kq-synth/{seed}/{group}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def linear_weight(g: torch.Generator, out: int, inn: int, std: float = 0.02) -> torch.Tensor:
    """float32 [out, in] ~ N(0, std) with a mild per-row spread.

    Trained weights have rows of different magnitude; the log-normal row factor makes
    per-channel and per-block scales differ from each other, as in real checkpoints,
    so a reader that mixes up scale rows/blocks gets visibly wrong values.
    """
    w = torch.randn(out, inn, generator=g, dtype=torch.float32)
    row = torch.exp(0.25 * torch.randn(out, 1, generator=g, dtype=torch.float32))
    return w.mul_(row * std)


def fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 as DeepSeek/GLM-5 store it.

    w float32 [out, in] -> (q F8_E4M3 [out, in], scale_inv F32 [ceil(out/b), ceil(in/b)])
    with w ~= q * scale_inv[block]: `weight_scale_inv` is a multiplier despite its name.
    Dims that are not multiples of the block get a partial last block (ceil).
    """
    out, inn = w.shape
    ob, ib = math.ceil(out / block), math.ceil(inn / block)
    padded = torch.zeros(ob * block, ib * block, dtype=torch.float32)
    padded[:out, :inn] = w.abs()
    amax = padded.view(ob, block, ib, block).amax(dim=(1, 3))  # [ob, ib]
    scale = (amax / FP8_MAX).clamp_min(1e-12)  # an all-zero block must not divide by 0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inn]
    q = (w / full).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.contiguous()


def fp8_channel(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 (compressed-tensors float-quantized, strategy channel).

    w float32 [out, in] -> (q F8_E4M3 [out, in], scale [out, 1] in scale_dtype).
    The scale is rounded to its storage dtype *before* quantizing, so q * scale is
    exactly what a reader reconstructs from the stored bytes.
    """
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(1e-12).to(scale_dtype)
    q = (w / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.contiguous()


def norm_weight(g: torch.Tensor | torch.Generator, n: int) -> torch.Tensor:
    """RMSNorm gain: around 1, BF16."""
    return (1.0 + 0.05 * torch.randn(n, generator=g)).to(torch.bfloat16)


def small(g: torch.Generator, shape: tuple[int, ...], std: float, dtype: torch.dtype) -> torch.Tensor:
    return (std * torch.randn(*shape, generator=g)).to(dtype)


def int4_pack(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 group quantization as Kimi K2.5+ ships it (codes in [-7, 7]).

    w float32 [out, in] -> (packed int32 [out, in/8], scale BF16 [out, in/group]).
    Packing per compressed-tensors pack-quantized: nibble = q + 8, input column 8w+k
    in bits [4k, 4k+4) of word w. Written here independently of kq.checkpoint.pack
    so the synthetic input does not share code (or bugs) with the packer under test.
    """
    out, inn = w.shape
    amax = w.view(out, inn // group, group).abs().amax(dim=2)
    scale = (amax / 7.0).clamp_min(1e-12).to(torch.bfloat16)  # [out, in/group]
    q = torch.round(w.view(out, inn // group, group) / scale.float().unsqueeze(2))
    nib = (q.clamp_(-7, 7).to(torch.int64) + 8).view(out, inn // 8, 8)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (nib << shifts).sum(dim=2)  # < 2**32, fits int64
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as int32
    return words.to(torch.int32), scale
