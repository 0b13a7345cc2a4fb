"""Launch wrappers for the Triton W4A16 ops: the dense linear and the fused MoE.

No host synchronisation and no allocation whose size depends on routing data: every buffer
and grid is sized from (T, top_k, E, shapes), so a call can be captured in a CUDA graph.
Tile configs come from a fixed heuristic (no autotuning at run time); `config` lets the
benchmark try others.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from .gemm_kernel import dequant_kernel, dequant_lane_kernel, splitk_reduce_kernel, w4a16_gemm_kernel
from .swap_kernel import w4a16_swap_kernel
from .layout import PACK_K, PrepackedLinear, PrepackedMoE
from .moe_combine import combine_topk_kernel
from .moe_routing import (decode_size, max_blocks, moe_align_kernel, moe_chunk_blocks_kernel, moe_chunk_count_kernel,
                          moe_chunk_scatter_kernel)


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fold: bool | None = None    # codes enter the dot as q + 136 (gemm_kernel's FOLD); None: group >= 64
    masks: bool = False         # keep the K/N load masks even where they are idle (A/B runs; see _launch_gemm)
    swap: bool = False          # dense only: swap_kernel (weights as wgmma's A operand, Hopper); then block_n
                                # is the weight rows and block_m the activation rows of a program


def _fold(cfg: TileConfig, group: int, deq: int) -> bool:
    """FOLD pays off once a group spans >= 2 of the 32-input dots (SASS counts in gemm_kernel's
    doc); the bf16 wgmma path (DEQ 1) has no fold."""
    if deq == 1:
        return False
    return group >= 64 if cfg.fold is None else cfg.fold


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def _split_for(programs: int, kblocks: int, sms: int, waves: int = 2) -> int:
    """Split K until the grid covers the SMs `waves` times, keeping >= 2 K blocks per split."""
    split = 1
    while programs * split < waves * sms and kblocks % (split * 2) == 0 and kblocks // (split * 2) >= 2:
        split *= 2
    return split


# Above this many rows a dense W4A16 linear dequantises the weight to bf16 once and calls
# cuBLAS: the GEMM is compute-bound there, and cuBLAS's wgmma pipeline beats dequantising
# inside every tile (H200, 12288x6144, M=512: 149 us against 1663 us for the best Triton tile).
DEQUANT_GEMM_MIN_M = 256


def dense_config(m: int, n: int, k: int, sms: int, swap: bool = False) -> TileConfig:
    """Tiles picked from H200 sweeps. Up to 16 rows BLOCK_M 16 and
    up to 32 rows BLOCK_M 32 on mma.sync; above, with `swap` (Hopper, tiles layout), swap_kernel, the
    weights as wgmma's A operand: 64 or 128 activation rows by 128 weight rows (two warpgroups of
    64), split over K until the grid covers the SMs twice up to 64 rows (12288x6144 at M = 64: 32.3
    against 44.6 us on mma.sync, cuBLAS BF16 40.4); else BLOCK_M 32
    on mma.sync (BLOCK_M 64 in gemm_kernel takes Triton's wgmma path with the weights through shared
    memory, 5-10x slower)."""
    kblocks = -(-k // PACK_K)
    if m <= 16:     # BLOCK_N 128 with the split sized for 64-wide tiles: 12288x6144 M=1 18.2 vs 22.1 us
        return TileConfig(16, 128, _split_for(triton.cdiv(n, 64), kblocks, sms, waves=4))
    if swap and m > 32:
        bm = 64 if m <= 64 else 128
        programs = triton.cdiv(m, bm) * triton.cdiv(n, 128)
        split = _split_for(programs, kblocks, sms) if m <= 64 else 1
        # a 64 x 128 program takes 82 KB of shared memory at 3 stages (2 per SM) and 58 KB at 2 (3 per
        # SM): 2 stages where that makes the grid one wave (Nsight Compute, 12288x6144 at M = 64: 384
        # programs were 1.45 waves at 3 stages)
        stages = 2 if 2 * sms < programs * split <= 3 * sms else 3
        return TileConfig(bm, 128, split, num_warps=8, num_stages=stages, swap=True)
    return TileConfig(32, 128, _split_for(triton.cdiv(m, 32) * triton.cdiv(n, 128), kblocks, sms))


def swap_serves(device: torch.device, w: PrepackedLinear) -> bool:
    """swap_kernel needs wgmma (Hopper: sm_90) and the tiles layout."""
    return (device.type == "cuda" and not _INTERPRETED and not w.lane
            and torch.cuda.get_device_capability(device)[0] == 9)


def moe_configs(pairs: int, e: int, h: int, i: int, sms: int, group: int = 128) -> tuple[TileConfig, TileConfig]:
    """(gate+up config, down config) for `pairs` = tokens * top_k routed over `e` experts.

    Decode (<= 4 pairs per expert on average): BLOCK_M 16, gate+up split over K until the
    grid covers the SMs twice; down with BLOCK_N 128 at group >= 64 (64 at group 32, whose
    per-group scale work favours narrower tiles). Above: BLOCK_M 16 x BLOCK_N 128 on the mma.sync
    path, down BLOCK_M 32 from 64 pairs per expert (H200, benchmarks/moe_prefill_probe.py: GLM-5.2
    4096 tokens gate+up 7.9 ms, down 4.2 ms; BLOCK_M 64, Triton's wgmma path with plain bf16 ops, took
    58.9 ms for gate+up)."""
    if decode_size(pairs, e):
        split1 = _split_for(max_blocks(pairs, e, 16) * triton.cdiv(i, 64), -(-h // PACK_K), sms)
        return TileConfig(16, 64, split1), TileConfig(16, 128 if group >= 64 else 64, 1)
    return TileConfig(16, 128), TileConfig(32 if pairs >= 64 * e else 16, 128)


def _lane_strides(q, s, kblocks: int) -> tuple[int, int, int, int]:
    """(expert, n-tile) strides of lane words [E, N/8, KB, 8, 4, 4] and (expert, column) strides of
    lane scales [E, N/8, 8, Gp]: what LANE mode reads through stride_qe/stride_qk/stride_se/stride_sg.
    The kernel addresses inside an n-tile with fixed offsets, so those dims must be packed."""
    if q.dim() != 6 or q.shape[2] != kblocks or q.stride()[2:] != (128, 16, 4, 1):
        raise ValueError(f"lane words {tuple(q.shape)} strides {q.stride()}: expected packed "
                         f"[E, N/8, {kblocks}, 8, 4, 4] (lane_layout.lane_pack)")
    if s.dim() != 4 or s.stride(3) != 1 or s.stride(1) != 8 * s.stride(2):
        raise ValueError(f"lane scales {tuple(s.shape)} strides {s.stride()}: expected [E, N/8, 8, Gp] "
                         f"with a column's groups contiguous")
    return q.stride(0), q.stride(1), s.stride(0), s.stride(2)


def _blocks_per_split(k: int, cfg: TileConfig) -> int:
    """The 128-input blocks each K split of `cfg` covers (both GEMM kernels take it); refuses a split that
    does not divide them."""
    kblocks = -(-k // PACK_K)
    if kblocks % cfg.split_k:
        raise ValueError(f"split_k {cfg.split_k} does not divide the {kblocks} K blocks of {PACK_K}")
    return kblocks // cfg.split_k


def _launch_gemm(a, q, s, out, k, n, group, cfg: TileConfig, *, rows=0, routing=None, a_row_div=1,
                 gated=False, up_offset=0, lane=False):
    """lane: q, s in the lane layout ([E, ...]; a dense linear's with E = 1); up_offset is up's first
    column in either layout."""
    kblocks = -(-k // PACK_K)
    per_split = _blocks_per_split(k, cfg)
    if routing is None:
        pairs = blk_e = blk_s = blk_c = q                  # unused pointers in the dense case
        m_blocks = triton.cdiv(rows, cfg.block_m)
    else:
        pairs, blk_e, blk_s, blk_c = routing
        m_blocks = blk_e.numel()
    if lane:
        qe, qk, se, sg = _lane_strides(q, s, kblocks)
    else:
        qe = q.stride(0) if q.dim() == 3 else 0
        se = s.stride(0) if s.dim() == 3 else 0
        qk, sg = q.stride(-2), s.stride(-2)
    grid = (triton.cdiv(n, cfg.block_n), m_blocks, cfg.split_k)
    # see w4a16_gemm_kernel: Triton takes wgmma (DEQ 1) from 64 rows on warpgroups of 4 warps (unless
    # DISABLE_MMA_V3 is set, benchmarks/dense_tiles_probe.py), mma.sync below
    wgmma = cfg.block_m >= 64 and cfg.num_warps % 4 == 0 and os.environ.get("DISABLE_MMA_V3") != "1"
    deq = 0 if _INTERPRETED else (1 if wgmma else 2)
    fold = _fold(cfg, group, deq)
    even = not cfg.masks and (fold or _INTERPRETED)     # the interpreter checks both paths at every group
    w4a16_gemm_kernel[grid](
        a, a.stride(0), q, qe, qk, s, se, sg,
        out, out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        pairs, blk_e, blk_s, blk_c,
        rows, n, k, up_offset, per_split,
        A_ROW_DIV=a_row_div, GROUP=group, DENSE=routing is None, GATED=gated,
        SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        FOLD=fold,
        # the unmasked loads only beside FOLD: measured slower at group 32 (gemm_kernel's doc)
        EVEN_K=even and k % PACK_K == 0, EVEN_N=even and n % cfg.block_n == 0,
        DEQ=deq, LANE=lane, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _launch_swap(a, q, s, out, k, n, group, cfg: TileConfig, rows: int):
    """swap_kernel on a tiles-layout matrix: out [rows, n], or [split, rows, n] fp32 partial sums."""
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(rows, cfg.block_m), cfg.split_k)
    w4a16_swap_kernel[grid](
        a, a.stride(0), q, q.stride(0), s, s.stride(0),
        out, out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        rows, n, k, _blocks_per_split(k, cfg),
        GROUP=group, SPLIT_K=cfg.split_k, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
        EVEN_K=not cfg.masks and k % PACK_K == 0, EVEN_N=not cfg.masks and n % cfg.block_n == 0,
        ASM=not _INTERPRETED, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _reduce(part, out, rows, n, gated):
    block = 256
    splitk_reduce_kernel[(rows, triton.cdiv(n, block))](
        part, part.stride(0), part.stride(1), out, out.stride(0), rows, n,
        SPLIT_K=part.shape[0], GATED=gated, BLOCK=block)


def dequantize(w: PrepackedLinear) -> torch.Tensor:
    """W^T as bf16 [K, N] (N contiguous)."""
    k, n = w.in_features, w.out_features
    wt = torch.empty(k, n, dtype=torch.bfloat16, device=w.q.device)
    block_n = 128
    grid = (triton.cdiv(n, block_n), -(-k // PACK_K))
    if w.lane:
        dequant_lane_kernel[grid](w.q, w.q.stride(0), w.s, w.s.stride(1), wt, wt.stride(0), n, k, GROUP=w.group,
                                  BLOCK_N=block_n)
    else:
        dequant_kernel[grid](w.q, w.q.stride(0), w.s, w.s.stride(0), wt, wt.stride(0), n, k, GROUP=w.group,
                             BLOCK_N=block_n)
    return wt


# A lane-layout linear goes to dequantise + cuBLAS from this many rows: Triton's LANE mode is the
# slower path on a dense matrix (H200, 12288x6144: 58 / 139 / 533 us at M = 8 / 32 / 128 against
# 98 / 99 / 97 us dequantised)
LANE_DEQUANT_MIN_M = 32


def w4a16_linear(x: torch.Tensor, w: PrepackedLinear, *, config: TileConfig | None = None,
                 dequant_min_m: int | None = None) -> torch.Tensor:
    """x [..., K] bf16 -> [..., N] bf16 on CUDA."""
    k, n = w.in_features, w.out_features
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if dequant_min_m is None:
        dequant_min_m = LANE_DEQUANT_MIN_M if w.lane else DEQUANT_GEMM_MIN_M
    if config is None and m >= dequant_min_m:
        return (x2 @ dequantize(w)).reshape(*x.shape[:-1], n)
    cfg = config or dense_config(m, n, k, _num_sms(x.device), swap=swap_serves(x.device, w))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if cfg.swap and w.lane:
        raise ValueError("swap configs read the tiles layout; this weight is in the lane layout")
    # the lane layout is the MoE's [E, ...] with one expert
    q, s = (w.q.unsqueeze(0), w.s.unsqueeze(0)) if w.lane else (w.q, w.s)
    target = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    if cfg.swap:
        _launch_swap(x2, q, s, target, k, n, w.group, cfg, rows=m)
    else:
        _launch_gemm(x2, q, s, target, k, n, w.group, cfg, rows=m, lane=w.lane)
    if cfg.split_k > 1:
        _reduce(target, out, m, n, gated=False)
    return out.reshape(*x.shape[:-1], n)


# From this many routed pairs moe_align counts, sorts and scatters chunks instead of running one program an expert
# over all pairs (whose cost grows as E x P: ~370 us of kq's W4A8 MoE at GLM-5.2 16384 tokens, H200 profile)
SORTED_ALIGN_MIN_PAIRS = 8192


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None):
    """Device-side routing table (see moe_routing.py): (pairs, blk_expert, blk_start, blk_count)."""
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    p = ids.numel()
    nb = max_blocks(p, num_experts, block_m)
    dev = ids.device
    pairs = torch.empty(p, dtype=torch.int32, device=dev)
    blk_e = torch.empty(nb, dtype=torch.int32, device=dev)
    blk_s = torch.empty(nb, dtype=torch.int32, device=dev)
    blk_c = torch.empty(nb, dtype=torch.int32, device=dev)
    has_map = expert_map is not None
    emap = expert_map.to(device=dev, dtype=torch.int32).contiguous() if has_map else ids
    e_pad = triton.next_power_of_2(num_experts + 1)
    if p < SORTED_ALIGN_MIN_PAIRS:
        # every program reads all pairs twice, 256 a step (2048 from 8192 pairs, where a raised
        # SORTED_ALIGN_MIN_PAIRS sends prefill sizes: benchmarks/moe_align_check.py times both)
        chunk = 256 if p < 8192 else 2048
        moe_align_kernel[(num_experts + 1,)](
            ids, emap, p, num_experts, nb, pairs, blk_e, blk_s, blk_c,
            HAS_MAP=has_map, E_PAD=e_pad, CHUNK=chunk, BLOCK_M=block_m,
            num_warps=4 if chunk == 256 else 8)
        return pairs, blk_e, blk_s, blk_c
    # prefill sizes: chunks counted, sorted and scattered (moe_routing.py), O(P) work in three launches
    chunk = 1024
    n_chunks = triton.cdiv(p, chunk)
    counts = torch.empty(n_chunks, e_pad, dtype=torch.int32, device=dev)
    moe_chunk_count_kernel[(n_chunks,)](ids, emap, p, counts, HAS_MAP=has_map, E_PAD=e_pad, CHUNK=chunk, num_warps=4)
    moe_chunk_scatter_kernel[(n_chunks,)](ids, emap, p, counts, n_chunks, pairs, HAS_MAP=has_map, E_PAD=e_pad,
                                          CHUNK=chunk, num_warps=8)
    moe_chunk_blocks_kernel[(num_experts + 1,)](counts, n_chunks, num_experts, nb, blk_e, blk_s, blk_c,
                                                E_PAD=e_pad, CHUNK=256, BLOCK_M=block_m, num_warps=4)
    return pairs, blk_e, blk_s, blk_c


# (device, k) -> (arange(k), ones(k)) int32: the constant half of one token's routing table
_ONE_TOKEN: dict = {}


def one_token_routing(topk_ids: torch.Tensor):
    """The routing table of a single token without a kernel launch, or None where it does not apply.

    One token's k pairs go to k different experts, so grouping by expert leaves one pair a block
    whatever the order: pair j is block j, of count 1, of expert topk_ids[0, j] (a -1 id makes the
    block unused, as moe_align does). blk_expert is topk_ids itself (int32, read where it lies); pairs
    and blk_start are arange(k), blk_count ones(k), made once per device and k. The kernels read the
    same weights as from moe_align's table (which holds the same blocks, in expert order), and a decode
    step of one token saves moe_align's launch. Applies to int32 contiguous ids of one token; the
    constant tensors are not made during CUDA-graph capture (their memory would belong to the graph's
    pool), so a first call under capture gets None: SGLang runs each batch size before capturing it."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != 1 or topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        return None
    k = topk_ids.shape[1]
    key = (topk_ids.device, k)
    if key not in _ONE_TOKEN:
        if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        _ONE_TOKEN[key] = (torch.arange(k, dtype=torch.int32, device=topk_ids.device),
                           torch.ones(k, dtype=torch.int32, device=topk_ids.device))
    ar, ones = _ONE_TOKEN[key]
    return ar, topk_ids.view(-1), ar, ones


def route(topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None):
    """The fused MoE's routing table: one_token_routing where it applies (no expert map), else moe_align."""
    one = one_token_routing(topk_ids) if expert_map is None else None
    return one if one is not None else moe_align(topk_ids, num_experts, block_m, expert_map)


def moe_gate_up(x, pp: PrepackedMoE, routing, top_k: int, cfg: TileConfig) -> torch.Tensor:
    """Stage 1: act[p] = silu(x[p // k] @ gate_e^T) * (x[p // k] @ up_e^T), [P, I] bf16."""
    p = routing[0].numel()
    h, i = pp.hidden, pp.intermediate
    act = torch.empty(p, i, dtype=x.dtype, device=x.device)
    if cfg.split_k == 1:
        _launch_gemm(x, pp.w13_q, pp.w13_s, act, h, i, pp.group, cfg, routing=routing, a_row_div=top_k,
                     gated=True, up_offset=i, lane=pp.lane)
    else:
        part = torch.empty(cfg.split_k, p, 2 * i, dtype=torch.float32, device=x.device)
        _launch_gemm(x, pp.w13_q, pp.w13_s, part, h, i, pp.group, cfg, routing=routing, a_row_div=top_k,
                     gated=True, up_offset=i, lane=pp.lane)
        _reduce(part, act, p, i, gated=True)
    return act


def moe_down(act, pp: PrepackedMoE, routing, cfg: TileConfig) -> torch.Tensor:
    """Stage 2: y[p] = act[p] @ down_e^T, [P, H] bf16 (rows of pairs with no local expert unwritten)."""
    p = act.shape[0]
    y = torch.empty(p, pp.hidden, dtype=act.dtype, device=act.device)
    _launch_gemm(act, pp.w2_q, pp.w2_s, y, pp.intermediate, pp.hidden, pp.group, cfg, routing=routing,
                 lane=pp.lane)
    return y


def fused_moe_w4a16(x: torch.Tensor, pp: PrepackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    *, expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                    configs: tuple[TileConfig, TileConfig] | None = None) -> torch.Tensor:
    """x [T, H] bf16 -> [T, H] bf16 on CUDA; see kq.kernels.reference.fused_moe_w4a16 for the maths."""
    t, h = x.shape
    k = topk_ids.shape[1]
    x = x.contiguous()
    cfg1, cfg2 = configs or moe_configs(t * k, pp.num_experts, h, pp.intermediate, _num_sms(x.device), pp.group)
    r1 = route(topk_ids, pp.num_experts, cfg1.block_m, expert_map)
    act = moe_gate_up(x, pp, r1, k, cfg1)
    r2 = r1 if cfg2.block_m == cfg1.block_m else route(topk_ids, pp.num_experts, cfg2.block_m, expert_map)
    y = moe_down(act, pp, r2, cfg2)
    return combine_topk(y, topk_ids, topk_weights, expert_map, routed_scaling_factor)


def combine_topk(y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 expert_map: torch.Tensor | None, routed_scaling_factor: float) -> torch.Tensor:
    """out[t] = scaling * sum_j w[t, j] * y[t * k + j] over the pairs with a local expert; [T, H]."""
    t, k = topk_ids.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    ids = topk_ids.to(torch.int32).contiguous()
    emap = expert_map.to(device=y.device, dtype=torch.int32).contiguous() if expert_map is not None else ids
    block = 512
    combine_topk_kernel[(t, triton.cdiv(h, block))](
        y, ids, emap, topk_weights.contiguous(), out, h, float(routed_scaling_factor),
        TOPK=k, HAS_MAP=expert_map is not None, BLOCK=block)
    return out
