"""Plain torch reference for the W4A16 ops: dequantize, then matmul in float32.

Same signatures as the Triton ops in `kq.kernels`; used by the tests and as the CPU fallback.
"""
from __future__ import annotations

import torch

from .lane_layout import dequantize_lane
from .layout import PrepackedLinear, PrepackedMoE, dequantize_prepacked


def w4a16_linear(x: torch.Tensor, w: PrepackedLinear) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype."""
    W = _dequantize(w.q.unsqueeze(0), w.s.unsqueeze(0), w.in_features, w.group, w.lane)[0]   # [N, K]
    return (x.float() @ W.t()).to(x.dtype)


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global expert ids -> local ids; -1 where the expert lives on another rank.

    A negative id in topk_ids (SGLang's dispatcher marks experts of other EP ranks with -1)
    stays -1, with or without a map."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids.clamp(min=-1)
    mapped = expert_map.to(ids.device).long()[ids.clamp(min=0)]
    return torch.where(ids < 0, -1, mapped)


def _dequantize(q: torch.Tensor, s: torch.Tensor, k: int, group: int, lane: bool) -> torch.Tensor:
    """[E, ...] prepacked tensors of either layout -> float32 [E, N, k]."""
    return (dequantize_lane if lane else dequantize_prepacked)(q, s, k, group)


def _expert_weight(q: torch.Tensor, s: torch.Tensor, e: int, k: int, pp: PrepackedMoE) -> torch.Tensor:
    """Expert e's matrix of a PrepackedMoE as float32 [N, k], from either layout (pp.lane)."""
    return _dequantize(q[e:e + 1], s[e:e + 1], k, pp.group, pp.lane)[0]


def fused_moe_w4a16(x: torch.Tensor, pp: PrepackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    *, expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """out[t] = rsf * sum_j w[t,j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = local id of topk_ids[t,j].

    x [T, H]; topk_weights [T, k]; topk_ids [T, k] (global ids; `expert_map` [E_global] maps them to
    local ids, -1 = not on this rank, contributing nothing; an id of -1 in topk_ids itself means
    the same). Returns [T, H] in x.dtype.
    """
    T, H = x.shape
    I = pp.intermediate
    ids = local_expert_ids(topk_ids, expert_map)
    xf = x.float()
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        t_idx, j_idx = torch.nonzero(ids == e, as_tuple=True)
        w13 = _expert_weight(pp.w13_q, pp.w13_s, e, H, pp)                                # [2I, H]
        w2 = _expert_weight(pp.w2_q, pp.w2_s, e, I, pp)                                    # [H, I]
        gu = xf[t_idx] @ w13.t()                                                           # [n, 2I]
        act = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        y = act @ w2.t()                                                                   # [n, H]
        out.index_add_(0, t_idx, y * topk_weights[t_idx, j_idx].float().unsqueeze(1))
    return (out * routed_scaling_factor).to(x.dtype)
