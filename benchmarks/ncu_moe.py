"""One decode MoE step of kq's kernels for Nsight Compute: run under ncu on the lent H200.

    ncu --clock-control none -k regex:w4a16_gemm_kernel --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats python3 benchmarks/ncu_moe.py --variants old,base

Each variant (names from bench_kernels.VARIANTS) runs gate+up then down once on the same routing
(GLM-5.2 experts, 16 tokens x top-8, group 128 unless told otherwise), after a warm-up call that
compiles it, so the profiled launches come in the order: variant 1 gate+up, down, variant 2 ...
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_kernels import MOE_SHAPES, VARIANTS, random_lane_moe, random_moe, sgl_align, sgl_invoke, sgl_moe_operands  # noqa: E402

from kq.kernels import triton_ops as kops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="glm52", choices=sorted(MOE_SHAPES))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--variants", default="old,base")
    ap.add_argument("--sgl-fp8", action="store_true",
                    help="then SGLang's FP8 block-128 MoE kernel (gate+up, its best tile BM16 BN64 BK128, "
                         "3 stages) on the same routing: profile with -k regex:fused_moe_kernel")
    ap.add_argument("--lanes", default="", help="then the CUDA lane kernel's gate+up and down for these "
                    "KSPLITxSTAGES variants, e.g. 1x4,1x6 (profile with -k regex:moe_lanes_kernel)")
    args = ap.parse_args()
    e, h, i = MOE_SHAPES[args.case]
    torch.manual_seed(0)
    pp = random_moe(e, h, i, args.group)
    x = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(args.tokens)]).to(torch.int32)
    cfg1, cfg2 = kops.moe_configs(args.tokens * 8, e, h, i, kops._num_sms(x.device), args.group)
    for v in args.variants.split(","):
        c1, c2 = (dataclasses.replace(c, **VARIANTS[v]) for c in (cfg1, cfg2))
        r1 = kops.moe_align(ids, e, c1.block_m)
        r2 = kops.moe_align(ids, e, c2.block_m)
        for _ in range(2):                       # the first call compiles (and is profiled too)
            act = kops.moe_gate_up(x, pp, r1, 8, c1)
            kops.moe_down(act, pp, r2, c2)
        torch.cuda.synchronize()
        print(f"variant {v}: gate+up {c1}, down {c2}", flush=True)
    if args.lanes:
        lanes_steps(x, ids, e, h, i, args.group, args.lanes)
    if args.sgl_fp8:
        sgl_fp8_gate_up(x, ids, e, 2 * i, h)


def lanes_steps(x, ids, e, h, i, group, variants) -> None:
    """The CUDA lane kernel's two stages for each KSPLITxSTAGES variant, twice (the first builds)."""
    from kq.kernels import cuda_lanes
    lm = random_lane_moe(e, h, i, group)
    rt = kops.moe_align(ids, e, 8)
    for v in variants.split(","):
        ks, st = (int(n) for n in v.split("x"))
        for _ in range(2):
            act = cuda_lanes.moe_gate_up(x, lm, rt, 8, (1, ks, st, True))
            cuda_lanes.moe_down(act, lm, rt, (2, ks, st, True))
        torch.cuda.synchronize()
        print(f"lanes {v}: gate+up, down", flush=True)


def sgl_fp8_gate_up(x, ids, e, n, k) -> None:
    """SGLang's FP8 gate+up on the routing kq's steps used, its best decode tile, twice (the first compiles)."""
    aq, a_s, b, bs, _ = sgl_moe_operands("fp8", e, n, k, x, 128)
    c = torch.empty(x.shape[0], ids.shape[1], n, device="cuda", dtype=torch.bfloat16)
    al = sgl_align(ids, 16, e)
    tw = torch.rand(ids.shape, device="cuda")
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
           "num_warps": 4, "num_stages": 3}
    for _ in range(2):
        sgl_invoke("fp8", aq, a_s, b, bs, c, tw, ids, al, cfg, 128)
    torch.cuda.synchronize()
    print(f"sglang fp8 gate+up {cfg}", flush=True)


if __name__ == "__main__":
    main()
