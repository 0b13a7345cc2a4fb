"""The CUDA lane kernel's picked instances on the decode cases that miss #3's targets, for Nsight
Compute: run under ncu on the lent H200.

    ncu --clock-control none -k regex:moe_lanes_kernel --launch-skip-before-match 0 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section WarpStateStats --section LaunchStats python3 benchmarks/ncu_lanes.py

Each case runs twice (the first call builds the extension and is profiled too); the launches come in
the order printed on stdout. Cases: GLM-5.2 16 tokens group 128 (meets its targets: the reference
profile), Kimi K2's TP-8 slice at 16 tokens, groups 128 and 32, GLM-5.2 16 tokens group 32 (gate+up
only), then the dense 12288x6144 linear at M = 1 and 8 (lane layout, cuda_lanes.pick_dense).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_kernels import DEV, MOE_SHAPES, random_lane_linear, random_lane_moe, routings  # noqa: E402

from kq.kernels import cuda_lanes  # noqa: E402
from kq.kernels import triton_ops as kops  # noqa: E402
from kq.kernels.layout import PACK_K  # noqa: E402

MOE_CASES = [("glm52", 16, 128), ("kimi_tp8", 16, 128), ("kimi_tp8", 16, 32), ("glm52", 16, 32)]
DENSE = (12288, 6144, (1, 8))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="", help="only these, e.g. kimi_tp8:16:128,dense:1 (default: all)")
    only = set(ap.parse_args().cases.split(",")) - {""}
    torch.manual_seed(0)
    for name, m, group in MOE_CASES:
        if only and f"{name}:{m}:{group}" not in only:
            continue
        e, h, i = MOE_SHAPES[name]
        lm = random_lane_moe(e, h, i, group)
        ids = routings(e, m, 8, 1)[0]
        x = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
        rt = kops.moe_align(ids, e, 8)
        v = cuda_lanes.pick_stage(rt[0].numel(), e, h, i, True, group)
        for _ in range(2):
            cuda_lanes.moe_gate_up(x, lm, rt, 8)
        torch.cuda.synchronize()
        print(f"{name} {m} tokens g{group}: gate+up {cuda_lanes.variant_name(v)} x2", flush=True)
        del lm
        torch.cuda.empty_cache()
    n, k, ms = DENSE
    kb = k // PACK_K
    w = random_lane_linear(n, k, 128)
    for m in ms:
        if only and f"dense:{m}" not in only:
            continue
        a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        for _ in range(2):
            cuda_lanes.linear(a, w)
        torch.cuda.synchronize()
        print(f"dense {n}x{k} M={m}: {cuda_lanes.dense_variant_name(cuda_lanes.pick_dense(m, n // 8, kb))} x2", flush=True)


if __name__ == "__main__":
    main()
