"""kq's W4A8 prefill MoE against SGLang's FP8 block-quantized Triton MoE and kq's W4A16 paths (one H200).

    python benchmarks/w4a8_bench.py [--tokens 2048,4096,16384] [--shapes glm52,kimi] [--check] [--sweep]
                                    [--sustained SECONDS] [--out DIR]

Full expert shapes, top-8, group 128, both MoE stages and everything between them, per variant:
  kq_w4a8        kq.kernels.w4a8.fused_moe_w4a8: per-token FP8 quantisation, routing table, gate+up
                 (SiLU*mul fused), per-pair quantisation, down, top-k combine;
  sgl_fp8        SGLang 0.5.23's invoke_fused_moe_kernel in FP8 w8a8 block-128, its own tile config
                 (try_get_optimal_moe_config, gate+up and down), its Triton per-token-group FP8
                 quantisation before each GEMM, SiLU*mul and the top-k sum in torch; routing alignment
                 in torch outside the timing (sgl_kernel's CUDA ops are not on the GPU machine);
  sgl_fp8_gemms  the same without the SiLU*mul and the sum (the peer's GEMMs and quantisation alone);
  kq_w4a16_lane  kq.kernels.fused_moe_w4a16 on the lane layout (what the plugin runs on Hopper: the CUDA
                 lane kernel);
  kq_w4a16_tiles the same op on the tiles layout (kq's Triton kernel).
Burst rows: CUDA-graph replay of two routings, median of 15 replays, variants interleaved. Sustained rows
(--sustained S): each variant replayed back to back for S seconds, then the median of 15. --check:
kq_w4a8 against the torch reference (kq.kernels.w4a8.reference, float64) on a GLM-5.2-shaped layer, the three
conversions and both tile families. --sweep: tile configs of each W4A8 stage at each size. The floor:
cuBLAS FP8 (torch._scaled_mm, per-tensor scales) 8192^3 in the same process. Rows go to DIR/w4a8.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bench_kernels as bk  # noqa: E402

from kq.kernels import fused_moe_w4a16  # noqa: E402
from kq.kernels import triton_ops as kops  # noqa: E402
from kq.kernels import w4a8  # noqa: E402
from kq.kernels.layout import PrepackedMoE  # noqa: E402

DEV = "cuda"
T0 = time.time()
SHAPES = {"glm52": (256, 6144, 2048), "kimi": (384, 7168, 2048)}    # E, H, I (full experts, no TP)
OUT = None


def log(row):
    row = {**row, "elapsed_s": round(time.time() - T0, 1)}      # where a timed-out step spent its time
    print(json.dumps(row), flush=True)
    if OUT:
        with open(os.path.join(OUT, "w4a8.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def lane_moe(e, h, i, gen):
    """Random lane-layout INT4 experts (any int32 words are valid codes) with scales around 1/(8 sqrt(K))."""
    def words(n, k):
        return torch.randint(-2 ** 31, 2 ** 31 - 1, (e, n // 8, k // 128, 8, 4, 4), dtype=torch.int32, device=DEV,
                             generator=gen)

    def scales(n, k):
        return ((torch.rand(e, n // 8, 8, k // 128, device=DEV, generator=gen) + 0.5) / (8 * k ** 0.5)).to(torch.bfloat16)
    return PrepackedMoE(words(2 * i, h), scales(2 * i, h), words(h, i), scales(h, i), num_experts=e, hidden=h,
                        intermediate=i, group=128, lane=True)


def tiles_moe(e, h, i, gen):
    q13 = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, h // 8, 2 * i), dtype=torch.int32, device=DEV, generator=gen)
    q2 = torch.randint(-2 ** 31, 2 ** 31 - 1, (e, i // 8, h), dtype=torch.int32, device=DEV, generator=gen)
    s13 = (torch.rand(e, h // 128, 2 * i, device=DEV, generator=gen) * 1e-3 + 1e-3).to(torch.bfloat16)
    s2 = (torch.rand(e, i // 128, h, device=DEV, generator=gen) * 1e-3 + 1e-3).to(torch.bfloat16)
    return PrepackedMoE(q13, s13, q2, s2, num_experts=e, hidden=h, intermediate=i, group=128, lane=False)


# ---------------------------------------------------------------- SGLang's FP8 block MoE, as its engine runs it

_SGL_WEIGHTS: dict = {}


def sgl_fp8_weights(e, h, i, gen):
    """Random FP8 block-128 experts (w1 [E, 2I, H], w2 [E, H, I] e4m3, their block scales), made an expert at a
    time (a whole-tensor fp32 randn of Kimi K2's w1 is 45 GB) and shared by both SGLang variants of a case."""
    if (e, h, i) not in _SGL_WEIGHTS:
        def fp8(n, k):
            w = torch.empty(e, n, k, device=DEV, dtype=torch.float8_e4m3fn)
            for j in range(e):
                w[j] = (torch.randn(n, k, device=DEV, generator=gen) * 0.02).to(torch.float8_e4m3fn)
            return w
        _SGL_WEIGHTS.clear()
        _SGL_WEIGHTS[(e, h, i)] = (fp8(2 * i, h), fp8(h, i),
                                   torch.rand(e, 2 * i // 128, h // 128, device=DEV, generator=gen) * 1e-3 + 1e-4,
                                   torch.rand(e, h // 128, i // 128, device=DEV, generator=gen) * 1e-3 + 1e-4)
    return _SGL_WEIGHTS[(e, h, i)]


def sgl_fp8_fns(e, h, i, x, tis, tws, gen, gemms_only):
    import triton.language as tl
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel
    from sglang.kernels.ops.quantization.fp8_kernel import _per_token_group_quant_8bit_raw as quant
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import try_get_optimal_moe_config

    w1, w2, s1, s2 = sgl_fp8_weights(e, h, i, gen)
    t, k = tis[0].shape
    try:
        cfg, (dcfg, _) = try_get_optimal_moe_config(w1.shape, w2.shape, k, "fp8_w8a8", t, block_shape=[128, 128],
                                                    return_down_config=True)
        source = "tuned file"
    except ValueError:
        # no tuned file for this (E, N) on this GPU: SGLang takes get_default_config, whose first line reads
        # the server's runtime context (absent outside a server); its block-quantized FP8 branch is this:
        cfg = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 32, "num_warps": 4,
               "num_stages": 3}
        dcfg, source = None, "get_default_config (fp8 block branch)"
    dcfg = dcfg or cfg
    als = [bk.sgl_align(ti, cfg["BLOCK_SIZE_M"], e) for ti in tis]
    c1 = torch.empty(t, k, 2 * i, device=DEV, dtype=torch.bfloat16)
    c3 = torch.empty(t, k, h, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(t, h, device=DEV, dtype=torch.bfloat16)

    def call(a, b, bs, c, ti, tw, al, top_k, mul, conf):
        aq, a_s = quant(a, 128)
        invoke_fused_moe_kernel(aq, b, None, c, a_s, bs, None, tw, ti, *al, mul_routed_weight=mul, top_k=top_k,
                                config=conf, compute_type=tl.bfloat16, use_fp8_w8a8=True, use_int8_w8a8=False,
                                use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=False,
                                block_shape=[128, 128])

    def fn(ti, tw, al):
        call(x, w1, s1, c1, ti, tw, al, k, False, cfg)
        if gemms_only:
            act = c1.view(-1, 2 * i)[:, :i]           # what the GEMM reads, without computing SiLU*mul
        else:
            g = c1.view(-1, 2 * i)
            act = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
        call(act.contiguous() if not gemms_only else act.contiguous(), w2, s2, c3, ti, tw, al, 1, True, dcfg)
        if not gemms_only:
            torch.sum(c3, dim=1, out=out)
    fns = [lambda ti=ti, tw=tw, al=al: fn(ti, tw, al) for ti, tw, al in zip(tis, tws, als)]
    return fns, {"up": cfg, "down": dcfg, "cfg_source": source}


# ---------------------------------------------------------------- timing

def sustained_us(fns, seconds):
    """bench_kernels.graph_us in its sustained state, as the kernel tables' sustained rows: `seconds` of
    back-to-back replay (eight at a time, then a wait: the heat lasts what it is asked), then the median of
    15 replays."""
    saved = dict(bk.STATE)
    bk.STATE.update(name="sustained", heat_s=seconds)
    try:
        return bk.graph_us(fns)
    finally:
        bk.STATE.update(saved)


def cublas_fp8_tflops():
    n = 8192
    a = torch.randn(n, n, device=DEV).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=DEV).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=DEV)
    us = bk.graph_us([lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)] * 4, reps=10)
    return 2 * n ** 3 / us / 1e6


# the register-operand kernel (cvt 3) in the --check: one, two and four warpgroups, 64- and 32-row blocks
RS_CHECK = [w4a8.configs(2400, 32), w4a8.configs(2400, 8),
            (w4a8.W4A8Config(64, 32, 4, 4, 3), w4a8.W4A8Config(64, 64, 4, 3, 3)),
            (w4a8.W4A8Config(64, 64, 8, 3, 3), w4a8.W4A8Config(64, 256, 16, 3, 3)),
            (w4a8.W4A8Config(32, 128, 16, 3, 3), w4a8.W4A8Config(32, 128, 8, 4, 3))]


def check(gen):
    """kq_w4a8 against the float64 reference on a GLM-5.2-shaped layer (fewer experts)."""
    e, h, i, t, k = 32, 6144, 2048, 300, 8
    pp = lane_moe(e, h, i, gen)
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    ti = torch.stack([torch.randperm(e, device=DEV, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    ti[5, 2] = -1                                   # another EP rank's expert
    tw = torch.rand(t, k, device=DEV, generator=gen)
    ref = w4a8.reference(x, pp, tw, ti).double()
    C = w4a8.W4A8Config
    triton_tiles = ((C(64, 64, 4, 4, maxnreg=168), C(64, 128, 4, 3, maxnreg=168)), (C(128, 64, 8, 4), C(128, 128, 8, 3)))
    # the Triton kernel (w4a8_kernel.py) at its own tiles with conversions 0-2, then the register-operand kernel's
    checked = [tuple(C(c.block_m, c.block_n, c.num_warps, c.num_stages, cvt, c.maxnreg) for c in cfgs)
               for cvt in (0, 1, 2) for cfgs in triton_tiles] + RS_CHECK
    for cfgs in checked:
        out = w4a8.fused_moe_w4a8(x, pp, tw, ti, config=cfgs).double()
        err = ((out - ref).norm() / ref.norm()).item()
        log({"check": "kq_w4a8_vs_reference", "cvt": cfgs[0].cvt, "cfg": str(cfgs), "rel_err": err,
             "finite": bool(torch.isfinite(out).all())})
    xq, xs, _ = w4a8.quantize_rows(x)
    cq, cs, _ = w4a8.quantize_rows(x.cpu())
    log({"check": "quant_rows_vs_cpu", "codes_differing": int((xq.cpu().view(torch.uint8) != cq.view(torch.uint8)).sum()),
         "codes": xq.numel(), "scale_max_rel": ((xs.cpu() - cs).abs() / cs).max().item()})


def case(name, t, k, gen, variants, sustained, sweep):
    e, h, i = SHAPES[name]
    flops = 2 * t * k * (2 * i * h + h * i)
    base = {"case": name, "E": e, "H": h, "I": i, "tokens": t, "topk": k}
    tis = [torch.stack([torch.randperm(e, device=DEV, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
           for _ in range(2)]
    tws = [torch.rand(t, k, device=DEV, generator=gen) for _ in range(2)]
    x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, generator=gen)
    fns = {}
    info = {}
    if "kq_w4a8" in variants or sweep:
        pp = lane_moe(e, h, i, gen)
        sc = w4a8.block_scales(pp)
        cfg = w4a8.configs(t * k, e)
        if sweep:
            cfg = sweep_stages(base, pp, sc, x, tis, k, flops) or cfg
        fns["kq_w4a8"] = [lambda ti=ti, tw=tw: w4a8.fused_moe_w4a8(x, pp, tw, ti, scales=sc, config=cfg)
                          for ti, tw in zip(tis, tws)]
        info["kq_w4a8"] = {"cfg": str(cfg), "cfg_from": "sweep" if sweep else "configs()"}
    for v in ("sgl_fp8", "sgl_fp8_gemms"):
        if v in variants:
            try:
                fns[v], info[v] = sgl_fp8_fns(e, h, i, x, tis, tws, gen, v.endswith("gemms"))
            except Exception as ex:
                log({**base, "kind": v, "error": repr(ex)[:300]})
                traceback.print_exc()
    if "kq_w4a16_tiles" in variants:
        tp = tiles_moe(e, h, i, gen)
        fns["kq_w4a16_tiles"] = [lambda ti=ti, tw=tw: fused_moe_w4a16(x, tp, tw, ti) for ti, tw in zip(tis, tws)]
    if "kq_w4a16_lane" in variants:
        lp = pp if "kq_w4a8" in fns else lane_moe(e, h, i, gen)
        fns["kq_w4a16_lane"] = [lambda ti=ti, tw=tw: fused_moe_w4a16(x, lp, tw, ti) for ti, tw in zip(tis, tws)]
    for rnd in range(2):
        for v, f in fns.items():
            try:
                us = bk.graph_us(f)
            except Exception as ex:
                log({**base, "kind": v, "error": repr(ex)[:300]})
                continue
            log({**base, "kind": v, "mode": "burst", "round": rnd, "us": round(us, 1),
                 "tflops": round(flops / us / 1e6, 1), **info.get(v, {})})
    if sustained:
        for v, f in fns.items():
            try:
                us = sustained_us(f, sustained)
            except Exception as ex:
                log({**base, "kind": v, "error": repr(ex)[:300]})
                continue
            log({**base, "kind": v, "mode": "sustained", "us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                 **info.get(v, {})})
    del fns
    _SGL_WEIGHTS.clear()
    torch.cuda.empty_cache()


def sweep_stages(base, pp, sc, x, tis, k, flops):
    """Each stage alone over tile configs (stage 1 with its output's quantisation, which feeds the next
    GEMM); returns the best (gate+up, down) pair of W4A8Configs. (The rows of results/h200/w4a8_call3 also
    hold a variant since removed: stage 1 as one GEMM over [gate | up], cfg[5] = 0, SiLU*mul in the
    quantisation kernel; 1.04-2x slower.)"""
    p = tis[0].numel()
    act = torch.randn(p, pp.intermediate, device=DEV, dtype=torch.bfloat16)
    C = w4a8.W4A8Config
    up = [C(64, 64, 4, 4, 2, 168), C(64, 64, 8, 3, 3), C(64, 64, 8, 4, 3), C(64, 64, 8, 2, 3), C(64, 32, 4, 3, 3),
          C(64, 128, 16, 3, 3), C(64, 128, 16, 4, 3)]
    dn = [C(64, 128, 4, 3, 2, 168), C(64, 256, 16, 3, 3), C(64, 256, 16, 4, 3), C(64, 256, 16, 2, 3),
          C(64, 128, 8, 3, 3), C(64, 128, 8, 4, 3), C(64, 64, 4, 3, 3)]
    best = {}
    for stage, grid in (("gate_up", up), ("down", dn)):
        for cfg in grid:
            rts = [kops.moe_align(t, pp.num_experts, cfg.block_m) for t in tis]
            if stage == "gate_up":
                xq = w4a8.quantize_rows(x, cfg.cvt)
                f = [lambda r=r, cfg=cfg, xq=xq: w4a8.quantize_rows(w4a8.gate_up(xq, pp, sc[0], r, k, cfg), cfg.cvt)
                     for r in rts]
                fl = flops * 2 / 3
            else:
                aq = w4a8.quantize_rows(act, cfg.cvt)
                f = [lambda r=r, cfg=cfg, aq=aq: w4a8.down(aq, pp, sc[1], r, cfg) for r in rts]
                fl = flops / 3
            try:
                us = bk.graph_us(f, reps=7)
            except Exception as ex:
                log({**base, "sweep": stage, "cfg": str(cfg), "error": repr(ex)[:200]})
                continue
            log({**base, "sweep": stage, "cfg": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.cvt,
                                                 cfg.maxnreg],
                 "us": round(us, 1),
                 "tflops": round(fl / us / 1e6, 1)})
            if stage not in best or us < best[stage][0]:
                best[stage] = (us, cfg)
    if len(best) < 2:
        return None
    return best["gate_up"][1], best["down"][1]


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,4096,16384")
    ap.add_argument("--shapes", default="glm52,kimi")
    ap.add_argument("--variants", default="kq_w4a8,sgl_fp8,sgl_fp8_gemms,kq_w4a16_lane,kq_w4a16_tiles")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sustained", type=float, default=0.0)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    OUT = a.out
    env = bk.run_env()
    env["commit"] = os.environ.get("KQ_COMMIT", "?")
    try:
        from importlib.metadata import version
        env["sglang"] = version("sglang")
    except Exception:
        env["sglang"] = "?"
    log({"env": env})
    log({"floor": "cublas_fp8_8192", "tflops": round(cublas_fp8_tflops(), 1)})
    gen = torch.Generator(device=DEV).manual_seed(0)
    if a.check:
        check(gen)
    variants = a.variants.split(",")
    for name in a.shapes.split(","):
        for t in [int(v) for v in a.tokens.split(",")]:
            case(name, t, 8, gen, variants, a.sustained, a.sweep)


if __name__ == "__main__":
    main()
