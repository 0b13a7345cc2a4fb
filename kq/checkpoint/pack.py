"""compressed-tensors `pack-quantized` INT4 weights: the packing contract lives in kq.format
(imported here under its long-standing names); this module adds the dequantization."""
from __future__ import annotations

import torch

from kq.format import pack_int4, unpack_int4  # noqa: F401  (kq.checkpoint.pack's API)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    """W[o, i] = q[o, i] * scale[o, i // group], float32 [out, in]."""
    out, n_in = int(shape[0]), int(shape[1])
    q = unpack_int4(packed, n_in).to(torch.float32)
    group = n_in // scale.shape[1]
    return q * scale.to(torch.float32).repeat_interleave(group, dim=1)[:, :n_in]
