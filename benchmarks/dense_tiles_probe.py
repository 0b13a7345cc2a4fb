"""Triton tile configs for the dense W4A16 linear at 32-64 rows, where kq's default (tiles layout) ran
0.88-0.94x cuBLAS BF16 on 12288x6144 (issue #3: no slower than BF16 up to M = 64). One process on the
lent H200: cuBLAS BF16 first, then kq's default config, then each candidate, every one timed like
bench_kernels (CUDA graph over copies of the weights, median of 15).

    python3 benchmarks/dense_tiles_probe.py [--m 32,64] [--nk 12288x6144]

Candidates: more stages; 2-warp programs with BLOCK_M 64 (Triton keeps mma.sync below a warpgroup, so the
inline-PTX dequantisation serves: triton_ops._launch_gemm); narrower and wider tiles. One JSON row each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_kernels import DEV, graph_us, hbm_copies, random_linears  # noqa: E402

from kq.kernels import triton_ops as kops  # noqa: E402

T = kops.TileConfig
CANDIDATES = [T(32, 128, 2, 4, 4), T(32, 128, 2, 4, 5), T(32, 128, 2, 8, 3), T(32, 128, 4, 4, 3),
              T(32, 128, 1, 4, 3), T(32, 64, 2, 4, 3), T(32, 64, 4, 4, 4), T(32, 256, 2, 8, 3),
              T(64, 128, 2, 2, 3), T(64, 128, 1, 2, 3), T(64, 64, 2, 2, 3), T(64, 64, 4, 2, 3),
              T(64, 64, 2, 2, 4), T(16, 128, 2, 4, 3), T(16, 128, 4, 4, 4), T(64, 128, 4, 2, 3)]
# with DISABLE_MMA_V3=1 (Triton's mma.sync at 64 rows on 4 and 8 warps)
if os.environ.get("DISABLE_MMA_V3") == "1":
    CANDIDATES = [T(64, 128, 2, 4, 3), T(64, 128, 4, 4, 3), T(64, 64, 2, 4, 3), T(64, 64, 4, 4, 3),
                  T(64, 128, 2, 8, 3), T(64, 256, 2, 8, 3), T(64, 128, 2, 4, 4), T(64, 64, 4, 4, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="32,64")
    ap.add_argument("--nk", default="12288x6144")
    args = ap.parse_args()
    n, k = (int(v) for v in args.nk.split("x"))
    group = 128
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wb = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(hbm_copies(n * k * 2))]
    ws, _ = random_linears(n, k, group)
    for m in (int(v) for v in args.m.split(",")):
        a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        base = {"case": f"dense_{n}x{k}", "M": m}
        us = graph_us([lambda w=w: a @ w.t() for w in wb])
        print(json.dumps({**base, "kind": "cublas_bf16", "us": round(us, 2)}), flush=True)
        ref = None
        default = kops.dense_config(m, n, k, sms)
        for cfg in [default] + [c for c in CANDIDATES if c != default]:
            try:
                y = kops.w4a16_linear(a, ws[0], config=cfg)
                if ref is None:
                    ref = y.float()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                us = graph_us([lambda w=w, c=cfg: kops.w4a16_linear(a, w, config=c) for w in ws])
            except Exception as ex:     # a config Triton cannot build (resources): a row that says so
                print(json.dumps({**base, "cfg": cfg.__dict__, "error": repr(ex)[:200]}), flush=True)
                continue
            print(json.dumps({**base, "kind": "kq_default" if cfg == default else "kq_tiles", "cfg": cfg.__dict__,
                              "us": round(us, 2), "rel_to_default": round(err, 5)}), flush=True)


if __name__ == "__main__":
    main()
