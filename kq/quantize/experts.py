"""Turn one routed-expert weight, as stored in the source, into its three INT4 parts.

Runs on the GPU when one is given, else the CPU; the FP8 bytes travel to the device
(1 byte/weight), are dequantized there and never exist as a BF16 copy on disk.
"""
from __future__ import annotations

import torch

from kq.checkpoint.pack import pack_int4
from kq.checkpoint.reader import dequantize_fp8
from kq.errors import KqError
from kq.quantize.rtn import quantize_rtn


def dequantize_source(w: torch.Tensor, scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    w = w.to(device, non_blocking=True)
    if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return dequantize_fp8(w, scale.to(device))
    return w.to(torch.float32)


def rtn_parts(name: str, w: torch.Tensor, scale: torch.Tensor | None, *, group: int, clip: str,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (weight_packed int32 [out, in/8], weight_scale bf16 [out, in/group], weight_shape int64 [2]), on the CPU."""
    if device.type == "cuda" and _triton_ok():
        # One pass over the FP8 bytes on the GPU (kq/quantize/rtn_triton.py).
        from kq.quantize.rtn_triton import rtn_pack_gpu
        wd = w.to(device, non_blocking=True)
        sd = scale.to(device, non_blocking=True) if scale is not None else None
        packed, s = rtn_pack_gpu(wd, sd, group, clip)
        if not torch.isfinite(s).all():
            raise KqError(f"{name}: the source weight holds NaN or Inf values; the checkpoint is corrupted")
        return packed.cpu(), s.cpu(), torch.tensor([int(w.shape[0]), int(w.shape[1])], dtype=torch.int64)
    wf = dequantize_source(w, scale, device)
    if not torch.isfinite(wf).all():
        raise KqError(f"{name}: the source weight holds NaN or Inf values; the checkpoint is corrupted")
    q, s = quantize_rtn(wf, group, clip)
    return pack_parts(q, s, wf.shape)


def pack_parts(q: torch.Tensor, s: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (pack_int4(q).cpu(), s.to(torch.bfloat16).cpu(),
            torch.tensor([int(shape[0]), int(shape[1])], dtype=torch.int64))


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
