"""Experimental CUDA fused MoE for decode (branch cuda-decode-wip): kq/kernels/cuda/w4a16_moe_lanes.cu
built with torch's extension loader on first use, the weights in the lane layout (lane_layout.py).

Not validated on a GPU yet: tests/test_kernels_lanes_gpu.py checks it against the torch reference,
`benchmarks/bench_kernels.py --lanes` times it beside the Triton kernel. Routing blocks hold at most
8 pairs (the kernel's mma takes 8 activation rows)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .lane_layout import lane_pack

_CU = Path(__file__).with_name("cuda") / "w4a16_moe_lanes.cu"
_BINDING = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
extern "C" int kq_moe_lanes_launch(const void* a, const void* q, const void* s, void* out, const int* pairs,
                                   const int* blk_expert, const int* blk_start, const int* blk_count, int n_blocks,
                                   int lda, int ldo, int K, int kb_total, int groups, int n_tiles, int n_tiles_all,
                                   int up_tiles, int a_row_div, int gated, int group, int nt, void* stream);
int64_t launch(torch::Tensor a, torch::Tensor q, torch::Tensor s, torch::Tensor out, torch::Tensor pairs,
               torch::Tensor be, torch::Tensor bs, torch::Tensor bc, int64_t K, int64_t n_tiles,
               int64_t n_tiles_all, int64_t up_tiles, int64_t a_row_div, int64_t gated, int64_t group, int64_t nt) {
  const int kb_total = q.size(2);
  const int groups = s.size(3);   // scales [E, tiles, 8, G]
  return kq_moe_lanes_launch(a.data_ptr(), q.data_ptr(), s.data_ptr(), out.data_ptr(), pairs.data_ptr<int>(),
                             be.data_ptr<int>(), bs.data_ptr<int>(), bc.data_ptr<int>(), be.numel(),
                             a.stride(0), out.stride(0), K, kb_total, groups, n_tiles, n_tiles_all, up_tiles,
                             a_row_div, gated, group, nt, at::cuda::getCurrentCUDAStream().stream());
}
"""


@functools.cache
def _ext():
    from torch.utils.cpp_extension import load_inline
    return load_inline(name="kq_moe_lanes", cpp_sources=[_BINDING], cuda_sources=[_CU.read_text()],
                       functions=["launch"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"],
                       verbose=False)


@dataclass(frozen=True)
class LaneMoE:
    """A layer's routed experts in the lane layout: w13 = [gate; up] ([E, 2I/8, KB_H, 8, 4, 4] words,
    [E, 2I/8, 8, G_H] scales), w2 = down ([E, H/8, KB_I, 8, 4, 4], [E, H/8, 8, G_I])."""
    w13_q: torch.Tensor
    w13_s: torch.Tensor
    w2_q: torch.Tensor
    w2_s: torch.Tensor
    num_experts: int
    hidden: int
    intermediate: int
    group: int


def lane_moe(w13_packed, w13_scale, w2_packed, w2_scale, group: int) -> LaneMoE:
    """From the checkpoint layout (compressed-tensors weight_packed / weight_scale), like prepack_moe."""
    E, two_i, h8 = w13_packed.shape
    I, H = two_i // 2, h8 * 8
    if I % 16 or H % 16:
        raise ValueError(f"lane_moe: I {I} and H {H} must be multiples of 16")
    q13, s13 = lane_pack(w13_packed, w13_scale, group)
    q2, s2 = lane_pack(w2_packed, w2_scale, group)
    return LaneMoE(q13, s13, q2, s2, num_experts=E, hidden=H, intermediate=I, group=group)


def _run(a, q, s, out, routing, K, n_tiles, n_tiles_all, up_tiles, a_row_div, gated, group, nt):
    pairs, be, bs, bc = routing
    rc = _ext().launch(a, q, s, out, pairs, be, bs, bc, K, n_tiles, n_tiles_all, up_tiles, a_row_div,
                       int(gated), group, nt)
    if rc != 0:
        raise RuntimeError(f"kq_moe_lanes_launch failed ({rc})")


def moe_gate_up(x, lm: LaneMoE, routing, top_k: int) -> torch.Tensor:
    act = torch.empty(routing[0].numel(), lm.intermediate, dtype=x.dtype, device=x.device)
    t = lm.intermediate // 8
    _run(x, lm.w13_q, lm.w13_s, act, routing, lm.hidden, t, 2 * t, t, top_k, True, lm.group, 1)
    return act


def moe_down(act, lm: LaneMoE, routing) -> torch.Tensor:
    y = torch.empty(act.shape[0], lm.hidden, dtype=act.dtype, device=act.device)
    t = lm.hidden // 8
    _run(act, lm.w2_q, lm.w2_s, y, routing, lm.intermediate, t, t, 0, 1, False, lm.group, 2)
    return y


def fused_moe_lanes(x: torch.Tensor, lm: LaneMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """x [T, H] bf16 -> [T, H] bf16; the maths of kq.kernels.reference.fused_moe_w4a16 (no expert map yet)."""
    import triton

    from .moe_combine import combine_topk_kernel
    from .triton_ops import moe_align
    t, h = x.shape
    k = topk_ids.shape[1]
    x = x.contiguous()
    routing = moe_align(topk_ids, lm.num_experts, 8)
    y = moe_down(moe_gate_up(x, lm, routing, k), lm, routing)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    ids = topk_ids.to(torch.int32).contiguous()
    combine_topk_kernel[(t, triton.cdiv(h, 512))](y, ids, ids, topk_weights.contiguous(), out, h,
                                                  float(routed_scaling_factor), TOPK=k, HAS_MAP=False, BLOCK=512)
    return out
