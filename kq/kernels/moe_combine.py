"""Last step of the fused MoE: weight each token's top-k expert outputs and sum them.

Pairs whose expert is not on this rank (expert_map -> -1, or an id of -1) were never
computed; they are skipped here, so their (unwritten) rows are never read.  The sum runs in fp32 in a fixed
order, so results do not depend on scheduling.
"""
import triton
import triton.language as tl


@triton.jit
def combine_topk_kernel(y_ptr, ids_ptr, map_ptr, w_ptr, out_ptr, H, scale,
                        TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, n] = scale * sum_j [local(ids[t, j]) >= 0] * w[t, j] * y[t*TOPK + j, n]."""
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + t * TOPK + j)
        if HAS_MAP:                       # an id of -1 (another EP rank) must not index the map
            e = tl.load(map_ptr + e, mask=e >= 0, other=-1)
        if e >= 0:
            w = tl.load(w_ptr + t * TOPK + j).to(tl.float32)
            row = (t * TOPK + j).to(tl.int64) * H
            acc += w * tl.load(y_ptr + row + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * H + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=mask)
