"""swap_kernel (weights as wgmma's A operand) against cuBLAS and kq's mma.sync tiles, dense W4A16 at
16-256 rows (issue #3: no slower than cuBLAS BF16 up to M = 64). One process on the lent H200: cuBLAS
BF16 and FP8, kq's default config, the mma.sync tile config the default replaced (dense_config before
swap_kernel), then every swap candidate, each timed like bench_kernels (CUDA graph over copies of
the weights, median of 15). Every kq row carries its error against the float32 reference.

    python3 benchmarks/dense_swap_probe.py [--nk '12288x6144:16,32,64,128;4096x7168:32,64'] [--group 128]

A first JSON row with the date, GPU and versions, then one per (shape, M, kernel); a summary table at
the end (best swap candidate per M). The candidates: the first probe's set by default, SWAP_MORE=1 the
second's, SWAP_SET=stages the one that compared 2 and 3 pipeline stages (results/kernels.md, ninth
session, calls 1, 2 and 7).
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
from bench_kernels import DEV, graph_us, hbm_copies, random_linears, run_env  # noqa: E402

from kq.kernels import reference  # noqa: E402
from kq.kernels import triton_ops as kops  # noqa: E402

T = kops.TileConfig


def candidates(m: int) -> list:
    """(block_m = activation rows, block_n = weight rows, split, warps, stages), swap=True."""
    fit = max(16, 1 << (m - 1).bit_length())
    bms = [fit] if m <= 64 else [64, min(fit, 128)]
    shapes = [(64, 1, 4, 3), (64, 2, 4, 3), (64, 4, 4, 3), (128, 1, 4, 3), (128, 2, 4, 3), (128, 4, 4, 3),
              (128, 2, 4, 4), (128, 1, 8, 3), (128, 2, 8, 3), (128, 4, 8, 3), (256, 1, 8, 3), (256, 2, 8, 3)]
    if os.environ.get("SWAP_SET") == "stages":     # call 7 (ninth session): 2 stages, 3 programs per SM
        shapes = [(128, 4, 8, 3), (128, 4, 8, 2), (128, 2, 8, 2), (128, 8, 8, 2), (128, 8, 8, 3), (128, 1, 8, 2)]
    if os.environ.get("SWAP_MORE") == "1":     # call 2: around call 1's best (128, 4, 8, 3)
        shapes = [(128, 4, 8, 3), (128, 8, 8, 3), (128, 4, 8, 2), (128, 8, 8, 2), (128, 4, 8, 4), (128, 3, 8, 3),
                  (256, 2, 16, 3), (256, 4, 16, 3), (256, 8, 16, 3), (64, 8, 4, 3), (64, 4, 4, 2)]
    return [T(bm, bn, split, warps, stages, swap=True) for bm in bms for bn, split, warps, stages in shapes]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nk", default="12288x6144:16,32,64,128;4096x7168:32,64")
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    print(json.dumps(run_env()), flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    summary = []
    for case in args.nk.split(";"):
        nk, ms = case.split(":")
        n, k = (int(v) for v in nk.split("x"))
        kb = -(-k // 128)
        wb = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(hbm_copies(n * k * 2))]
        w8 = [w.to(torch.float8_e4m3fn) for w in wb]
        one = torch.tensor(1.0, device=DEV)
        ws, _ = random_linears(n, k, args.group)
        for m in (int(v) for v in ms.split(",")):
            a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            base = {"case": f"dense_{n}x{k}", "M": m, "group": args.group}
            row = {"shape": f"{n}x{k}", "M": m}
            row["bf16"] = graph_us([lambda w=w: a @ w.t() for w in wb])
            a8 = a.to(torch.float8_e4m3fn)
            row["fp8"] = graph_us([lambda w=w: torch._scaled_mm(a8, w.t(), scale_a=one, scale_b=one,
                                                                out_dtype=torch.bfloat16) for w in w8])
            for kind in ("bf16", "fp8"):
                print(json.dumps({**base, "kind": f"cublas_{kind}", "us": round(row[kind], 2)}), flush=True)
            want = reference.w4a16_linear(a, ws[0]).float()
            default = (kops.dense_config(m, n, k, sms, swap=kops.swap_serves(a.device, ws[0]))
                       if m < kops.DEQUANT_GEMM_MIN_M else None)
            mma_sync = kops.dense_config(m, n, k, sms, swap=False)
            runs = [("kq_default", default), ("kq_mma_sync", mma_sync)]
            runs += [("kq_swap", c) for c in candidates(m) if c != default and kb % c.split_k == 0]
            best = None
            for kind, cfg in runs:
                try:
                    got = kops.w4a16_linear(a, ws[0], config=cfg)
                    err = ((got.float() - want).norm() / want.norm()).item()
                    us = graph_us([lambda w=w, c=cfg: kops.w4a16_linear(a, w, config=c) for w in ws])
                except Exception as ex:     # a config Triton cannot build (resources): a row that says so
                    print(json.dumps({**base, "kind": kind, "cfg": cfg and cfg.__dict__, "error": repr(ex)[:200]}),
                          flush=True)
                    continue
                print(json.dumps({**base, "kind": kind, "cfg": cfg and cfg.__dict__, "us": round(us, 2),
                                  "rel_err": round(err, 6)}), flush=True)
                if kind != "kq_swap":
                    row[kind] = us
                elif err < 8e-3 and (best is None or us < best[0]):
                    best = (us, cfg)
            if best:
                row["swap"], row["swap_cfg"] = best[0], best[1]
            summary.append(row)
        del wb, w8, ws
        torch.cuda.empty_cache()
    print("\n| shape | M | BF16 us | FP8 us | kq default us (x BF16) | mma.sync tiles us (x BF16) | best swap us (x BF16) | best swap (bm, bn, split, warps, stages) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in summary:
        def cell(key):
            return f"{r[key]:.1f} ({r['bf16'] / r[key]:.2f}x)" if key in r else "-"
        c = r.get("swap_cfg")
        cfg = f"{c.block_m}, {c.block_n}, {c.split_k}, {c.num_warps}, {c.num_stages}" if c else "-"
        print(f"| {r['shape']} | {r['M']} | {r['bf16']:.1f} | {r['fp8']:.1f} | {cell('kq_default')} | "
              f"{cell('kq_mma_sync')} | {cell('swap')} | {cfg} |")


if __name__ == "__main__":
    main()
