"""One decode MoE step of kq's kernels for Nsight Compute: run under ncu on the lent H200.

    ncu --clock-control none -k regex:w4a16_gemm_kernel --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats python3 benchmarks/ncu_moe.py --variants old,base

Each variant (names from bench_kernels.VARIANTS) runs gate+up then down once on the same routing
(GLM-5.2 experts, 16 tokens x top-8, group 128 unless told otherwise), after a warm-up call that
compiles it, so the profiled launches come in the order: variant 1 gate+up, down, variant 2 ...
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_kernels import MOE_SHAPES, random_moe, variant  # noqa: E402

from kq.kernels import triton_ops as kops  # noqa: E402
from kq.kernels.layout import tile_moe  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="glm52", choices=sorted(MOE_SHAPES))
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--variants", default="old,base")
    args = ap.parse_args()
    e, h, i = MOE_SHAPES[args.case]
    torch.manual_seed(0)
    pp = random_moe(e, h, i, args.group)
    x = torch.randn(args.tokens, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device="cuda")[:8] for _ in range(args.tokens)]).to(torch.int32)
    cfg1, cfg2 = kops.moe_configs(args.tokens * 8, e, h, i, kops._num_sms(x.device), args.group)
    for v in args.variants.split(","):
        (c1, tiled), (c2, _) = variant(cfg1, v), variant(cfg2, v)
        w = tile_moe(pp) if tiled else pp
        r1 = kops.moe_align(ids, e, c1.block_m)
        r2 = kops.moe_align(ids, e, c2.block_m)
        for _ in range(2):                       # the first call compiles (and is profiled too)
            act = kops.moe_gate_up(x, w, r1, 8, c1)
            kops.moe_down(act, w, r2, c2)
        torch.cuda.synchronize()
        print(f"variant {v}: gate+up {c1}, down {c2}, tiled {tiled}", flush=True)
        del w


if __name__ == "__main__":
    main()
