"""RTN on the GPU in one pass: FP8 (or BF16) expert weight in, packed INT4 + bf16 scales out.

The torch search in rtn.py makes ~19 candidate passes over a float32 copy of the weight
(~1 KB of memory traffic per weight); this kernel reads each weight once (1 byte for
FP8), keeps its [ROWS, 128] tile in registers, tries every clipping divisor there and
writes only the packed codes and scales. Same arithmetic as rtn.py: scale = bf16(amax/d),
q = clamp(rint(w/scale), -8, 7), least squared error per group wins (first one on ties).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kq.quantize.rtn import ABSMAX_DIVISOR, MSE_DIVISORS

ROWS = 16
COLS = 128  # one FP8 block column: a tile never straddles two block scales
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds to nearest-even for |x| < 2**22


@triton.jit
def _bf16_round(x):
    # fp32 -> nearest-even bf16, kept in fp32, with integer ops: the same result compiled
    # and in Triton's interpreter (whose float cast truncates).
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    # NaN stays NaN (the GPU's canonical NaN 0x7FFFFFFF would wrap to -0.0 above)
    return tl.where(x != x, x, b.to(tl.float32, bitcast=True))


@triton.jit
def _rtn_kernel(w_ptr, bs_ptr, q_ptr, s_ptr, n_out, n_in, bs_cols,
                divs_ptr, N_DIVS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_SCALE_ROWS: tl.constexpr,
                PER_ROW_ONLY: tl.constexpr,
                G: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * ROWS + tl.arange(0, ROWS)                       # [R]
    cols = pid_c * COLS + tl.arange(0, COLS)                       # [C]
    mask = (rows[:, None] < n_out) & (cols[None, :] < n_in)
    w = tl.load(w_ptr + rows[:, None] * n_in + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        # block scale of (row // BLOCK_SCALE_ROWS, this 128-column block); one per row here
        bcol = 0 if PER_ROW_ONLY else pid_c
        bs = tl.load(bs_ptr + (rows // BLOCK_SCALE_ROWS) * bs_cols + bcol, mask=rows < n_out, other=1.0)
        w = w * bs[:, None]
    wg = tl.reshape(w, (ROWS, COLS // G, G))                       # [R, NG, G]
    amax = tl.maximum(tl.max(tl.abs(wg), axis=2), 1e-30)           # [R, NG]
    # The GPU's max ignores NaN (the interpreter's does not): a NaN weight would leave a finite
    # scale behind. Put the NaN into amax so the scale, which the caller checks, carries it.
    has_nan = tl.max((wg != wg).to(tl.int32), axis=2) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    best_s = tl.zeros((ROWS, COLS // G), dtype=tl.float32)
    best_e = tl.full((ROWS, COLS // G), float("inf"), dtype=tl.float32)
    for i in tl.static_range(N_DIVS):
        d = tl.load(divs_ptr + i)
        s = _bf16_round(tl.math.div_rn(amax, d))  # IEEE division, as torch computes it
        q = tl.minimum(tl.maximum((tl.math.div_rn(wg, s[:, :, None]) + _MAGIC) - _MAGIC, -8.0), 7.0)
        r = q * s[:, :, None] - wg
        e = tl.sum(r * r, axis=2)
        # the first candidate is taken unconditionally (as rtn.py does): with a NaN/Inf weight
        # every error is NaN, no candidate would be "better" and a finite 0 scale would hide it
        better = (e < best_e) | (i == 0)
        best_s = tl.where(better, s, best_s)
        best_e = tl.where(better, e, best_e)
    q = tl.minimum(tl.maximum((tl.math.div_rn(wg, best_s[:, :, None]) + _MAGIC) - _MAGIC, -8.0), 7.0)
    nib = (tl.reshape(q, (ROWS, COLS)).to(tl.int32) + 8)           # [R, C] in [0, 15]
    nib3 = tl.reshape(nib, (ROWS, COLS // 8, 8))
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    words = tl.sum(nib3 << shifts, axis=2)                         # [R, C/8]; bits 28-31 wrap as int32
    wcols = pid_c * (COLS // 8) + tl.arange(0, COLS // 8)
    tl.store(q_ptr + rows[:, None] * (n_in // 8) + wcols[None, :], words,
             mask=(rows[:, None] < n_out) & (wcols[None, :] < n_in // 8))
    gcols = pid_c * (COLS // G) + tl.arange(0, COLS // G)
    tl.store(s_ptr + rows[:, None] * (n_in // G) + gcols[None, :], best_s.to(tl.bfloat16),
             mask=(rows[:, None] < n_out) & (gcols[None, :] < n_in // G))


_DIVS: dict[tuple, torch.Tensor] = {}


def rtn_pack_gpu(w: torch.Tensor, block_scale: torch.Tensor | None, group: int, clip: str = "mse"):
    """w [out, in] FP8/BF16/F32 on the GPU (block_scale [ceil(out/b), ceil(in/128)] f32 for FP8)
    -> (weight_packed int32 [out, in/8], weight_scale bf16 [out, in/group]) on the same device."""
    out_f, n_in = w.shape
    assert n_in % group == 0 and n_in % 8 == 0
    divs = (ABSMAX_DIVISOR,) if clip == "absmax" else MSE_DIVISORS
    key = (divs, w.device)
    if key not in _DIVS:
        _DIVS[key] = torch.tensor(divs, dtype=torch.float32, device=w.device)
    has_scale = block_scale is not None
    per_row_only = True
    if has_scale:
        bs = block_scale.to(torch.float32).reshape(block_scale.shape[0] if block_scale.dim() else 1, -1).contiguous()
        if bs.shape == (out_f, 1):          # per-channel (GLM-4.x)
            bsr = 1
        elif bs.numel() == 1:               # per-tensor
            bsr = max(out_f, 1)
        else:                               # 128x128 blocks: the tile sees one scale per row
            assert bs.shape[1] == -(-n_in // COLS), "block FP8 scales must be 128 wide along the input dim"
            per_row_only = False
            bsr = -(-out_f // bs.shape[0])
            bsr = 1 << (bsr - 1).bit_length() if bs.shape[0] > 1 else max(out_f, 1)
    else:
        bs, bsr = w, 1  # unused
    q = torch.empty(out_f, n_in // 8, dtype=torch.int32, device=w.device)
    s = torch.empty(out_f, n_in // group, dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(out_f, ROWS), triton.cdiv(n_in, COLS))
    _rtn_kernel[grid](w.contiguous(), bs, q, s, out_f, n_in, bs.shape[1] if has_scale else 1,
                      _DIVS[key], N_DIVS=len(divs), HAS_SCALE=has_scale, BLOCK_SCALE_ROWS=bsr, PER_ROW_ONLY=per_row_only,
                      G=group, ROWS=ROWS, COLS=COLS)
    return q, s
