"""Routing table for the fused-MoE kernels, built on the device in one launch (CUDA-graph safe).

From topk_ids [T, k] it writes, with sizes fixed by (T*k, E, BLOCK_M) alone:
    pairs      [P]     pair indices p = t*k + j, grouped by local expert (expert 0's first)
    blk_expert [MAXB]  expert of each block of <= BLOCK_M pairs, -1 for unused blocks
    blk_start  [MAXB]  first position of the block in `pairs`
    blk_count  [MAXB]  pairs in the block (1..BLOCK_M)
Experts that receive no pair get no block, so their weights are never read; pairs routed to
another rank (expert_map -> -1) get no block either.
"""
import triton
import triton.language as tl


def decode_size(num_pairs: int, num_experts: int) -> bool:
    """Decode-sized MoE step: <= 4 routed pairs per expert on average, where Triton's tile configs
    switch (triton_ops.moe_configs)."""
    return num_pairs <= 4 * num_experts


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of sum_e ceil(count_e / BLOCK_M) over any routing of num_pairs pairs."""
    return max(1, (num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)


@triton.jit
def _local_ids(ids_ptr, map_ptr, p, m, HAS_MAP: tl.constexpr):
    ids = tl.load(ids_ptr + p, mask=m, other=-1)
    if HAS_MAP:
        ids = tl.load(map_ptr + ids, mask=m & (ids >= 0), other=-1)
    return ids


@triton.jit
def moe_align_kernel(ids_ptr, map_ptr, P, E, max_blk,
                     pairs_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr,
                     HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK_M: tl.constexpr):
    """Program e < E writes expert e's blocks and pairs; program E marks the unused blocks."""
    e = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    hist = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        p = c0 + offs
        ids = _local_ids(ids_ptr, map_ptr, p, p < P, HAS_MAP)
        valid = ids >= 0
        hist += tl.histogram(tl.where(valid, ids, 0), E_PAD, mask=valid)
    nblk = (hist + BLOCK_M - 1) // BLOCK_M
    ar = tl.arange(0, E_PAD)
    if e == E:
        for b0 in range(tl.sum(nblk), max_blk, CHUNK):
            b = b0 + offs
            tl.store(blk_expert_ptr + b, tl.full((CHUNK,), -1, tl.int32), mask=b < max_blk)
        return
    cnt = tl.sum(tl.where(ar == e, hist, 0))
    if cnt == 0:
        return
    before = ar < e
    blk0 = tl.sum(tl.where(before, nblk, 0))
    seg0 = tl.sum(tl.where(before, hist, 0))
    nb = (cnt + BLOCK_M - 1) // BLOCK_M
    for b0 in range(0, nb, CHUNK):
        b = b0 + offs
        m = b < nb
        tl.store(blk_expert_ptr + blk0 + b, tl.full((CHUNK,), 0, tl.int32) + e, mask=m)
        tl.store(blk_start_ptr + blk0 + b, seg0 + b * BLOCK_M, mask=m)
        tl.store(blk_count_ptr + blk0 + b, tl.minimum(cnt - b * BLOCK_M, BLOCK_M), mask=m)
    running = seg0
    for c0 in range(0, P, CHUNK):
        p = c0 + offs
        ids = _local_ids(ids_ptr, map_ptr, p, p < P, HAS_MAP)
        hit = (ids == e).to(tl.int32)
        pos = running + tl.cumsum(hit, axis=0) - 1
        tl.store(pairs_ptr + pos, p, mask=hit > 0)
        running += tl.sum(hit)
