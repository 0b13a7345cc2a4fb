"""Where kq's MoE stands at prefill sizes, and what a faster path could reach (one H200).

    python benchmarks/moe_prefill_probe.py [--tokens 4096] [--shape glm52] [--out DIR]

The gate+up stage at T tokens x top-8 (group 128), CUDA-graph replay over 2 routings:
  - kq's Triton MoE kernel (tiles layout) on a grid of tile configs (BLOCK_M 32 takes the mma.sync
    path with the inline-PTX dequantisation, 64 and 128 Triton's wgmma path with plain bf16 ops);
  - "dequantise + grouped GEMM": every expert dequantised to bf16 by kq's dequant kernel (one launch
    for all experts), the routed rows gathered in expert order, torch._grouped_mm; each part timed
    alone and together (what a prefill path built that way would cost, memory aside: the bf16 copy of
    a layer's experts is 4x their int4 bytes);
  - SGLang's Triton fused-MoE in BF16 and FP8 block-128, and INT4 w4a16 (BLOCK_M 64), the peers.
Prints one JSON row per measurement and a short table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402

from kq.kernels import triton_ops as kops  # noqa: E402
from kq.kernels.gemm_kernel import dequant_kernel  # noqa: E402
from kq.kernels.layout import PACK_K  # noqa: E402

DEV = "cuda"


def tiles_grid():
    for bm, bn, warps, stages in [(32, 64, 4, 3), (32, 128, 4, 3), (32, 128, 8, 3), (64, 64, 4, 3), (64, 64, 8, 3),
                                  (64, 128, 4, 3), (64, 128, 8, 3), (64, 128, 8, 4), (128, 64, 8, 3),
                                  (128, 128, 8, 3), (128, 128, 8, 2), (64, 256, 8, 3)]:
        yield kops.TileConfig(bm, bn, 1, warps, stages)


def dequant_all(pp, n: int, k: int) -> torch.Tensor:
    """Every expert's W^T as bf16 [E, K, N] (torch._grouped_mm's B operand), one launch: the
    experts' prepacked [Kp/8, N] words stacked along K (K a multiple of 128, so no padding)."""
    e = pp.num_experts
    q = pp.w13_q.reshape(e * k // 8, n)
    s = pp.w13_s.reshape(e * k // pp.group, n)
    wt = torch.empty(e * k, n, dtype=torch.bfloat16, device=DEV)
    dequant_kernel[(-(-n // 128), e * k // PACK_K)](q, q.stride(0), s, s.stride(0), wt, wt.stride(0), n, e * k,
                                                    GROUP=pp.group, BLOCK_N=128)
    return wt.view(e, k, n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--shape", default="glm52")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()
    e, h, i = bk.MOE_SHAPES[args.shape]
    m, topk, group, n = args.tokens, 8, 128, 2 * i
    base = {"case": args.shape, "M": m, "topk": topk, "group": group}
    torch.manual_seed(0)
    tis = bk.routings(e, m, topk, 2)
    tw = torch.rand(m, topk, device=DEV)
    a = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
    flops = 2 * m * topk * n * h
    rows = []

    def log(kind, us, **extra):
        row = {**base, "kind": kind, "us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1), **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)

    pp = bk.random_moe(e, h, i, group)
    for cfg in tiles_grid():
        try:
            rts = [kops.moe_align(t, e, cfg.block_m) for t in tis]
            us = bk.graph_us([lambda rt=rt, cfg=cfg: kops.moe_gate_up(a, pp, rt, topk, cfg) for rt in rts], reps=3)
            log("kq_tiles", us, cfg=cfg.__dict__)
        except Exception as ex:
            print(json.dumps({**base, "kind": "kq_tiles", "cfg": cfg.__dict__, "error": repr(ex)[:200]}), flush=True)
    try:
        wt = dequant_all(pp, n, h)
        us = bk.graph_us([lambda: dequant_all(pp, n, h)], reps=3)
        log("dequant_all_experts", us, GB_written=round(wt.numel() * 2 / 1e9, 2))
        sort = []
        for t in tis:
            flat = t.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
            sort.append((order, offs))
        us = bk.graph_us([lambda o=o: a[o // topk] for o, _ in sort], reps=3)
        log("gather_rows", us)
        xs = [a[o // topk] for o, _ in sort]
        us = bk.graph_us([lambda x=x, f=f: torch._grouped_mm(x, wt, offs=f) for x, (_, f) in zip(xs, sort)], reps=3)
        log("grouped_mm_bf16", us)
        us = bk.graph_us([lambda o=o, f=f: torch._grouped_mm(a[o // topk], dequant_all(pp, n, h), offs=f)
                          for o, f in sort], reps=3)
        log("dequant_gather_grouped_mm", us)
        del wt, xs
    except Exception as ex:
        traceback.print_exc()
        print(json.dumps({**base, "kind": "grouped_mm", "error": repr(ex)[:300]}), flush=True)
    del pp
    torch.cuda.empty_cache()
    for kind in ["fp8", "bf16", "int4_g128"]:
        try:
            best, _ = bk.sgl_triton_stage1(kind, e, n, h, m, topk, tis, tw, a, group)
            if best:
                log(f"sgl_{kind}", best[0], cfg=best[1])
        except Exception as ex:
            print(json.dumps({**base, "kind": f"sgl_{kind}", "error": repr(ex)[:300]}), flush=True)
    with open(os.path.join(args.out, f"moe_prefill_{args.shape}_{m}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    ref = next((r["us"] for r in rows if r["kind"] == "sgl_fp8"), None)
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__}; {args.shape} gate+up, {m} tokens x {topk}")
    for r in sorted(rows, key=lambda r: r["us"]):
        vs = f"{ref / r['us']:.2f}x FP8" if ref else ""
        print(f"{r['kind']:28s} {r['us']:10.1f} us {r['TFLOPs']:7.1f} TFLOP/s {vs:>10s} {r.get('cfg', '')}")


if __name__ == "__main__":
    main()
