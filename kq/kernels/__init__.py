"""W4A16 kernels: INT4 weights (symmetric, group 32/64/128, bf16 scales) x bf16 activations.

Public API (CUDA tensors run the Triton kernels, and on Hopper lane-layout weights the CUDA kernel of
cuda_lanes.py: a MoE at every size, a linear up to 64 rows; anything else the torch reference):
    prepack_linear(weight_packed [N, K/8] int32, weight_scale [N, K/g], group, lane=False) -> PrepackedLinear
                (lane=True: the lane layout, which the CUDA kernel reads for up to 64 rows on Hopper)
    prepack_moe(w13_packed [E, 2I, H/8], w13_scale [E, 2I, H/g], w2_packed [E, H, I/8],
                w2_scale [E, H, I/g], group, lane=False) -> PrepackedMoE
                (lane=True: the CUDA lane kernel's layout, which the Triton MoE path also reads)
    w4a16_linear(x [..., K] bf16, w: PrepackedLinear) -> [..., N]
    fused_moe_w4a16(x [T, H] bf16, pp: PrepackedMoE, topk_weights [T, k] f32, topk_ids [T, k] int32,
                    *, expert_map=None, routed_scaling_factor=1.0) -> [T, H]
The same two ops, in plain torch, are in kq.kernels.reference.
"""
from __future__ import annotations

import importlib
import os

import torch

from . import reference
from .layout import PrepackedLinear, PrepackedMoE, lane_fits, prepack_linear, prepack_moe

__all__ = ["PrepackedLinear", "PrepackedMoE", "prepack_linear", "prepack_moe", "w4a16_linear",
           "fused_moe_w4a16", "reference", "triton_available", "lanes_available", "moe_lane_layout"]


def triton_available() -> bool:
    try:
        importlib.import_module("triton")     # a real import: an installed but broken triton counts as absent
    except ImportError:
        return False
    return True


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


def lanes_available(device: torch.device) -> bool:
    """Whether the CUDA lane-layout kernel (cuda_lanes.py: Hopper only, built on first use) serves
    `device`; a lane-layout PrepackedMoE still runs everywhere else, through Triton or the reference."""
    from .cuda_lanes import available
    return available(device)


MOE_LAYOUTS = ("auto", "lane", "tiles")


def moe_lane_layout(device: torch.device, hidden: int, intermediate: int) -> bool:
    """Whether a loader should prepack a MoE layer with lane=True. KQ_MOE_LAYOUT=auto (default): the
    lane layout where the CUDA lane kernel runs (Hopper) and the shape fits it; lane / tiles force
    one (lane also runs elsewhere, through Triton's LANE mode). A layer holds one layout only: the
    experts are the bulk of a MoE model's memory."""
    choice = os.environ.get("KQ_MOE_LAYOUT", "auto")
    if choice not in MOE_LAYOUTS:
        raise ValueError(f"KQ_MOE_LAYOUT={choice!r}: expected one of {', '.join(MOE_LAYOUTS)}")
    fits = lane_fits(hidden, intermediate)
    if choice == "lane" and not fits:
        raise ValueError(f"KQ_MOE_LAYOUT=lane: hidden {hidden} and intermediate {intermediate} per rank must "
                         f"be multiples of 16 for the lane layout")
    if choice == "auto":
        return fits and lanes_available(device)
    return choice == "lane"


def _lanes_for(x: torch.Tensor, pp: PrepackedMoE, pairs: int) -> bool:
    """A lane-layout layer runs the CUDA kernel at every size where it builds (Hopper) and its grid
    holds the routing's 8-pair blocks: past decode sizes it still beats Triton's LANE mode 2.4-3x
    (H200, GLM-5.2 4096 tokens gate+up 11.4 against 31.0 ms; benchmarks/moe_prefill_probe.py)."""
    from .cuda_lanes import MAX_BLOCKS, available
    from .moe_routing import max_blocks
    return available(x.device) and max_blocks(pairs, pp.num_experts, 8) <= MAX_BLOCKS


# A lane-layout linear runs the CUDA kernel (cuda_lanes.linear) up to this many rows on Hopper, and
# dequantise + cuBLAS above (triton_ops.LANE_DEQUANT_MIN_M); from 16 rows the tiles layout is faster
# (H200, 12288x6144: 27.6 against 22.6 us at 16 rows)
LANE_LINEAR_MAX_ROWS = 64


def w4a16_linear(x: torch.Tensor, w: PrepackedLinear) -> torch.Tensor:
    """y = x @ W^T with W the int4 weight of `w`."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"w4a16_linear: x has {x.shape[-1]} input features, the weight {w.in_features}")
    if _use_triton(x):
        rows = x.numel() // x.shape[-1]
        if w.lane and rows <= LANE_LINEAR_MAX_ROWS and lanes_available(x.device):
            from .cuda_lanes import linear
            return linear(x.reshape(rows, -1).contiguous(), w).reshape(*x.shape[:-1], w.out_features)
        from .triton_ops import w4a16_linear as fast
        return fast(x, w)
    return reference.w4a16_linear(x, w)


def fused_moe_w4a16(x: torch.Tensor, pp: PrepackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    *, expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """Routed-expert MoE: gate+up -> SiLU*mul -> down, weighted by topk_weights, summed over top-k."""
    if x.dim() != 2 or x.shape[1] != pp.hidden:
        raise ValueError(f"fused_moe_w4a16: x must be [T, {pp.hidden}], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe_w4a16: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, k]")
    if _use_triton(x):
        if pp.lane and _lanes_for(x, pp, topk_ids.numel()):
            from .cuda_lanes import fused_moe_lanes
            return fused_moe_lanes(x, pp, topk_weights, topk_ids, expert_map=expert_map,
                                   routed_scaling_factor=routed_scaling_factor)
        from .triton_ops import fused_moe_w4a16 as fast
        return fast(x, pp, topk_weights, topk_ids, expert_map=expert_map,
                    routed_scaling_factor=routed_scaling_factor)
    return reference.fused_moe_w4a16(x, pp, topk_weights, topk_ids, expert_map=expert_map,
                                     routed_scaling_factor=routed_scaling_factor)
