"""CUDA fused MoE for decode on Hopper: kq/kernels/cuda/moe_lanes*.{cuh,cu,cpp} built with torch's
extension loader on first use (sm_90a), the weights in the lane layout (lane_layout.py). Routing blocks
hold at most 8 pairs (the kernel's mma takes 8 activation rows). A dense linear uses the same kernel
(the dense instances, `linear`). The compiled instances are the rows of lanes_variants.py; `pick` and
`pick_dense` choose one from host-side sizes only; docs/kernels.md gives each rule's measurements."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from .lanes_variants import DENSE_INSTANCES, SCALE_A, moe_instances
from .layout import PACK_K, PrepackedLinear, PrepackedMoE

_SRC = Path(__file__).with_name("cuda")
_SOURCES = ["moe_lanes_binding.cpp", "moe_lanes_launch.cu", "moe_lanes_g128.cu", "moe_lanes_g64.cu", "moe_lanes_g32.cu"]
# (NT, KSPLIT, STAGES, FOLD[, XSM]) instances of each stage (lanes_variants.py says what the fields are)
GATE_UP_VARIANTS = [v for v in moe_instances("gate_up", 64) if len(v) == 4 and v[3] != SCALE_A]
GATE_UP_XSM_VARIANTS = [v for v in moe_instances("gate_up", 128) if len(v) > 4]
GATE_UP_SCALE_A_VARIANTS = [v for v in moe_instances("gate_up", 32) if v[3] == SCALE_A]
DOWN_VARIANTS = [v for v in moe_instances("down", 64) if v[3] != SCALE_A]
DOWN_SCALE_A_VARIANTS = [v for v in moe_instances("down", 32) if v[3] == SCALE_A]
DENSE_VARIANTS = list(DENSE_INSTANCES)
# pick_dense takes XPRE up to this many rows, while they take at most XPRE_MAX_BYTES of shared memory
# per CTA (beside the ring: a K of 16k inputs at 2 rows; a row takes moe_lanes.cuh's xpre_row_bytes)
XPRE_MAX_ROWS, XPRE_MAX_BYTES = 2, 64 << 10
# the MoE grid's y dimension holds the routing blocks (8 pairs each): CUDA's limit
MAX_BLOCKS = 65535
# warps resident with the XSM instances' larger ring slots: 3 CTAs of 4 warps per multiprocessor at one
# tile pair per warp (64 KB of ring each), 2 at two (96 KB)
XSM_RESIDENT = {1: 132 * 12, 2: 132 * 8}
# 12 warps on each of an H200's 132 multiprocessors: one wave; pick's 4-way split threshold is half of it
SMS_WARPS = 132 * 12


def build(name: str = "kq_moe_lanes"):
    """The extension built (or loaded from TORCH_EXTENSIONS_DIR) under `name`."""
    from torch.utils.cpp_extension import load
    return load(name=name, sources=[str(_SRC / f) for f in _SOURCES], extra_include_paths=[str(_SRC)],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)


@functools.cache
def _ext():
    return build()


def pick(pairs: int, experts: int, n_tiles: int, kb: int, gated: bool, group: int = 128) -> tuple:
    """(NT, KSPLIT, STAGES, FOLD[, XSM]) for a stage, from host-side sizes only (no routing data: graph
    capture). The rules, in order (docs/kernels.md, "Instances and picks", gives the rows behind each):
    1. gate+up at group 128 without a K split, up to four waves of one-pair warps: the XSM instances,
       two tile pairs per warp where one pair would just not fit one wave of them but two do;
    2. gate+up: two tile pairs per warp where one pair would spill just past one wave and two fit in it,
       and, below group 128, past twelve waves with 2-4 pairs per expert;
    3. split K 8 ways (gate+up, 8-warp CTAs) where that still fits one wave and each part keeps >= 4
       blocks, else 4 ways below half a wave of warps (>= 4 blocks each);
    4. down at group 32 without a K split: SCALE_A;
    5. FOLD off for down, and for one-pair gate+up up to four waves (group 32: also past them with
       fewer than two pairs per expert); FOLD on otherwise."""
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
    leave even the 4-way split under half a wave; up to XPRE_MAX_ROWS rows, the same instance with its
    activations preloaded (XPRE) where one is built (docs/kernels.md, "Instances and picks")."""
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


# (device, stream, size) -> int32 zeros: the down stage's combine counts (moe_lanes.cuh combine_tail), which
# every launch leaves at zero; one per stream, so launches that may overlap never share one
_COUNTERS: dict = {}


def _counter(device: torch.device, n: int) -> torch.Tensor | None:
    key = (device, torch.cuda.current_stream(device).cuda_stream, n)
    if key not in _COUNTERS:
        if torch.cuda.is_current_stream_capturing():   # memory of the graph's pool: not ours to keep
            return None
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def moe_down_combined(act, lm: PrepackedMoE, routing, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      scale: float, variant: tuple | None = None) -> torch.Tensor | None:
    """One token's down stage and top-k combine in one launch: out [1, H] = scale * sum_j w_j act[j] W_e(j)^T,
    the maths and order of combine_topk; None where it does not apply (more than one token, weights not
    contiguous float32, or no count buffer yet under CUDA-graph capture): the caller runs both steps."""
    if topk_ids.shape[0] != 1 or topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        return None
    t = lm.hidden // 8
    counter = _counter(act.device, t + 16)         # column groups: at most n_tiles / 2 + one CTA's 8
    if counter is None:
        return None
    y = torch.empty(act.shape[0], lm.hidden, dtype=act.dtype, device=act.device)
    fin = torch.empty(1, lm.hidden, dtype=act.dtype, device=act.device)
    pairs, be, bs, bc = routing
    nt, ks, stages, fold, *_ = variant or pick(pairs.numel(), lm.num_experts, t, lm.w2_q.shape[2], False, lm.group)
    rc = _ext().launch_down_combine(act, lm.w2_q, lm.w2_s, y, pairs, be, bs, bc, lm.intermediate, t, lm.group, nt,
                                    ks, stages, int(fold), topk_ids, topk_weights, fin, counter, float(scale))
    if rc != 0:
        raise RuntimeError(f"kq_moe_lanes_launch (down + combine) failed ({rc})")
    return fin


def fused_moe_lanes(x: torch.Tensor, pp: PrepackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """x [T, H] bf16 -> [T, H] bf16 with pp in the lane layout; the maths of
    kq.kernels.reference.fused_moe_w4a16 (pairs whose expert the map sends to -1 add nothing). One token
    (a decode step of batch 1) takes two launches: gate+up on triton_ops.one_token_routing's table (no
    routing kernel), then down with the combine (moe_down_combined)."""
    from .triton_ops import combine_topk, route
    if not pp.lane:
        raise ValueError("fused_moe_lanes: the experts must be prepacked with lane=True")
    k = topk_ids.shape[1]
    x = x.contiguous()
    routing = route(topk_ids, pp.num_experts, 8, expert_map)
    act = moe_gate_up(x, pp, routing, k)
    if routing[1].data_ptr() == topk_ids.data_ptr():      # the one-token table (its experts are the ids)
        out = moe_down_combined(act, pp, routing, topk_ids, topk_weights, routed_scaling_factor)
        if out is not None:
            return out
    y = moe_down(act, pp, routing)
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
