"""kq's W4A16 kernels against their peers, measured in the same run on one GPU (an H200).

    python benchmarks/bench_kernels.py --out DIR [--tokens 1,16,64] [--peers dense,triton,marlin]
        [--states burst,sustained] [--picked-only]

Every row is timed in each GPU state of --states, one whole pass over the cases per state, each case's
kernels (kq and its peers) one after the other in this one process: `burst`, the GPU idle for
--idle-s seconds before each timing (clocks and power at rest); `sustained`, the timed graph first
replayed back to back for --heat-s seconds (the board at its power cap, where kq and Marlin throttle
and FP8 does not). Each row records its "state".

Every time is a CUDA-graph replay (median of 15) of a graph that holds R calls, each on its
own routing (MoE) or its own copy of the weights (dense), so weights come from HBM and not
from the 60 MB L2. Effective bandwidth = bytes of the weights and scales of the experts a
call actually routes to (or of the whole matrix, dense) / time.

MoE rows time one stage, gate+up over routed tokens, with the routing table built outside
the timed region, the way SGLang's peers are timed (../shared/tools/peer_moe_bench.py);
`kq_full` rows time kq's whole fused MoE (routing table, gate+up, SiLU*mul, down, top-k
combine). Peers: SGLang 0.5.23's Triton fused-MoE kernel in BF16, FP8 block-128 (w8a8) and
INT4 w4a16, and its JIT Marlin MoE as SGLang runs it (fused_marlin_moe's own block size, its own
moe_align_block_size / moe_align_single_token sorting with the inactive-prefix count, the sorted-expert
instance, no memset of the output: `marlin_g*` gate+up alone, `marlin_full_g*` SGLang's whole
fused_marlin_moe against `kq_lane_full_g*`); dense: cuBLAS BF16, cuBLAS FP8
(torch._scaled_mm, per-tensor scales), torch's int4 tinygemm (_weight_int4pack_mm).
SGLang needs its wheels on PYTHONPATH (see benchmarks/gpu_kernels.sh).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import triton  # noqa: E402

from kq.kernels import triton_ops as kops  # noqa: E402
from kq.kernels.layout import PACK_K, PrepackedLinear, PrepackedMoE  # noqa: E402

DEV = "cuda"
ROWS: list[dict] = []
# the GPU state graph_us times in (--states, --idle-s, --heat-s)
STATE = {"name": "burst", "idle_s": 1.0, "heat_s": 2.0}


def log(row: dict) -> None:
    """One result row; "t" (Unix seconds, when it was logged) lets benchmarks/clock_rows.py put the GPU's
    clocks and power beside it."""
    row = {**row, "state": STATE["name"], "t": round(time.time(), 3)}
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def run_env() -> dict:
    """Date, GPU, driver and versions: the first row of every kernel benchmark's output."""
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(),
           "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        env["driver"] = "?"
    return env


def graph_us(fns, reps: int = 15) -> float:
    """Median µs per call of a CUDA graph holding each fn once (fns rotate weights/routings)."""
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fns[0]()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):       # warmed up and captured on one stream, as SGLang does
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    if STATE["name"] == "sustained":      # back to back until the board sits at its power cap
        end = time.perf_counter() + STATE["heat_s"]
        while time.perf_counter() < end:
            for _ in range(8):
                g.replay()
            torch.cuda.synchronize()
    else:                                 # burst: from an idle GPU
        time.sleep(STATE["idle_s"])
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / len(fns))
    ts.sort()
    del g
    return ts[len(ts) // 2]


def bandwidth_tbps() -> tuple[float, float]:
    """(device copy, counting reads + writes; streaming read of a reduction), TB/s."""
    x = torch.randn(1 << 30, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(20):              # let the clocks come up
        y.copy_(x)
    copy_us = graph_us([lambda: y.copy_(x)] * 4, reps=10)
    read_us = graph_us([lambda: x.sum(dtype=torch.float32)] * 4, reps=10)
    del x, y
    torch.cuda.empty_cache()
    return 2 * (1 << 30) * 2 / copy_us / 1e6, (1 << 30) * 2 / read_us / 1e6


# ---------------------------------------------------------------- kq weights (random, prepacked)

def random_prepacked(e: int, n: int, k: int, group: int):
    kp = -(-k // PACK_K) * PACK_K
    q = torch.randint(-2**31, 2**31 - 1, (e, kp // 8, n), device=DEV, dtype=torch.int32)
    s = (torch.rand(e, kp // group, n, device=DEV) * 1e-2 + 1e-3).to(torch.bfloat16)
    return q, s


def random_moe(e, h, i, group) -> PrepackedMoE:
    q13, s13 = random_prepacked(e, 2 * i, h, group)
    q2, s2 = random_prepacked(e, h, i, group)
    return PrepackedMoE(q13, s13, q2, s2, num_experts=e, hidden=h, intermediate=i, group=group)


def random_lane_moe(e, h, i, group):
    """Random checkpoint-format experts (weight_packed / weight_scale) in the CUDA kernel's lane layout."""
    from kq.kernels import prepack_moe
    p13 = torch.randint(-2**31, 2**31 - 1, (e, 2 * i, h // 8), device=DEV, dtype=torch.int32)
    s13 = (torch.rand(e, 2 * i, h // group, device=DEV) * 1e-2 + 1e-3).to(torch.bfloat16)
    p2 = torch.randint(-2**31, 2**31 - 1, (e, h, i // 8), device=DEV, dtype=torch.int32)
    s2 = (torch.rand(e, h, i // group, device=DEV) * 1e-2 + 1e-3).to(torch.bfloat16)
    return prepack_moe(p13, s13, p2, s2, group, lane=True)


def hbm_copies(nbytes: float) -> int:
    """How many copies of a buffer of nbytes a graph rotates through so that every call reads HBM, not
    the 60 MB L2: about 2 GB in all, 2-24 copies."""
    return max(2, min(24, int(2e9 // nbytes)))


def random_linears(n, k, group):
    """hbm_copies of a random [n, k] linear in the tiles layout, and the bytes per weight."""
    bpw = 0.5 + 2 / group
    ws = []
    for _ in range(hbm_copies(n * k * bpw)):
        q, s = random_prepacked(1, n, k, group)
        ws.append(PrepackedLinear(q[0], s[0], n, k, group))
    return ws, bpw


def random_lane_linear(n, k, group):
    """A random [n, k] linear (random words and scales) in the lane layout (prepack_linear(lane=True)'s)."""
    kb = -(-k // PACK_K)
    return PrepackedLinear(torch.randint(-2**31, 2**31 - 1, (n // 8, kb, 8, 4, 4), device=DEV, dtype=torch.int32),
                           (torch.rand(n // 8, 8, kb * PACK_K // group, device=DEV) * 1e-2 + 1e-3).to(torch.bfloat16),
                           n, k, group, lane=True)


def routings(e, m, topk, r):
    """r random top-k routings of m tokens over e experts, from a generator seeded by the case alone,
    so a run that times other kernels first (a --no-kq Marlin run) gets the same routings."""
    g = torch.Generator(device=DEV).manual_seed(1000003 * e + 1009 * m + topk)
    return [torch.stack([torch.randperm(e, device=DEV, generator=g)[:topk] for _ in range(m)]).to(torch.int32)
            for _ in range(r)]


# ---------------------------------------------------------------- SGLang peers (adapted from the CEO's harness)

def sgl_align(topk_ids, block_m, e):
    """SGLang's (sorted_ids, expert_ids, num_tokens_post_padded), built in torch outside the timing."""
    flat = topk_ids.flatten().to(torch.int64)
    n = flat.numel()
    counts = torch.bincount(flat, minlength=e)
    padded = (counts + block_m - 1) // block_m * block_m
    max_len = n + e * (block_m - 1)
    sorted_ids = torch.full((max_len,), n, dtype=torch.int32, device=DEV)
    expert_ids = torch.full((max_len // block_m,), -1, dtype=torch.int32, device=DEV)
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(padded, 0) - padded
    cstarts = torch.cumsum(counts, 0) - counts
    for ex in torch.nonzero(counts).flatten().tolist():
        c, p, s = counts[ex].item(), padded[ex].item(), starts[ex].item()
        sorted_ids[s:s + c] = order[cstarts[ex]:cstarts[ex] + c].to(torch.int32)
        expert_ids[s // block_m:(s + p) // block_m] = ex
    total = torch.tensor([int(padded.sum())], dtype=torch.int32, device=DEV)
    return sorted_ids, expert_ids, total


def sgl_moe_operands(kind, e, n, k, a, group):
    """Random weights for SGLang's Triton fused-MoE kernel in one format, and the activations it takes
    (FP8 w8a8: quantized per token and 128-input block): (aq, a_s, b, bs, bytes per weight)."""
    if kind == "bf16":
        b = torch.randn(e, n, k, device=DEV, dtype=torch.bfloat16) * 0.02
        bs, bpw = None, 2.0
    elif kind == "fp8":
        b = (torch.randn(e, n, k, device=DEV) * 0.02).to(torch.float8_e4m3fn)
        bs = torch.rand(e, (n + 127) // 128, (k + 127) // 128, device=DEV) * 1e-3 + 1e-4
        bpw = 1.0 + 4 / 128 / 128
    else:
        b = torch.randint(0, 256, (e, n, k // 2), device=DEV, dtype=torch.uint8)
        bs = (torch.rand(e, n, k // group, device=DEV) * 1e-2 + 1e-3).to(torch.bfloat16)
        bpw = 0.5 + 2 / group
    if kind == "fp8":
        m = a.shape[0]
        ag = a.float().view(m, k // 128, 128)
        a_s = ag.abs().amax(-1).clamp(min=1e-6) / 448.0
        aq = (ag / a_s[..., None]).to(torch.float8_e4m3fn).view(m, k)
    else:
        aq, a_s = a, None
    return aq, a_s, b, bs, bpw


def sgl_invoke(kind, aq, a_s, b, bs, c, tw, topk_ids, al, cfg, group):
    """One gate+up call of SGLang's invoke_fused_moe_kernel (al: sgl_align's routing)."""
    import triton.language as tl
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel
    s_, e_, n_ = al
    invoke_fused_moe_kernel(
        aq, b, None, c, a_s, bs, None, tw, topk_ids, s_, e_, n_, mul_routed_weight=False, top_k=topk_ids.shape[1],
        config=cfg, compute_type=tl.bfloat16, use_fp8_w8a8=kind == "fp8", use_int8_w8a8=False,
        use_int8_w8a16=False, use_int4_w4a16=kind.startswith("int4"), per_channel_quant=False,
        block_shape=[128, 128] if kind == "fp8" else ([0, group] if kind.startswith("int4") else None))


def sgl_triton_stage1(kind, e, n, k, m, topk, tis, tw, a, group):
    """Best of a few tile configs of SGLang's invoke_fused_moe_kernel for one weight format."""
    aq, a_s, b, bs, bpw = sgl_moe_operands(kind, e, n, k, a, group)
    c = torch.empty(m, topk, n, device=DEV, dtype=torch.bfloat16)
    bm = 16 if m * topk <= 4 * e else 64
    als = [sgl_align(t, bm, e) for t in tis]
    best = None
    for bn, bk, st in [(32, 128, 4), (64, 128, 3), (64, 128, 4), (128, 128, 3), (64, 64, 4), (128, 64, 3)]:
        if kind == "fp8" and bk != 128:
            continue
        cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 1,
               "num_warps": 4, "num_stages": st}
        try:
            us = graph_us([lambda t=t, al=al, cfg=cfg: sgl_invoke(kind, aq, a_s, b, bs, c, tw, t, al, cfg, group)
                           for t, al in zip(tis, als)])
        except Exception:  # a tile config the kernel cannot compile for this shape
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    del b, bs
    torch.cuda.empty_cache()
    return best, bpw


def marlin_scale_perm(s):
    perm = [i + 8 * j for i in range(8) for j in range(8)]
    n = s.shape[-1]
    return s.reshape(-1, 64)[:, perm].reshape(-1, n).contiguous()


def sgl_marlin_block(m, topk, e):
    """fused_marlin_moe's block size choice."""
    for bm in [8, 16, 32, 48, 64]:
        if m * topk / e / bm < 0.9:
            break
    return bm


def sgl_marlin_align(t, bm, e):
    """fused_marlin_moe's own sorting: the single-token align at one token, else moe_align_block_size,
    both with the inactive-prefix count its sorted-expert instance reads."""
    if t.shape[0] == 1 and t.shape[1] <= 32 and t.dtype == torch.int32:
        from sglang.kernels.ops.moe.moe_align_single_token import moe_align_single_token
        return moe_align_single_token(t, bm, return_inactive_prefix_count=True)
    from sglang.srt.layers.moe.fused_moe_triton import moe_align_block_size
    return moe_align_block_size(t, bm, e, return_inactive_prefix_count=True)


def sgl_marlin_weights(e, n, k, group):
    """Random GPTQ int32 [K/8, N] per expert repacked by SGLang's JIT, and permuted scales [E, K/g, N]."""
    from sglang.kernels.ops.quantization.gptq_marlin_repack import gptq_marlin_repack
    empty_perm = torch.empty(0, dtype=torch.int32, device=DEV)
    qs, ss = [], []
    for _ in range(e):
        q = torch.randint(-2**31, 2**31 - 1, (k // 8, n), device=DEV, dtype=torch.int32)
        qs.append(gptq_marlin_repack(q, empty_perm, k, n, 4))
        ss.append(marlin_scale_perm((torch.rand(k // group, n, device=DEV) * 1e-2 + 1e-3).to(torch.bfloat16)))
    return torch.stack(qs), torch.stack(ss)


def sgl_marlin_workspace(n, k, sorted_len, bm):
    """fused_marlin_moe's workspace size (SGLang's MoE layer allocates it once: layer.workspace)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    size = min((max(n, k) // 64) * (sorted_len // bm), sms * 4)
    return torch.zeros(size, dtype=torch.int32, device=DEV)


def sgl_marlin_stage1(e, n, k, m, topk, tis, tw, a, group):
    """gate+up of fused_marlin_moe: the same moe_wna16_marlin_gemm call and instance, the routing table
    built outside the timing like every stage row, nothing else in the timed region."""
    from sgl_kernel.scalar_type import scalar_types
    from sglang.kernels.ops.moe.moe_wna16_marlin import moe_wna16_marlin_gemm
    bq, bs = sgl_marlin_weights(e, n, k, group)
    bm = sgl_marlin_block(m, topk, e)
    als = [sgl_marlin_align(t, bm, e) for t in tis]
    ws = sgl_marlin_workspace(n, k, max(al[0].size(0) for al in als), bm)
    c = torch.empty(m * topk, n, device=DEV, dtype=torch.bfloat16)
    atomic = torch.cuda.get_device_capability()[0] >= 9          # fused_marlin_moe's use_atomic_add (bf16)

    def call(al):
        s_, e_, n_ = al
        moe_wna16_marlin_gemm(a, c, bq, None, bs, None, None, None, None, ws, s_, e_, n_, tw,
                              moe_block_size=bm, top_k=topk, mul_topk_weights=False, is_ep=False,
                              expert_ids_are_sorted=True, has_inactive_prefix_count=True,
                              b_q_type=scalar_types.uint4b8, size_m=m, size_n=n, size_k=k,
                              is_k_full=True, use_atomic_add=atomic, use_fp32_reduce=True, is_zp_float=False)
    us = graph_us([lambda al=al: call(al) for al in als])
    del bq, bs
    torch.cuda.empty_cache()
    return us, {"moe_block_size": bm, "use_atomic_add": atomic}


def sgl_marlin_full(e, h, i, m, topk, tis, tw, a, group):
    """SGLang's whole fused_marlin_moe (its sorting, gate+up, SiLU*mul, down, top-k combine), called
    the way its compressed-tensors WNA16 MoE method calls it (workspace allocated once)."""
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
    w1, s1 = sgl_marlin_weights(e, 2 * i, h, group)
    w2, s2 = sgl_marlin_weights(e, h, i, group)
    bm = sgl_marlin_block(m, topk, e)
    ws = sgl_marlin_workspace(2 * i, h, m * topk + e * (bm - 1), bm)
    logits = torch.empty(m, e, device=DEV, dtype=torch.bfloat16)
    us = graph_us([lambda t=t: fused_marlin_moe(a, w1, w2, s1, s2, logits, tw, t, global_num_experts=e,
                                                num_bits=4, is_k_full=True, workspace=ws) for t in tis])
    del w1, w2, s1, s2
    torch.cuda.empty_cache()
    return us, {"moe_block_size": bm}


# ---------------------------------------------------------------- MoE rows

# --variants: named changes to the heuristic's tile config, timed one after the other in two
# rounds (A B C A B C), so drift over the run shows as the spread between the rounds
VARIANTS = {
    "base": {},                                   # the heuristic as shipped
    "old": {"fold": False, "masks": True},        # the kernel before FOLD / EVEN_K / EVEN_N
    "nofold": {"fold": False},
    "fold": {"fold": True},
    "masks": {"masks": True},
    "st2": {"num_stages": 2},
    "st4": {"num_stages": 4},
    "bn32": {"block_n": 32},
    "bn128": {"block_n": 128},
    "bn128w8": {"block_n": 128, "num_warps": 8},
    "w2": {"num_warps": 2},
}
AB: list[str] = []


def ab_time(base, cfg0, label, make_fns, bytes_, extra=None):
    """Time each --variants change of cfg0 twice (round robin); log one row per variant and round."""
    for rnd in range(2):
        for v in AB:
            cfg = dataclasses.replace(cfg0, **VARIANTS[v])
            try:
                us = graph_us(make_fns(cfg))
            except Exception as ex:
                log({**base, "kind": label, "variant": v, "cfg": cfg.__dict__, "error": repr(ex)[:200]})
                continue
            log({**base, "kind": label, "variant": v, "round": rnd, "us": round(us, 2),
                 "GBps": round(bytes_ / us / 1e3, 1), "cfg": cfg.__dict__, **(extra or {})})


LANES: list[bool] = []      # --lanes: also time the CUDA decode MoE (kq/kernels/cuda_lanes.py)
PICKED_ONLY: list[bool] = []  # --picked-only: of the CUDA kernel's instances, the one cuda_lanes.pick chooses
NO_TILES: list[bool] = []     # --no-tiles: no MoE rows of the Triton kernel on the tiles layout


def lanes_case(base, e, h, i, m, topk, group, tis, tw, a, touched):
    """kq on the lane layout, random checkpoint-format weights. The CUDA kernel's gate+up and down
    alone (routing outside the timing, blocks of 8 pairs; "picked" marks what the product runs): at
    decode sizes every (NT, KSPLIT, STAGES, FOLD[, XSM]) instance, above them the picked one. Every size:
    the whole MoE through the public kq.kernels.fused_moe_w4a16 (the CUDA kernel), and above decode
    sizes Triton's LANE gate+up alone (what serves where the CUDA kernel does not build)."""
    from kq.kernels import cuda_lanes, fused_moe_w4a16
    from kq.kernels.moe_routing import decode_size
    try:
        lm = random_lane_moe(e, h, i, group)
        bpw = 0.5 + 2 / group
        decode = decode_size(m * topk, e)
        rts = [kops.moe_align(t, e, 8) for t in tis]
        act = torch.randn(m * topk, i, device=DEV, dtype=torch.bfloat16)
        pick1, pick2 = (cuda_lanes.pick_stage(m * topk, e, h, i, gated, group) for gated in (True, False))
        name = cuda_lanes.variant_name
        for v in cuda_lanes.stage_variants(True, group) if decode and not PICKED_ONLY else [pick1]:
            us = graph_us([lambda rt=rt: cuda_lanes.moe_gate_up(a, lm, rt, topk, v) for rt in rts])
            log({**base, "kind": f"lanes_g{group}_{name(v)}", "us": round(us, 2),
                 "GBps": round(touched * 2 * i * h * bpw / us / 1e3, 1), "picked": v == pick1})
        for v in cuda_lanes.stage_variants(False, group) if decode and not PICKED_ONLY else [pick2]:
            us = graph_us([lambda rt=rt: cuda_lanes.moe_down(act, lm, rt, v) for rt in rts])
            log({**base, "kind": f"lanes_down_g{group}_{name(v)}", "us": round(us, 2),
                 "GBps": round(touched * i * h * bpw / us / 1e3, 1), "picked": v == pick2})
        if not decode:
            sms = torch.cuda.get_device_properties(0).multi_processor_count
            cfg1, _ = kops.moe_configs(m * topk, e, h, i, sms, group)
            rts = [kops.moe_align(t, e, cfg1.block_m) for t in tis]
            us = graph_us([lambda rt=rt: kops.moe_gate_up(a, lm, rt, topk, cfg1) for rt in rts])
            log({**base, "kind": f"lane_triton_g{group}", "us": round(us, 2),
                 "GBps": round(touched * 2 * i * h * bpw / us / 1e3, 1), "cfg": cfg1.__dict__})
        us = graph_us([lambda t=t: fused_moe_w4a16(a, lm, tw, t) for t in tis])
        log({**base, "kind": f"kq_lane_full_g{group}", "us": round(us, 2),
             "GBps": round(touched * 3 * i * h * bpw / us / 1e3, 1), "path": "cuda"})
        if m == 1:      # the same MoE in four launches (moe_align, gate+up, down, combine): what one token ran before
            def four(t):
                rt = kops.moe_align(t, e, 8)
                y = cuda_lanes.moe_down(cuda_lanes.moe_gate_up(a, lm, rt, topk), lm, rt)
                return kops.combine_topk(y, t, tw, None, 1.0)
            us = graph_us([lambda t=t: four(t) for t in tis])
            log({**base, "kind": f"kq_lane_full4_g{group}", "us": round(us, 2),
                 "GBps": round(touched * 3 * i * h * bpw / us / 1e3, 1), "path": "cuda, 4 launches"})
        del lm
        torch.cuda.empty_cache()
    except Exception as ex:
        traceback.print_exc()
        log({**base, "kind": f"lanes_g{group}", "error": repr(ex)[:300]})


def moe_case(name, e, h, i, m, topk, groups, peers, sweep, r=12, kq=True):
    tis = routings(e, m, topk, r)
    touched = sum(torch.unique(t).numel() for t in tis) / r
    tw = torch.rand(m, topk, device=DEV, dtype=torch.float32)
    a = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
    n = 2 * i
    base = {"case": name, "E": e, "H": h, "I": i, "M": m, "topk": topk, "experts_touched": touched}

    def gbps(us, bpw):
        return round(touched * n * h * bpw / us / 1e3, 1)

    for group in groups if kq and not NO_TILES else []:
        pp = random_moe(e, h, i, group)
        bpw = 0.5 + 2 / group
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        cfg1, cfg2 = kops.moe_configs(m * topk, e, h, i, sms, group)
        if AB:
            rts1 = [kops.moe_align(t, e, cfg1.block_m) for t in tis]
            ab_time(base | {"group": group}, cfg1, f"kq_ab_gate_up_g{group}",
                    lambda c: [lambda rt=rt: kops.moe_gate_up(a, pp, rt, topk, c) for rt in rts1],
                    touched * n * h * bpw)
            rts2 = [kops.moe_align(t, e, cfg2.block_m) for t in tis]
            acts = [torch.randn(m * topk, i, device=DEV, dtype=torch.bfloat16) for _ in tis]
            ab_time(base | {"group": group}, cfg2, f"kq_ab_down_g{group}",
                    lambda c: [lambda rt=rt, ac=ac: kops.moe_down(ac, pp, rt, c) for rt, ac in zip(rts2, acts)],
                    touched * h * i * bpw)
            for v in [v for v in ("base", "old") if v in AB]:
                cfgs = (dataclasses.replace(cfg1, **VARIANTS[v]), dataclasses.replace(cfg2, **VARIANTS[v]))
                us = graph_us([lambda t=t, cfgs=cfgs: kops.fused_moe_w4a16(a, pp, tw, t, configs=cfgs) for t in tis])
                log({**base, "group": group, "kind": f"kq_ab_full_g{group}", "variant": v, "us": round(us, 2),
                     "GBps": round(touched * 3 * i * h * bpw / us / 1e3, 1)})
            del pp, acts
            torch.cuda.empty_cache()
            continue
        cands = [cfg1]
        if sweep:
            kb = -(-h // PACK_K)
            for bn, split in itertools.product([64, 128], [1, 4, 8]):
                if kb % split == 0 and kb // split >= 2:
                    cands.append(kops.TileConfig(cfg1.block_m, bn, split, cfg1.num_warps, 3))
        best1, heur = None, None
        for cfg in cands:
            rts = [kops.moe_align(t, e, cfg.block_m) for t in tis]
            try:
                us = graph_us([lambda rt=rt, cfg=cfg: kops.moe_gate_up(a, pp, rt, topk, cfg) for rt in rts])
            except Exception as ex:
                log({**base, "kind": f"kq_g{group}", "cfg": cfg.__dict__, "error": repr(ex)[:200]})
                continue
            if cfg is cfg1:
                heur = us
            if sweep:
                log({**base, "kind": f"kq_g{group}_sweep", "us": round(us, 2), "GBps": gbps(us, bpw),
                     "cfg": cfg.__dict__})
            if best1 is None or us < best1[0]:
                best1 = (us, cfg)
        log({**base, "kind": f"kq_g{group}", "us": round(best1[0], 2), "GBps": gbps(best1[0], bpw),
             "cfg": best1[1].__dict__, "heuristic_us": heur and round(heur, 2)})
        # stage 2 (down) alone, then the whole fused MoE with the best configs found
        best2 = (None, cfg2)
        rts = [kops.moe_align(t, e, cfg2.block_m) for t in tis]
        acts = [torch.randn(m * topk, i, device=DEV, dtype=torch.bfloat16) for _ in tis]
        cands2 = [cfg2] + ([kops.TileConfig(cfg2.block_m, bn, 1, w, st) for bn, w, st in
                            [(128, 4, 3), (32, 4, 3)]] if sweep else [])
        for cfg in cands2:
            try:
                us = graph_us([lambda rt=rt, ac=ac, cfg=cfg: kops.moe_down(ac, pp, rt, cfg) for rt, ac in zip(rts, acts)])
            except Exception as ex:
                log({**base, "kind": f"kq_down_g{group}", "cfg": cfg.__dict__, "error": repr(ex)[:200]})
                continue
            if best2[0] is None or us < best2[0]:
                best2 = (us, cfg)
        log({**base, "kind": f"kq_down_g{group}", "us": round(best2[0], 2),
             "GBps": round(touched * h * i * bpw / best2[0] / 1e3, 1), "cfg": best2[1].__dict__})
        full_bytes = touched * 3 * i * h * bpw
        for label, cfgs in (("", None), ("_tuned", (best1[1], best2[1]))):
            if label and cfgs == (cfg1, cfg2):
                continue
            us = graph_us([lambda t=t, cfgs=cfgs: kops.fused_moe_w4a16(a, pp, tw, t, configs=cfgs) for t in tis])
            log({**base, "kind": f"kq_full{label}_g{group}", "us": round(us, 2),
                 "GBps": round(full_bytes / us / 1e3, 1),
                 "cfg": [c.__dict__ for c in (cfgs or (cfg1, cfg2))]})
        del pp, acts
        torch.cuda.empty_cache()
    for group in groups if LANES and kq else []:
        lanes_case(base, e, h, i, m, topk, group, tis, tw, a, touched)
    # "marlin-stage": gate+up alone, without the whole fused_marlin_moe (its zero-inactive-output
    # instance is a second JIT build of ~4 min on a fresh GPU machine)
    for group in groups if peers & {"marlin", "marlin-stage"} else []:
        bpw = 0.5 + 2 / group
        try:
            us, cfg = sgl_marlin_stage1(e, n, h, m, topk, tis, tw, a, group)
            log({**base, "kind": f"marlin_g{group}", "us": round(us, 2), "GBps": gbps(us, bpw), "cfg": cfg})
        except Exception as ex:
            log({**base, "kind": f"marlin_g{group}", "error": repr(ex)[:300]})
        if "marlin" not in peers:
            continue
        try:
            us, cfg = sgl_marlin_full(e, h, i, m, topk, tis, tw, a, group)
            log({**base, "kind": f"marlin_full_g{group}", "us": round(us, 2),
                 "GBps": round(touched * 3 * i * h * bpw / us / 1e3, 1), "cfg": cfg})
        except Exception as ex:
            log({**base, "kind": f"marlin_full_g{group}", "error": repr(ex)[:300]})
    if "triton" in peers or "fp8" in peers:     # fp8: SGLang's FP8 MoE alone, the anchor of an A/B run
        kinds = ["bf16", "fp8"] + [f"int4_g{g}" for g in groups if g in (32, 128)] if "triton" in peers else ["fp8"]
        for kind in kinds:
            group = int(kind.split("_g")[1]) if kind.startswith("int4") else 128
            try:
                best, bpw = sgl_triton_stage1(kind, e, n, h, m, topk, tis, tw, a, group)
            except Exception as ex:
                log({**base, "kind": f"sgl_{kind}", "error": repr(ex)[:300]})
                continue
            if best is None:
                log({**base, "kind": f"sgl_{kind}", "error": "no tile config ran"})
                continue
            log({**base, "kind": f"sgl_{kind}", "us": round(best[0], 2), "GBps": gbps(best[0], bpw), "cfg": best[1]})


# ---------------------------------------------------------------- dense rows

def dense_case(name, n, k, ms, peers, groups=(128,), kq=True, sweep=False):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in ms:
        a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        base = {"case": name, "N": n, "K": k, "M": m}
        for group in groups if kq else []:
            ws, bpw = random_linears(n, k, group)
            copies = len(ws)
            default = kops.dense_config(m, n, k, sms, swap=kops.swap_serves(a.device, ws[0]))
            if AB and m < kops.DEQUANT_GEMM_MIN_M:
                ab_time(base | {"group": group}, default, f"kq_ab_dense_g{group}",
                        lambda c: [lambda w=w: kops.w4a16_linear(a, w, config=c) for w in ws], n * k * bpw)
            us = graph_us([lambda w=w: kops.w4a16_linear(a, w) for w in ws])
            cfg = "dequant+cublas" if m >= kops.DEQUANT_GEMM_MIN_M else default.__dict__
            log({**base, "kind": f"kq_g{group}", "us": round(us, 2), "GBps": round(n * k * bpw / us / 1e3, 1),
                 "TFLOPs": round(2 * m * n * k / us / 1e6, 1), "cfg": cfg})
            if sweep:
                kb = -(-k // PACK_K)
                bms = [16] if m <= 16 else ([32, 64] if m <= 64 else [64, 128])
                for bm, bn, split, warps in itertools.product(bms, [64, 128], [1, 2, 4, 8], [4, 8]):
                    if kb % split or kb // split < 2 or (m > 64 and split > 1):
                        continue
                    tc = kops.TileConfig(bm, bn, split, warps, 3)
                    try:
                        us = graph_us([lambda w=w, tc=tc: kops.w4a16_linear(a, w, config=tc) for w in ws])
                    except Exception as ex:
                        log({**base, "kind": f"kq_g{group}_sweep", "cfg": tc.__dict__, "error": repr(ex)[:200]})
                        continue
                    log({**base, "kind": f"kq_g{group}_sweep", "us": round(us, 2),
                         "GBps": round(n * k * bpw / us / 1e3, 1), "cfg": tc.__dict__})
            del ws
            if LANES:
                dense_lanes(base, a, n, k, m, group, copies)
        if "dense" not in peers:
            continue
        copies = hbm_copies(n * k * 2)
        wb = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        us = graph_us([lambda w=w: a @ w.t() for w in wb])
        log({**base, "kind": "cublas_bf16", "us": round(us, 2), "GBps": round(n * k * 2 / us / 1e3, 1),
             "TFLOPs": round(2 * m * n * k / us / 1e6, 1)})
        a8 = a.to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device=DEV)
        w8 = [w.to(torch.float8_e4m3fn) for w in wb]
        try:
            us = graph_us([lambda w=w: torch._scaled_mm(a8, w.t(), scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16) for w in w8])
            log({**base, "kind": "cublas_fp8", "us": round(us, 2), "GBps": round(n * k / us / 1e3, 1),
                 "TFLOPs": round(2 * m * n * k / us / 1e6, 1)})
        except Exception as ex:
            log({**base, "kind": "cublas_fp8", "error": repr(ex)[:200]})
        del wb, w8
        if m > 512:          # tinygemm is a decode kernel: 2.6 ms at M=512 already
            continue
        try:
            packs = []
            for _ in range(copies * 2):
                wint = torch.randint(0, 256, (n, k // 2), device=DEV, dtype=torch.uint8)
                packs.append((torch._convert_weight_to_int4pack(wint, 8),
                              torch.randn(k // 128, n, 2, device=DEV, dtype=torch.bfloat16)))
            us = graph_us([lambda p=p: torch._weight_int4pack_mm(a, p[0], 128, p[1]) for p in packs])
            log({**base, "kind": "tinygemm_g128", "us": round(us, 2),
                 "GBps": round(n * k * (0.5 + 4 / 128) / us / 1e3, 1), "TFLOPs": round(2 * m * n * k / us / 1e6, 1)})
            del packs
        except Exception as ex:
            log({**base, "kind": "tinygemm_g128", "error": repr(ex)[:200]})
        torch.cuda.empty_cache()


def dense_lanes(base, a, n, k, m, group, copies):
    """A lane-layout linear (random words): every dense instance of the CUDA kernel up to
    LANE_LINEAR_MAX_ROWS rows ("picked" marks cuda_lanes.pick_dense), and the public
    kq.kernels.w4a16_linear at every M (the CUDA kernel, or Triton's LANE mode / dequantise + cuBLAS)."""
    from kq.kernels import LANE_LINEAR_MAX_ROWS, cuda_lanes, w4a16_linear
    try:
        bpw = 0.5 + 2 / group
        kb = -(-k // PACK_K)
        ws = [random_lane_linear(n, k, group) for _ in range(copies)]
        if m <= LANE_LINEAR_MAX_ROWS:
            pick = cuda_lanes.pick_dense(m, n // 8, kb)
            for v in cuda_lanes.DENSE_VARIANTS:
                us = graph_us([lambda w=w: cuda_lanes.linear(a, w, v) for w in ws])
                log({**base, "kind": f"lanes_dense_g{group}_{cuda_lanes.dense_variant_name(v)}", "us": round(us, 2),
                     "GBps": round(n * k * bpw / us / 1e3, 1), "picked": v == pick})
        us = graph_us([lambda w=w: w4a16_linear(a, w) for w in ws])
        log({**base, "kind": f"kq_lane_g{group}", "us": round(us, 2), "GBps": round(n * k * bpw / us / 1e3, 1),
             "TFLOPs": round(2 * m * n * k / us / 1e6, 1)})
        if m < kops.DEQUANT_GEMM_MIN_M:     # Triton's LANE mode (forced: a lane linear dequantises from 32 rows)
            us = graph_us([lambda w=w: kops.w4a16_linear(a, w, dequant_min_m=kops.DEQUANT_GEMM_MIN_M) for w in ws])
            log({**base, "kind": f"kq_lane_triton_g{group}", "us": round(us, 2),
                 "GBps": round(n * k * bpw / us / 1e3, 1),
                 "cfg": kops.dense_config(m, n, k, kops._num_sms(a.device)).__dict__})
            us = graph_us([lambda w=w: kops.w4a16_linear(a, w, dequant_min_m=1) for w in ws])
            log({**base, "kind": f"kq_lane_dequant_g{group}", "us": round(us, 2),
                 "GBps": round(n * k * bpw / us / 1e3, 1)})
        del ws
    except Exception as ex:
        traceback.print_exc()
        log({**base, "kind": f"kq_lane_g{group}", "error": repr(ex)[:300]})


MOE_SHAPES = {  # name: (E, H, I)
    "kimi_tp8": (384, 7168, 256),
    "glm52": (256, 6144, 2048),
    "kimi": (384, 7168, 2048),
    "glm47": (160, 5120, 1536),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--tokens", default="1,16,64")
    ap.add_argument("--moe", default="kimi_tp8,glm52")
    ap.add_argument("--groups", default="32,128")
    ap.add_argument("--peers", default="dense,triton,marlin",
                    help="comma list of dense, triton, fp8, marlin (gate+up and the whole fused_marlin_moe), "
                         "marlin-stage (gate+up only)")
    ap.add_argument("--dense-m", default="1,16,64,512,4096")
    ap.add_argument("--sweep", action="store_true", help="also try a grid of kq tile configs (stage 1)")
    ap.add_argument("--skip-dense", action="store_true")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--no-kq", action="store_true", help="peers only")
    ap.add_argument("--warm-marlin", action="store_true")
    ap.add_argument("--tag", default="")
    ap.add_argument("--lanes", action="store_true", help="also time the CUDA decode MoE")
    ap.add_argument("--picked-only", action="store_true", help="of the CUDA kernel's instances, only the picked one")
    ap.add_argument("--no-tiles", action="store_true", help="no MoE rows of the Triton kernel on the tiles layout")
    ap.add_argument("--states", default="burst,sustained", help="GPU states, each a whole pass: burst, sustained")
    ap.add_argument("--idle-s", type=float, default=1.0, help="burst: seconds idle before each timing")
    ap.add_argument("--heat-s", type=float, default=2.0, help="sustained: seconds of back-to-back replay first")
    ap.add_argument("--variants", default="", help="A/B of tile-config changes, comma list of: "
                    + ",".join(VARIANTS) + " (replaces the --sweep for kq's rows)")
    args = ap.parse_args()
    AB[:] = [v for v in args.variants.split(",") if v]
    LANES[:] = [True] if args.lanes else []
    PICKED_ONLY[:] = [True] if args.picked_only else []
    NO_TILES[:] = [True] if args.no_tiles else []
    states = [st for st in args.states.split(",") if st]
    if not states or set(states) - {"burst", "sustained"}:
        ap.error(f"--states {args.states!r}: a comma list of burst, sustained")
    STATE.update(idle_s=args.idle_s, heat_s=args.heat_s)
    for v in AB:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    peers = set(p for p in args.peers.split(",") if p)
    groups = [int(g) for g in args.groups.split(",")]
    torch.manual_seed(0)
    env = run_env()
    if args.warm_marlin:            # compile SGLang's JIT Marlin kernels (minutes) and exit
        STATE.update(idle_s=0.0, heat_s=0.0)
        for m in (1, 4):            # the single-token and the general sorting, both stages' instances
            tis, tw = routings(8, m, 2, 1), torch.rand(m, 2, device=DEV)
            a = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)
            for group in groups:
                sgl_marlin_stage1(8, 512, 1024, m, 2, tis, tw, a, group)
                sgl_marlin_full(8, 1024, 256, m, 2, tis, tw, a, group)
        print("marlin warm", flush=True)
        return
    cp, rd = bandwidth_tbps()
    env["copy_TBps_rw"], env["read_TBps"] = round(cp, 3), round(rd, 3)
    env["states"] = {"names": states, "idle_s": args.idle_s, "heat_s": args.heat_s}
    print(json.dumps(env), flush=True)
    for state in states:
        STATE["name"] = state
        run_pass(args, peers, groups)
    with open(os.path.join(args.out, f"kernels_bench{args.tag}.json"), "w") as f:
        json.dump({"env": env, "rows": ROWS}, f, indent=1)
    print_table(env)


def run_pass(args, peers, groups) -> None:
    """Every case once, in the current STATE."""
    for m in [] if args.skip_moe else [int(t) for t in args.tokens.split(",")]:
        for name in args.moe.split(","):
            e, h, i = MOE_SHAPES[name]
            try:
                moe_case(name, e, h, i, m, 8, groups, peers, args.sweep, kq=not args.no_kq)
            except Exception as ex:
                traceback.print_exc()
                log({"case": name, "M": m, "error": repr(ex)[:300]})
    if not args.skip_dense:
        dm = [int(t) for t in args.dense_m.split(",")]
        for name, n, k, ms in [("dense_12288x6144", 12288, 6144, dm), ("kimi_gate_up_4096x7168", 4096, 7168, [1, 8, 32]),
                               ("kimi_down_7168x2048", 7168, 2048, [1])]:
            try:
                dense_case(name, n, k, ms, peers, kq=not args.no_kq, sweep=args.sweep)
            except Exception as ex:
                traceback.print_exc()
                log({"case": name, "error": repr(ex)[:300]})


def print_table(env):
    print(f"\n{env['gpu']} driver {env['driver']} torch {env['torch']} triton {env['triton']} {env['date']} "
          f"copy {env.get('copy_TBps_rw')} TB/s read {env.get('read_TBps')} TB/s")
    for r in ROWS:
        if "sweep" in r.get("kind", "") or "us" not in r:
            continue
        key = r.get("case"), r.get("M")
        kind = r["kind"] + (f" {r['variant']}/{r.get('round', '-')}" if "variant" in r else "")
        print(f"{r['state']:9s} {key[0]:24s} M={key[1]:<5} {kind:30s} {r['us']:9.2f} us  {r.get('GBps', 0):7.1f} GB/s")


if __name__ == "__main__":
    main()
