"""compressed-tensors `pack-quantized` INT4 packing.

Layout (REFERENCE.md §2): symmetric codes q in [-8, 7] are stored as nibble q + 8;
eight nibbles per int32 along the *input* dimension, least-significant first, so
input column 8*w + k sits in bits [4k, 4k+4) of word w.
"""
from __future__ import annotations

import torch

SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # [8]: bit offset of nibble k


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [out, in] in [-8, 7], in % 8 == 0  ->  int32 [out, in/8]."""
    out, n_in = q.shape
    assert n_in % 8 == 0, "input dim must be a multiple of 8"
    nib = (q.to(torch.int64) + 8).view(out, n_in // 8, 8)             # [out, in/8, 8] in [0, 15]
    words = (nib << SHIFTS.to(q.device)).sum(-1)                      # [out, in/8] in [0, 2^32)
    words = words - ((words >> 31) & 1) * (1 << 32)                   # reinterpret as signed int32
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor, n_in: int | None = None) -> torch.Tensor:
    """int32 [out, in/8] -> int8 codes [out, in] in [-8, 7]."""
    out, words = packed.shape
    nib = (packed.to(torch.int64).unsqueeze(-1) >> SHIFTS.to(packed.device)) & 0xF   # [out, in/8, 8]
    q = (nib - 8).to(torch.int8).reshape(out, words * 8)
    return q if n_in is None else q[:, :n_in]


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    """W[o, i] = q[o, i] * scale[o, i // group], float32 [out, in]."""
    out, n_in = int(shape[0]), int(shape[1])
    q = unpack_int4(packed, n_in).to(torch.float32)
    group = n_in // scale.shape[1]
    return q * scale.to(torch.float32).repeat_interleave(group, dim=1)[:, :n_in]
