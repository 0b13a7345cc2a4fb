"""CUDA fused MoE for decode on Hopper: kq/kernels/cuda/moe_lanes*.{cuh,cu,cpp} built with torch's
extension loader on first use (sm_90a), the weights in the lane layout (lane_layout.py).

tests/test_kernels_lanes_gpu.py checks it against the torch reference, `benchmarks/bench_kernels.py
--lanes` times it beside the Triton kernel. Routing blocks hold at most 8 pairs (the kernel's mma
takes 8 activation rows), so past decode sizes each block re-reads its expert's weights (mostly
from L2: the blocks of an expert run close together): on the H200 it stays ahead of the tiles
layout's Triton kernel up to ~6 pairs per expert and reaches 0.7-0.8x of it at 16-128
(benchmarks/results/kernels.md, sixth session). A dense linear uses the same kernel (DENSE
instances, `linear`)."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from .layout import PACK_K, PrepackedLinear, PrepackedMoE

_SRC = Path(__file__).with_name("cuda")
_SOURCES = ["moe_lanes_binding.cpp", "moe_lanes_launch.cu", "moe_lanes_g128.cu", "moe_lanes_g64.cu", "moe_lanes_g32.cu"]
# (NT, KSPLIT, STAGES, FOLD) instances every group size's file builds (moe_lanes.cuh KQ_LANES_VARIANTS); KSPLIT 8
# runs 8 warps a CTA (the others 4)
GATE_UP_VARIANTS = [(1, 1, 4, True), (1, 1, 6, True), (1, 4, 4, True), (2, 1, 4, True), (1, 1, 4, False),
                    (1, 4, 4, False), (1, 8, 4, False)]
# gate+up instances whose activations go through the shared-memory ring too (XSM: 5-tuples ending in True),
# group 128 only (moe_lanes.cuh KQ_LANES_EXTRA_128)
GATE_UP_XSM_VARIANTS = [(1, 1, 4, True, True), (2, 1, 4, True, True)]
# the FOLD field's third value: the exact codes times the group scale in the weight operand (bf16), so the mma
# sums the weights straight into the accumulators (no per-group partial sums; 123-125 registers at group 32
# against 151-163, benchmarks/lanes_sass.py --fold 2); groups 32 and 64 only (moe_lanes.cuh KQ_LANES_SCALE_A)
SCALE_A = 2
GATE_UP_SCALE_A_VARIANTS = [(1, 1, 4, SCALE_A), (2, 1, 4, SCALE_A)]
DOWN_SCALE_A_VARIANTS = [(2, 1, 4, SCALE_A), (1, 1, 4, SCALE_A)]
DOWN_VARIANTS = [(2, 1, 4, True), (2, 1, 6, True), (2, 4, 4, True), (2, 1, 4, False), (1, 1, 4, True),
                 (2, 4, 4, False)]
# (NT, KSPLIT, STAGES) of the dense instances (one matrix, no routing; FOLD on): KQ_LANES_DENSE_VARIANTS;
# 4-tuples ending in True: XPRE, the block's activation rows preloaded into shared memory once (for a few
# rows: min(8, rows) x K x 2 bytes per CTA), which frees the registers of the activation sets
DENSE_VARIANTS = [(1, 1, 4), (2, 1, 4), (1, 2, 4), (2, 2, 4), (1, 4, 4), (2, 4, 4), (2, 4, 6), (2, 4, 8), (2, 2, 8),
                  (1, 4, 4, True), (1, 2, 4, True), (2, 4, 4, True)]
# pick_dense takes XPRE up to this many rows, while they take at most XPRE_MAX_BYTES of shared memory
# per CTA (beside the ring: a K of 16k inputs at 2 rows; a row takes moe_lanes.cuh's xpre_row_bytes)
XPRE_MAX_ROWS, XPRE_MAX_BYTES = 2, 64 << 10
# the MoE grid's y dimension holds the routing blocks (8 pairs each): CUDA's limit
MAX_BLOCKS = 65535
# warps resident with the XSM instances' larger ring slots: 3 CTAs of 4 warps per multiprocessor at one
# tile pair per warp (64 KB of ring each), 2 at two (96 KB)
XSM_RESIDENT = {1: 132 * 12, 2: 132 * 8}
# 12 warps on each of an H200's 132 multiprocessors: pick's split threshold is half of this, set from
# the measured rows (Kimi TP-8 at 1 token: 128 warps, split 4 ways 2.5x faster; GLM-5.2 at 1 token:
# 1024 warps, no split as fast; benchmarks/results/kernels.md, fifth session)
SMS_WARPS = 132 * 12


def build(name: str = "kq_moe_lanes", defines: tuple[str, ...] = ()):
    """The extension built (or loaded from TORCH_EXTENSIONS_DIR) under `name`; `defines` (-D flags) make
    a compile-time variant for benchmarks/lanes_ab.py under a name of its own."""
    from torch.utils.cpp_extension import load
    return load(name=name, sources=[str(_SRC / f) for f in _SOURCES], extra_include_paths=[str(_SRC)],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", *defines], verbose=False)


@functools.cache
def _ext():
    return build()


def pick(pairs: int, experts: int, n_tiles: int, kb: int, gated: bool, group: int = 128) -> tuple:
    """(NT, KSPLIT, STAGES, FOLD[, XSM]) for a stage, from host-side sizes only (no routing data: graph
    capture). Each rule comes from the instance rows of H200 runs (benchmarks/results/h200/
    kernels_s5_0242e99.jsonl, kernels_s6_79490cf.jsonl, kernels_s6_decode_dd9b8b5.jsonl, and the seventh
    session's lanes_ab rows, lanes_ab_s7_6885996.jsonl):
    - split K 4 ways when fewer than half a wave of warps would be resident and each keeps >= 4
      blocks (Kimi TP-8 at 1 token: 12.4 against 31 us); for gate+up 8 ways (8-warp CTAs) where the 8-way
      split still fits one wave (Kimi TP-8 at 1 token, 128 one-pair warps: 10.0-10.2 against 12.0-12.1 us
      at group 128, 10.7 against 12.6 at 32; tenth session, h200/lanes_ab_s10_call7_k8_a581af0.jsonl;
      GLM-4.7 at 1 token, 768 warps, keeps 4 ways: 25.1 against 35.8 us, call 9, lanes_ab_s10_call9_*; the
      down stage's 8-way instance was 1.9-9x slower wherever it ran, and is not built);
    - gate+up at group 128, up to about four waves of one-pair warps: the XSM instances (activations
      through the ring), two tile pairs per warp where one pair per warp would just not fit one wave
      of them but two do (GLM-5.2 1 token: 32.1 against 33.7 us; Kimi TP-8 16 tokens: 60.0 against
      64.9; 64 tokens: 143.6 against 151.5; GLM-5.2 16 tokens, ten waves: 327.1 against 326.0, so not
      there);
    - gate+up otherwise: two tile pairs per warp when one pair per warp would spill just past one
      wave and two fit in it (Kimi TP-8, 16 tokens, group 32: 72.4-72.8 against 83.9-84.5 us), and past
      twelve waves (GLM-5.2, 64 tokens: 20.7 / 15.5 waves at group 32 / 128; in the seven decode tables
      of the eighth to tenth sessions, benchmarks/results/h200/kernels_s{8,9,10}_decode_*.jsonl, two pairs
      ran group 32 1-5 % faster in all seven, 811.5-902.2 against 853.7-910.8 us, and group 128 0.8 %
      faster on average, faster in four, level in one, 0.4-0.8 % slower in two; at 16 tokens, 7.8 /
      10.3 waves, one pair is as fast or faster; above decode sizes, unmeasured, one pair as before), below
      group 128 only, and only where there are at least two pairs per expert (twelfth session, with Kimi
      K2's full experts, h200/kernels_s12_decode_*_call{1..5}.jsonl and kernels_s12_t128_*_call{3,4}.json:
      at group 32 two pairs won 1.0-3.4 % at GLM-5.2 64 tokens, 2 pairs per expert, five calls, and Kimi K2
      128 tokens, 2.7, two calls, won 1.6 % and lost 10 % at GLM-5.2 128 tokens, 4, and lost 7-11 % at Kimi
      K2 64 tokens, 1.3 pairs per expert, 1325.2-1410.8 against 1224.3-1301.5 us one pair without FOLD; at
      group 128 they won 0.5-2.4 % at GLM-5.2 128 tokens, were about level at GLM-5.2 64 tokens, 718.0-747.0
      against 724.4-777.5, faster in three calls, slower in two, and lost 7-19 % at Kimi K2 64 tokens,
      1176.3-1392.1 against 1088.2-1166.5, and 1.6-8 % at 128 tokens); FOLD
      off up to four waves of warps (GLM-5.2, 1 token: 33.6-34.0 against 36.8-36.9 us at group 128,
      39.3-39.7 against 41.2-41.7 at 32; since FOLD off lost its idle per-group add, tenth session,
      benchmarks/results/h200/lanes_ab_s10_call1_fold2_833fe7d.jsonl: Kimi TP-8 64 tokens group 32, 3.9
      waves, 156.8-157.6 against 164.9-166.2; GLM-5.2 16 tokens at ten waves 378.1-378.8 against
      379.4-383.9, at 64 tokens, twenty waves, 891.7-899.6 against 839.9-841.7, so not there), and at
      group 32 past four waves too where one tile pair per warp runs with fewer than two pairs per expert
      (the decode tables of the tenth to twelfth sessions, kernels_s1{0,1,2}_decode_*.jsonl: GLM-5.2 16
      tokens faster in 8 of 11, 368.7-396.6 against 378.4-404.5 us, 0.1-3.5 % slower in the other three;
      Kimi K2 16 / 64 tokens 467.3-467.5 / 1224.3-1246.4 against 483.0-483.7 / 1268.3-1270.0, GLM-4.7 16
      tokens 207.2-208.2 against 215.3-215.8; at GLM-5.2 64 tokens, 2 pairs per expert, one pair without
      FOLD was 1-17 % slower in every table, so not there; group 128 keeps FOLD on: GLM-5.2 and Kimi K2
      16 tokens 1-3 % slower without it; group 64 unmeasured, as before); SCALE_A
      is not taken for gate+up (eleventh session: at GLM-5.2 16 tokens, group 32, faster than the FOLD
      instance in four of five timings by 0.4-8 % and 3.6 % slower in the fifth, 365.8 / 399.3 / 372.2 /
      396.1 / 392.8 against 390.0 / 403.8 / 404.5 / 397.5 / 379.0 us, lanes_ab_s11_call2_scale_a_c582066.jsonl
      and kernels_s11_decode_*_call{3,7,4}.jsonl; slower at Kimi TP-8 64 tokens, 169.7-173.7 against
      157.0-159.7, level at 16 tokens, mixed at GLM-5.2 64 tokens);
    - down: FOLD off (GLM-5.2, 64 tokens, group 128: 365.8-375.9 against 390.9-398.4 us; at group 32,
      since the idle add went, faster in all six cases of the same call: GLM-5.2 1 / 16 / 64 tokens
      20.6 / 193.6 / 415.5 against 21.3 / 198.7 / 424.5, Kimi TP-8 16 / 64 tokens 55.6 / 144.9 against
      56.1 / 146.6, 1 token 8.6 both); at group 32 without a K split, SCALE_A (the scales in the weight
      operand: 124 registers against 151, four CTAs per multiprocessor instead of three; eleventh session,
      benchmarks/results/h200/lanes_ab_s11_call2_scale_a_c582066.jsonl, two rounds: Kimi TP-8 16 / 64
      tokens 47.8-48.1 / 122.0 against 55.6-55.9 / 145.4-145.8 us, GLM-5.2 16 tokens 190.0-190.7 against
      193.6-194.0, 64 tokens 400.1 / 433.1 against 475.5 / 421.9; calls 3, 4 and 7 of the decode table,
      kernels_s11_decode_*_call{3,4,7}.jsonl: Kimi TP-8 1 / 16 / 64 tokens 7.5 / 47.9-48.4 / 120.5-122.5
      against 8.5-8.7 / 55.7-56.7 / 142.9-145.8, GLM-5.2 16 tokens 190.3-193.6 against 194.8-197.7, 64 tokens
      425.7-428.4 against 417.9-488.1; GLM-5.2 at 1 token 21.8-21.9 against 21.0-21.1, the one case
      slower)."""
    resident = 132 * 16 if group == 128 else SMS_WARPS      # 120 registers at group 128, up to 168 below
    def split(w):                # 8 ways (8-warp CTAs) where that still fits one wave, each part >= 4 blocks
        if gated and 8 * w <= SMS_WARPS and kb >= 32:
            return 8
        return 4 if w < SMS_WARPS // 2 and kb >= 16 else 1
    nt = 1 if gated else 2
    warps = min(pairs, experts) * -(-n_tiles // (2 * nt))
    if gated and group == 128 and split(warps) == 1 and warps <= 4 * XSM_RESIDENT[1]:
        if XSM_RESIDENT[1] < warps <= 2 * XSM_RESIDENT[2]:
            return 2, 1, 4, True, True
        return 1, 1, 4, True, True
    # measured at decode sizes only (moe_routing.decode_size: <= 4 pairs per expert; not imported, it needs triton)
    past_12_waves = group < 128 and warps > 12 * resident and 2 * experts <= pairs <= 4 * experts
    if gated and (resident < warps <= 2 * resident or past_12_waves):
        nt, warps = 2, warps // 2
    ks = split(warps)
    if group == 32 and ks == 1 and not gated:
        return nt, 1, 4, SCALE_A
    fold = gated and not (nt == 1 and (warps <= 4 * resident or group == 32 and pairs < 2 * experts))
    return nt, ks, 4, fold


def pick_stage(pairs: int, experts: int, hidden: int, intermediate: int, gated: bool, group: int = 128) -> tuple:
    """pick for one stage of a MoE of these sizes, with the arguments _run takes from the prepacked tensors:
    gate+up's outputs in tiles of 8 over the intermediate size and its K blocks over the hidden size, down's
    the other way round (what the benchmarks mark as picked)."""
    n, k = (intermediate, hidden) if gated else (hidden, intermediate)
    return pick(pairs, experts, n // 8, -(-k // PACK_K), gated, group)


def variant_name(v: tuple) -> str:
    """A MoE instance's name in benchmark rows: n<NT>k<KSPLIT>s<STAGES>, "nf" appended when FOLD is off,
    "sa" for SCALE_A, "x" for the XSM instances (dense instances: dense_variant_name)."""
    fold = "" if len(v) < 4 or v[3] == 1 else "sa" if v[3] == SCALE_A else "nf"     # True == 1
    return f"n{v[0]}k{v[1]}s{v[2]}{fold}{'x' if len(v) > 4 and v[4] else ''}"


def stage_variants(gated: bool, group: int) -> list[tuple]:
    """Every instance the extension builds for a stage at a group size."""
    if gated:
        return GATE_UP_VARIANTS + (GATE_UP_XSM_VARIANTS if group == 128 else GATE_UP_SCALE_A_VARIANTS)
    return DOWN_VARIANTS + ([] if group == 128 else DOWN_SCALE_A_VARIANTS)


def dense_variant_name(v: tuple) -> str:
    """A dense instance's name in benchmark rows: n<NT>k<KSPLIT>s<STAGES>, "p" appended for XPRE."""
    return f"n{v[0]}k{v[1]}s{v[2]}{'p' if len(v) > 3 and v[3] else ''}"


def pick_dense(rows: int, n_tiles: int, kb: int) -> tuple:
    """(NT, KSPLIT, STAGES[, XPRE]) for a dense linear, rows in blocks of 8: split K as far as one wave of
    warps (SMS_WARPS) holds, each part keeping >= 4 blocks; one tile pair per warp when two pairs would
    leave even the 4-way split under half a wave. From the dense instance rows of four H200 calls (seventh
    session, benchmarks/results/h200/kernels_s7_decode_*.jsonl; each picks the fastest instance in all
    four): 4096x7168 at M = 1 10.2-10.5 us against 11.2-11.5 (one pair per warp), at M = 32 22.0-22.2
    against 25.3-25.6 (2-way split), 12288x6144 at M = 16 26.1-26.4 against 27.2-27.5; unchanged where
    the earlier rule was already the fastest (12288x6144 at M = 1, 8, 64; 7168x2048 at M = 1).
    Up to 2 rows, the same instance with its activations preloaded (XPRE) where one is built (eighth
    session, benchmarks/results/h200/lanes_ab_s8_*.jsonl): 12288x6144 at M = 1 15.8 us against 16.7,
    4096x7168 at M = 1 10.7 against 12.1 and at M = 2 11.3 against 12.5; at M = 8 XPRE is slower (31.3
    against 18.0 us: 8 rows x K in shared memory leave two CTAs per multiprocessor)."""
    r8 = -(-rows // 8)
    nt, warps = 2, r8 * -(-n_tiles // 4)
    if 4 * warps <= SMS_WARPS // 2:
        nt, warps = 1, r8 * -(-n_tiles // 2)
    ks = 4 if 4 * warps <= SMS_WARPS and kb >= 16 else 2 if 2 * warps <= SMS_WARPS and kb >= 8 else 1
    if rows <= XPRE_MAX_ROWS and rows * (kb * 256 + 32) <= XPRE_MAX_BYTES and (nt, ks, 4, True) in DENSE_VARIANTS:
        return nt, ks, 4, True
    return nt, ks, 4


def available(device: torch.device) -> bool:
    """The kernel is built for Hopper (sm_90a) only, and needs nvcc for its first build; elsewhere
    (or when the build fails, which is said once on stderr) the Triton kernel serves."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) and _builds()


@functools.cache
def _builds() -> bool:
    try:
        _ext()
    except Exception as ex:       # no nvcc, no ninja, a compiler error: fall back, do not fail serving
        print(f"kq: the CUDA lane-layout kernel did not build ({type(ex).__name__}: {str(ex)[:200]}); "
              f"the Triton kernel serves instead", file=sys.stderr)
        return False
    return True


def _run(a, q, s, out, routing, K, n_tiles, n_tiles_all, up_tiles, a_row_div, gated, group, variant, experts):
    pairs, be, bs, bc = routing
    nt, ks, stages, fold, *xsm = variant or pick(pairs.numel(), experts, n_tiles, q.shape[2], gated, group)
    rc = _ext().launch(a, q, s, out, pairs, be, bs, bc, K, n_tiles, n_tiles_all, up_tiles, a_row_div,
                       int(gated), group, nt, ks, stages, int(fold), int(bool(xsm and xsm[0])))
    if rc != 0:
        raise RuntimeError(f"kq_moe_lanes_launch failed ({rc})")


def moe_gate_up(x, lm: PrepackedMoE, routing, top_k: int, variant: tuple | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """act[p] = silu(x[p // k] W_gate^T) * (x[p // k] W_up^T); variant (NT, KSPLIT, STAGES, FOLD[, XSM]) or
    picked."""
    act = out if out is not None else torch.empty(routing[0].numel(), lm.intermediate, dtype=x.dtype, device=x.device)
    t = lm.intermediate // 8
    _run(x, lm.w13_q, lm.w13_s, act, routing, lm.hidden, t, 2 * t, t, top_k, True, lm.group, variant,
         lm.num_experts)
    return act


def moe_down(act, lm: PrepackedMoE, routing, variant: tuple | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """y[p] = act[p] W_down^T."""
    y = out if out is not None else torch.empty(act.shape[0], lm.hidden, dtype=act.dtype, device=act.device)
    t = lm.hidden // 8
    _run(act, lm.w2_q, lm.w2_s, y, routing, lm.intermediate, t, t, 0, 1, False, lm.group, variant,
         lm.num_experts)
    return y


def fused_moe_lanes(x: torch.Tensor, pp: PrepackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """x [T, H] bf16 -> [T, H] bf16 with pp in the lane layout; the maths of
    kq.kernels.reference.fused_moe_w4a16 (pairs whose expert the map sends to -1 add nothing)."""
    from .triton_ops import combine_topk, moe_align
    if not pp.lane:
        raise ValueError("fused_moe_lanes: the experts must be prepacked with lane=True")
    k = topk_ids.shape[1]
    x = x.contiguous()
    routing = moe_align(topk_ids, pp.num_experts, 8, expert_map)
    y = moe_down(moe_gate_up(x, pp, routing, k), pp, routing)
    return combine_topk(y, topk_ids, topk_weights, expert_map, routed_scaling_factor)


def linear(x: torch.Tensor, w: PrepackedLinear, variant: tuple | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T for a lane-layout linear (prepack_linear(lane=True)); x [M, K] bf16 contiguous, any
    M (each block of 8 rows reads the weights again: 16 rows took 1.7x the time of 8 on the H200);
    variant (NT, KSPLIT, STAGES[, XPRE]) or picked (pick_dense)."""
    if not w.lane:
        raise ValueError("cuda_lanes.linear: the weight must be prepacked with lane=True")
    m = x.shape[0]
    y = out if out is not None else torch.empty(m, w.out_features, dtype=x.dtype, device=x.device)
    nt, ks, stages, *xpre = variant or pick_dense(m, w.q.shape[0], w.q.shape[1])
    rc = _ext().launch_dense(x, w.q, w.s, y, w.in_features, w.group, nt, ks, stages, int(bool(xpre and xpre[0])))
    if rc != 0:
        raise RuntimeError(f"kq_dense_lanes_launch failed ({rc})")
    return y
