"""W4A8 fused MoE for prefill: INT4 experts (the lane layout the decode path holds, group 128) times
per-token dynamic FP8 activations, on FP8 tensor cores (kernels: w4a8_rs.py, the default on Hopper, with the
weights as wgmma's register operand; w4a8_kernel.py, the Triton kernel, and the quantisation kernel).

    fused_moe_w4a8(x [T, H] bf16, pp: PrepackedMoE (lane, group 128), topk_weights [T, k] f32,
                   topk_ids [T, k] int32, *, expert_map=None, routed_scaling_factor=1.0) -> [T, H] bf16

Steps: x quantised per token (scale = row amax / 448, e4m3, written in the lane layout's input order);
routing table (moe_routing, as the W4A16 path); gate+up with SiLU*mul -> bf16 [P, I]; that quantised per
routed pair the same way; down -> [P, H]; the W4A16 path's top-k combine. `reference` is the same maths
in torch (float64 products of the e4m3-rounded activations and the exact weights), which the tests
compare against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import PACK_K, PrepackedMoE

GROUP = 128


@dataclass(frozen=True)
class W4A8Config:
    block_m: int
    block_n: int
    num_warps: int = 8
    num_stages: int = 3
    cvt: int = 1            # w4a8_kernel's int4 -> e4m3 conversion (0 plain ops, 1 byte permutes, 2 offset bytes);
                            # 3: w4a8_rs.py, the weights as wgmma's register operand (offset bytes; block_m
                            # routed rows, block_n output columns: 32 (gate+up) or 64 (down) per warpgroup)
    maxnreg: int | None = None  # register cap per thread (168: three programs a multiprocessor)


def serves(pp: PrepackedMoE, device: torch.device) -> bool:
    """Whether fused_moe_w4a8 runs compiled for this layer and device: lane layout, group 128, a GPU
    with FP8 tensor cores reached through wgmma (Hopper, sm_90)."""
    if not (pp.lane and pp.group == GROUP and device.type == "cuda"):
        return False
    from . import triton_available
    return triton_available() and torch.cuda.get_device_capability(device)[0] == 9


def block_scales(pp: PrepackedMoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The group scales as the kernel reads them, (w13 [E, KB, 2I], w2 [E, KB, H]) bf16, N contiguous:
    one row of a 128-input block is one vectorised load (the lane layout keeps a column's groups
    together instead). Made once per layer at load time: 1/32 of the INT4 weights' bytes."""
    _check(pp)
    return tuple(s.reshape(s.shape[0], -1, s.shape[-1]).transpose(1, 2).contiguous() for s in (pp.w13_s, pp.w2_s))


def configs(pairs: int, num_experts: int) -> tuple[W4A8Config, W4A8Config]:
    """(gate+up, down) tiles of the register-operand kernel (cvt 3, w4a8_rs.py), from the H200 sweeps
    (benchmarks/w4a8_bench.py --sweep, GLM-5.2 at 2048, 4096 and 16384 tokens; rows in
    benchmarks/results/h200/w4a8_rs_sweeps_*.jsonl): routed blocks of 64 rows in both stages (one routing
    table; 32-row blocks were faster for down alone at 4096 tokens but a second table cost more than they
    saved); down on four warpgroups (256 columns) with a four-slot ring; gate+up likewise (128 outputs)
    up to ~256 pairs an expert, on two warpgroups (64) with three slots past it (at 16384 tokens, 512 an
    expert: 0.96x the four-warpgroup time; at 4096, 1.08x)."""
    if pairs >= 256 * num_experts:
        return W4A8Config(64, 64, 8, 3, 3), W4A8Config(64, 256, 16, 4, 3)
    return W4A8Config(64, 128, 16, 4, 3), W4A8Config(64, 256, 16, 4, 3)


def _check(pp: PrepackedMoE) -> None:
    if not pp.lane or pp.group != GROUP:
        raise ValueError(f"fused_moe_w4a8: needs the lane layout at group {GROUP} (got lane={pp.lane}, "
                         f"group {pp.group})")


# ---------------------------------------------------------------- activation order and quantisation

def lane_order(k: int, cvt: int = 1) -> torch.Tensor:
    """[Kp] long: input index held at each position of the kernel's activation order for conversion `cvt`
    (the lane layout's storage order inside every 128-input block; for cvt 2 each word's nibbles in the
    order 0, 2, 4, 6, 1, 3, 5, 7; for cvt 3 wgmma's register fragment order, w4a8_rs.py); positions past
    k (padding) hold -1."""
    from .lane_layout import _index
    kp = -(-k // PACK_K) * PACK_K
    block = _index()                                   # [t, wd, J]
    if cvt == 2:
        block = block[..., [0, 2, 4, 6, 1, 3, 5, 7]]
    elif cvt == 3:                                     # position 32s + 16h + 4t + i: nibble 2i + h of word (t, s)
        block = block.permute(1, 0, 2).reshape(4, 4, 4, 2).permute(0, 3, 1, 2)
    idx = (torch.arange(0, kp, PACK_K)[:, None] + block.reshape(1, -1)).reshape(-1)
    return torch.where(idx < k, idx, torch.full_like(idx, -1))


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic FP8 in natural order: (q e4m3 [rows, K], scale f32 [rows]), q * scale ~ x."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp(min=1e-10) / 448.0
    return (xf / scale[:, None]).to(torch.float8_e4m3fn), scale


def quantize_rows(x: torch.Tensor, cvt: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [rows, K] -> (q e4m3 [rows, Kp] in the kernel's activation order for conversion `cvt`, scale f32
    [rows], and for cvt 2 and 3 the block sums of q / 64 f32 [rows, Kp/128], else None); CUDA: one Triton
    kernel, else torch (the same values)."""
    rows, k = x.shape
    kp = -(-k // PACK_K) * PACK_K
    r = torch.empty(rows, kp // PACK_K, dtype=torch.float32, device=x.device) if cvt >= 2 else None
    if x.is_cuda:
        import triton

        from .w4a8_kernel import quant_rows_kernel
        q = torch.empty(rows, kp, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            rr = r if r is not None else s
            quant_rows_kernel[(rows,)](x, x.stride(0), q, q.stride(0), s, rr, rr.stride(0), k, KP=kp,
                                       BLOCK=triton.next_power_of_2(kp), ORDER=max(cvt, 1),
                                       num_warps=8)
        return q, s, r
    qn, s = quantize_rows_reference(x)
    order = lane_order(k, cvt).to(x.device)
    q = torch.zeros(rows, kp, dtype=torch.float8_e4m3fn, device=x.device)
    valid = order >= 0
    q[:, valid] = qn[:, order[valid]]
    if r is not None:
        r.copy_(q.float().view(rows, -1, PACK_K).sum(-1) / 64)
    return q, s, r


# ---------------------------------------------------------------- the op

def fused_moe_w4a8(x: torch.Tensor, pp: PrepackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   *, expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   config: tuple[W4A8Config, W4A8Config] | None = None) -> torch.Tensor:
    """Routed-expert MoE with FP8 activations (see the module doc); CUDA on Hopper (`serves`), else the
    torch reference. `scales`: block_scales(pp), made here when not given."""
    _check(pp)
    if x.dim() != 2 or x.shape[1] != pp.hidden:
        raise ValueError(f"fused_moe_w4a8: x must be [T, {pp.hidden}], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe_w4a8: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, k]")
    if not serves(pp, x.device):
        return reference(x, pp, topk_weights, topk_ids, expert_map=expert_map,
                         routed_scaling_factor=routed_scaling_factor)
    from .triton_ops import combine_topk, moe_align

    t, h = x.shape
    k = topk_ids.shape[1]
    c1, c2 = config or configs(t * k, pp.num_experts)
    s13, s2 = scales if scales is not None else block_scales(pp)
    xq = quantize_rows(x.contiguous(), c1.cvt)
    r1 = moe_align(topk_ids, pp.num_experts, c1.block_m, expert_map)
    act = gate_up(xq, pp, s13, r1, k, c1)
    # rows of pairs with no local expert were never written: their codes are never read (the down
    # stage reads routed pairs only)
    aq = quantize_rows(act, c2.cvt)
    r2 = r1 if c2.block_m == c1.block_m else moe_align(topk_ids, pp.num_experts, c2.block_m, expert_map)
    y = down(aq, pp, s2, r2, c2)
    return combine_topk(y, topk_ids, topk_weights, expert_map, routed_scaling_factor)


def _launch(aq, q, s, out, routing, n, a_row_div, gated, up_offset, cfg: W4A8Config):
    import triton

    a, a_s, r = aq
    if (r is not None) != (cfg.cvt >= 2):
        raise ValueError(f"w4a8: activations quantised for another conversion than cvt {cfg.cvt}")
    r = r if r is not None else a_s.view(-1, 1)
    kb = q.shape[2]
    grid = (triton.cdiv(n, cfg.block_n), routing[1].numel())
    args = (a, a.stride(0), a_s, r, r.stride(0), q, q.stride(0), s, s.stride(0), s.stride(1), out, out.stride(0),
            *routing, n, kb, up_offset)
    opts = {"num_warps": cfg.num_warps, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})}
    if cfg.cvt == 3:
        wg = cfg.num_warps // 4
        if cfg.num_warps not in (4, 8, 16) or cfg.block_n != (32 if gated else 64) * wg:
            raise ValueError(f"w4a8: the register-operand kernel takes 4, 8 or 16 warps and {32 if gated else 64} "
                             f"output columns per warpgroup, got {cfg}")
        from .w4a8_rs import w4a8_rs_kernel
        w4a8_rs_kernel[grid](*args, A_ROW_DIV=a_row_div, GATED=gated, BLOCK_T=cfg.block_m, WG=wg,
                             STAGES=cfg.num_stages, KB_MAX=max(16, triton.next_power_of_2(kb)), **opts)
    else:
        from .w4a8_kernel import w4a8_moe_kernel
        w4a8_moe_kernel[grid](*args, A_ROW_DIV=a_row_div, GATED=gated, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                              CVT=cfg.cvt, num_stages=cfg.num_stages, **opts)


def gate_up(xq, pp: PrepackedMoE, s13, routing, top_k: int, cfg: W4A8Config) -> torch.Tensor:
    """Stage 1 on quantize_rows' output (for cfg.cvt): act[p] = silu(gate_e(x[p // k])) * up_e(x[p // k]),
    [P, I] bf16."""
    i = pp.intermediate
    act = torch.empty(routing[0].numel(), i, dtype=torch.bfloat16, device=xq[0].device)
    _launch(xq, pp.w13_q, s13, act, routing, i, top_k, True, i, cfg)
    return act


def down(aq, pp: PrepackedMoE, s2, routing, cfg: W4A8Config) -> torch.Tensor:
    """Stage 2 on quantize_rows' output: y[p] = act[p] @ down_e^T, [P, H] bf16 (rows of pairs with no
    local expert unwritten)."""
    y = torch.empty(aq[0].shape[0], pp.hidden, dtype=torch.bfloat16, device=aq[0].device)
    _launch(aq, pp.w2_q, s2, y, routing, pp.hidden, 1, False, 0, cfg)
    return y


def reference(x: torch.Tensor, pp: PrepackedMoE, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              *, expert_map: torch.Tensor | None = None, routed_scaling_factor: float = 1.0) -> torch.Tensor:
    """The kernel's maths in torch: e4m3 activations (per row) times the exact INT4 weights in float64,
    the SiLU*mul output rounded to bf16 and quantised per routed pair, top-k weighted sum."""
    from .lane_layout import dequantize_lane
    _check(pp)
    t, h = x.shape
    k = topk_ids.shape[1]
    ids = topk_ids.long()
    if expert_map is not None:
        m = expert_map.to(ids.device).long()
        ids = torch.where(ids >= 0, m[ids.clamp(min=0)], ids)
    xq, xs = quantize_rows_reference(x)
    xd = xq.double() * xs.double()[:, None]
    out = torch.zeros(t, h, dtype=torch.float64, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        w13 = dequantize_lane(pp.w13_q[e:e + 1], pp.w13_s[e:e + 1], h, pp.group, torch.float64)[0]
        w2 = dequantize_lane(pp.w2_q[e:e + 1], pp.w2_s[e:e + 1], pp.intermediate, pp.group, torch.float64)[0]
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        gu = xd[tok] @ w13.T
        g, u = gu[:, : pp.intermediate], gu[:, pp.intermediate:]
        act = (g * torch.sigmoid(g) * u).to(torch.bfloat16)
        aq, a_s = quantize_rows_reference(act)
        y = (aq.double() * a_s.double()[:, None]) @ w2.T
        y = y.to(torch.bfloat16).double()           # the kernel writes the down rows in bf16
        out.index_add_(0, tok, y * topk_weights[tok, j].double()[:, None])
    return (out * routed_scaling_factor).to(x.dtype)
