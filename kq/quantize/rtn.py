"""Round-to-nearest symmetric group-wise INT4, with per-group clipping search.

w [out, in] float32 -> q int8 [out, in] in [-8, 7], scale bf16 [out, in/group].
The scale is rounded to bf16 *before* the codes are chosen, so what the kernels
dequantize (q * bf16 scale) is exactly what the search scored.

clip="absmax": scale = amax / 7.5 (compressed-tensors' own symmetric convention:
  half the int4 range 15/2), the usual naive RTN.
clip="mse":    per group, try scales amax / d for a grid of d and keep the one with the
  least squared error; d = 7 (no clipping at all) and d = 7.5 (absmax) are in the grid,
  so it is never worse than absmax on the weight error.
"""
from __future__ import annotations

import torch

ABSMAX_DIVISOR = 7.5
# 7 (nothing clipped) .. 14 (half the range clipped); finer near the usual optimum.
MSE_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5, 8.75, 9.0, 9.25, 9.5, 9.75,
                10.0, 10.5, 11.0, 11.5, 12.0, 13.0, 14.0)
_TINY = 1e-30  # an all-zero group keeps a non-zero scale (codes are all 0 anyway)


def _codes(wg: torch.Tensor, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.div(wg, s, out=out)
    return out.round_().clamp_(-8, 7)


def group_scale(wg: torch.Tensor, clip: str = "mse") -> torch.Tensor:
    """wg [..., g] float32 -> the chosen bf16-representable scale per group, float32 [..., 1].
    Shared by RTN (below) and GPTQ (which picks each group's scale as its solver reaches it)."""
    if clip not in ("absmax", "mse"):
        raise ValueError(f"unknown clip {clip!r}")
    amax = wg.abs().amax(-1, keepdim=True).clamp(min=_TINY)                   # [..., 1]
    if clip == "absmax":
        return (amax / ABSMAX_DIVISOR).to(torch.bfloat16).to(torch.float32)
    buf = torch.empty_like(wg)  # in-place ops: fresh temporaries cost more than the math on CPU
    return search_divisors(amax, lambda s: _codes(wg, s, buf).mul_(s).sub_(wg).square_().sum(-1, keepdim=True))


def search_divisors(amax: torch.Tensor, error) -> torch.Tensor:
    """Per group, the bf16-rounded scale amax / d (d in MSE_DIVISORS) with the least error(s), the
    first on ties; error(s) -> a tensor shaped like amax. RTN's squared weight error above, AWQ's
    activation-weighted one (kq.quantize.awq)."""
    best_s = best_err = None
    for d in MSE_DIVISORS:
        s = (amax / d).to(torch.bfloat16).to(torch.float32)
        err = error(s)
        if best_s is None:
            best_s, best_err = s, err
        else:
            better = err < best_err
            best_s = torch.where(better, s, best_s)
            best_err = torch.minimum(err, best_err)
    return best_s


def quantize_rtn(w: torch.Tensor, group: int, clip: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    out, n_in = w.shape
    assert n_in % group == 0, "input dim must be a multiple of the group size"
    wg = w.to(torch.float32).reshape(out, n_in // group, group)               # [out, G, g]
    s = group_scale(wg, clip)                                                 # [out, G, 1]
    q = _codes(wg, s).to(torch.int8).reshape(out, n_in)
    return q, s.squeeze(-1).to(torch.bfloat16)
