"""Where kq's MoE stands at prefill sizes, and what a faster path could reach (one H200).

    python benchmarks/moe_prefill_probe.py [--tokens 4096,512] [--shapes glm52,kimi_tp8] [--grouped-mm] [--out DIR]

Both MoE stages at T tokens x top-8 (group 128), CUDA-graph replay over 2 routings:
  - kq's Triton MoE kernel on the tiles and on the lane layout, a grid of tile configs each, and the
    CUDA lane kernel (cuda_lanes) past the decode sizes it is dispatched at;
  - "dequantise + grouped GEMM": every expert dequantised to bf16 by kq's dequant kernel (one launch
    for all experts), the routed rows gathered in expert order, torch._grouped_mm; each part timed
    alone and together (what a prefill path built that way would cost, memory aside: the bf16 copy of
    a layer's experts is 4x their int4 bytes);
  - SGLang's Triton fused-MoE gate+up in BF16 and FP8 block-128 (BLOCK_M 64), the peers.
Prints one JSON row per measurement and, per case, the best config of each kind.
First probe (kq 4bfb8fc, GLM-5.2 4096 tokens gate+up, results/h200/moe_prefill_s6_4bfb8fc.json): the
shipped BLOCK_M 64 config 58.9 ms, BLOCK_M 32 8.3 ms, SGLang FP8 2.98 ms, BF16 6.0 ms; dequantising
every expert 4.5 ms plus torch._grouped_mm 5.6 ms.
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


def grid():
    """Tile configs to try: BLOCK_M 16/32 take the mma.sync path (first probe: BLOCK_M 64, Triton's
    wgmma path with plain bf16 ops, 7x slower at 4096 tokens)."""
    for bm, bn in [(16, 64), (16, 128), (32, 64), (32, 128)]:
        yield kops.TileConfig(bm, bn, 1, 4, 3)


def cuda_rows(pp, a, act, tis, e, topk, base, flops, log):
    """The CUDA lane kernel past decode sizes (routing blocks of 8 pairs; each block re-reads its
    expert's weights, from L2 when the blocks of an expert run close together), its K-unsplit
    instances."""
    from kq.kernels import cuda_lanes
    rts = [kops.moe_align(t, e, 8) for t in tis]
    for v in [v for v in cuda_lanes.GATE_UP_VARIANTS if v[1] == 1]:
        us = bk.graph_us([lambda rt=rt: cuda_lanes.moe_gate_up(a, pp, rt, topk, v) for rt in rts], reps=3)
        log(base, "kq_cuda_lane_gate_up", us, flops, cfg={"variant": v})
    for v in [v for v in cuda_lanes.DOWN_VARIANTS if v[1] == 1]:
        us = bk.graph_us([lambda rt=rt: cuda_lanes.moe_down(act, pp, rt, v) for rt in rts], reps=3)
        log(base, "kq_cuda_lane_down", us, flops / 2, cfg={"variant": v})


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


def stage_rows(shape, m, group, log, with_grouped_mm):
    e, h, i = bk.MOE_SHAPES[shape]
    topk, n = 8, 2 * i
    tis = bk.routings(e, m, topk, 2)
    a = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
    act = torch.randn(m * topk, i, device=DEV, dtype=torch.bfloat16)
    base = {"case": shape, "M": m, "topk": topk, "group": group}
    flops = 2 * m * topk * n * h
    for layout in ("tiles", "lane"):
        pp = bk.random_lane_moe(e, h, i, group) if layout == "lane" else bk.random_moe(e, h, i, group)
        if layout == "lane":
            cuda_rows(pp, a, act, tis, e, topk, base, flops, log)
        for cfg in grid():
            try:
                rts = [kops.moe_align(t, e, cfg.block_m) for t in tis]
                us = bk.graph_us([lambda rt=rt, cfg=cfg: kops.moe_gate_up(a, pp, rt, topk, cfg) for rt in rts], reps=3)
                log(base, f"kq_{layout}_gate_up", us, flops, cfg=cfg.__dict__)
                us = bk.graph_us([lambda rt=rt, cfg=cfg: kops.moe_down(act, pp, rt, cfg) for rt in rts], reps=3)
                log(base, f"kq_{layout}_down", us, flops / 2, cfg=cfg.__dict__)
            except Exception as ex:
                print(json.dumps({**base, "kind": f"kq_{layout}", "cfg": cfg.__dict__, "error": repr(ex)[:200]}),
                      flush=True)
        if with_grouped_mm and layout == "tiles":
            grouped_mm_rows(pp, a, tis, e, n, h, topk, base, flops, log)
        del pp
        torch.cuda.empty_cache()
    tw = torch.rand(m, topk, device=DEV)
    for kind in ["fp8", "bf16"]:
        try:
            best, _ = bk.sgl_triton_stage1(kind, e, n, h, m, topk, tis, tw, a, group)
            if best:
                log(base, f"sgl_{kind}_gate_up", best[0], flops, cfg=best[1])
        except Exception as ex:
            print(json.dumps({**base, "kind": f"sgl_{kind}", "error": repr(ex)[:300]}), flush=True)


def grouped_mm_rows(pp, a, tis, e, n, h, topk, base, flops, log):
    try:
        wt = dequant_all(pp, n, h)
        us = bk.graph_us([lambda: dequant_all(pp, n, h)], reps=3)
        log(base, "dequant_all_experts", us, 0, GB_written=round(wt.numel() * 2 / 1e9, 2))
        sort = []
        for t in tis:
            flat = t.reshape(-1).long()
            order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
            sort.append((order, offs))
        xs = [a[o // topk] for o, _ in sort]
        us = bk.graph_us([lambda x=x, f=f: torch._grouped_mm(x, wt, offs=f) for x, (_, f) in zip(xs, sort)], reps=3)
        log(base, "grouped_mm_bf16", us, flops)
        del wt, xs
    except Exception as ex:
        traceback.print_exc()
        print(json.dumps({**base, "kind": "grouped_mm", "error": repr(ex)[:300]}), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,512")
    ap.add_argument("--shapes", default="glm52,kimi_tp8")
    ap.add_argument("--grouped-mm", action="store_true", help="also dequantise every expert + torch._grouped_mm")
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []

    def log(base, kind, us, flops, **extra):
        row = {**base, "kind": kind, "us": round(us, 1), "TFLOPs": round(flops / us / 1e6, 1), **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)

    for m in [int(t) for t in args.tokens.split(",")]:
        for shape in args.shapes.split(","):
            stage_rows(shape, m, 128, log, args.grouped_mm)
    with open(os.path.join(args.out, "moe_prefill_probe.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__}; gate+up and down stages, x top-8, group 128")
    for key in sorted({(r["case"], r["M"]) for r in rows}):
        sel = [r for r in rows if (r["case"], r["M"]) == key]
        fp8 = next((r["us"] for r in sel if r["kind"] == "sgl_fp8_gate_up"), None)
        for kind in sorted({r["kind"] for r in sel}):
            best = min((r for r in sel if r["kind"] == kind), key=lambda r: r["us"])
            vs = f"{fp8 / best['us']:.2f}x FP8" if fp8 and "gate_up" in kind else ""
            c = best.get("cfg", {})
            cs = f"bm{c['block_m']} bn{c['block_n']} w{c['num_warps']} s{c['num_stages']}" if "block_m" in c else c
            print(f"{key[0]:9s} {key[1]:5d} {kind:22s} {best['us']:9.1f} us {best['TFLOPs']:6.1f} TF/s {vs:>10s} {cs}")


if __name__ == "__main__":
    main()
