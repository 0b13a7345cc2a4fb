"""Turn one routed-expert weight, as stored in the source, into its three INT4 parts.

Runs on the GPU when one is given, else the CPU; the FP8 bytes travel to the device
(1 byte/weight), are dequantized there and never exist as a BF16 copy on disk.

On the GPU each calling thread gets a CUDA stream of its own (the run calls this from
several threads at once), the results come back into pinned host memory (torch's caching
host allocator recycles it) and the thread waits once per tensor. The first call per
device and clip mode runs alone on the default stream (CUDA start, Triton compile).
With KQ_PROFILE=1 the stages are timed (a stream sync after each; see PROFILE).
"""
from __future__ import annotations

import threading
import time

import torch

from kq.checkpoint.pack import pack_int4
from kq.profile import PROFILE
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
        return _rtn_parts_gpu(name, w, scale, group, clip, device)
    t = time.perf_counter()
    wf = dequantize_source(w, scale, device)
    if not torch.isfinite(wf).all():
        raise KqError(f"{name}: the source weight holds NaN or Inf values; the checkpoint is corrupted")
    q, s = quantize_rtn(wf, group, clip)
    out = pack_parts(q, s, wf.shape)
    PROFILE.add("quant_cpu", t, w.nbytes)
    return out


_tls = threading.local()
_first_lock = threading.Lock()
_warm: set = set()


def _thread_stream(device: torch.device) -> "torch.cuda.Stream":
    streams = getattr(_tls, "streams", None)
    if streams is None:
        streams = _tls.streams = {}
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in streams:
        streams[key] = torch.cuda.Stream(device=key)
    return streams[key]


def _rtn_parts_gpu(name, w, scale, group, clip, device):
    key = (str(device), clip, group)
    if key not in _warm:
        # Alone: CUDA start-up and the Triton compile happen once, and the kernel's constant
        # tensors are made on one stream and finished before any other stream uses them.
        with _first_lock:
            if key not in _warm:
                t = time.perf_counter()
                try:
                    return _gpu_once(name, w, scale, group, clip, device, torch.cuda.current_stream(device))
                finally:
                    torch.cuda.synchronize(device)
                    _warm.add(key)
                    PROFILE.add("gpu_first_call", t, w.nbytes)
    return _gpu_once(name, w, scale, group, clip, device, _thread_stream(device))


def _gpu_once(name, w, scale, group, clip, device, stream):
    # One pass over the FP8 bytes on the GPU (kq/quantize/rtn_triton.py).
    from kq.quantize.rtn_triton import rtn_pack_gpu
    prof = PROFILE.on
    with torch.cuda.stream(stream):
        t = time.perf_counter()
        wd = w.to(device, non_blocking=True)
        sd = scale.to(device, non_blocking=True) if scale is not None else None
        if prof:
            stream.synchronize()
            PROFILE.add("h2d", t, w.nbytes)
            t = time.perf_counter()
        packed, s = rtn_pack_gpu(wd, sd, group, clip)
        finite = torch.isfinite(s).all()
        if prof:
            stream.synchronize()
            PROFILE.add("kernel", t)
            t = time.perf_counter()
        hp = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        hs = torch.empty(s.shape, dtype=s.dtype, pin_memory=True)
        hf = torch.empty((), dtype=torch.bool, pin_memory=True)
        hp.copy_(packed, non_blocking=True)
        hs.copy_(s, non_blocking=True)
        hf.copy_(finite, non_blocking=True)
        stream.synchronize()  # releases the GIL while the GPU works
        PROFILE.add("d2h", t, hp.nbytes + hs.nbytes)
    if not bool(hf):
        raise KqError(f"{name}: the source weight holds NaN or Inf values; the checkpoint is corrupted")
    return hp, hs, torch.tensor([int(w.shape[0]), int(w.shape[1])], dtype=torch.int64)


def pack_parts(q: torch.Tensor, s: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (pack_int4(q).cpu(), s.to(torch.bfloat16).cpu(),
            torch.tensor([int(shape[0]), int(shape[1])], dtype=torch.int64))


def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
