"""Routing table for the fused-MoE kernels, built on the device in one launch (CUDA-graph safe).

From topk_ids [T, k] it writes, with sizes fixed by (T*k, E, BLOCK_M) alone:
    pairs      [P]     pair indices p = t*k + j, grouped by local expert (expert 0's first)
    blk_expert [MAXB]  expert of each block of <= BLOCK_M pairs, -1 for unused blocks
    blk_start  [MAXB]  first position of the block in `pairs`
    blk_count  [MAXB]  pairs in the block (1..BLOCK_M)
Experts that receive no pair get no block, so their weights are never read; pairs routed to
another rank (expert_map -> -1) get no block either. An expert's pairs are in increasing order.
Below triton_ops.SORTED_ALIGN_MIN_PAIRS one launch (moe_align_kernel); from there the chunked
kernels at the end of this file, which build the same table.
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
def _write_blocks(e, E, hist, max_blk, blk_expert_ptr, blk_start_ptr, blk_count_ptr,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    """From the experts' pair counts `hist` [E_PAD]: program e < E writes expert e's blocks, program E
    marks the unused ones."""
    offs = tl.arange(0, CHUNK)
    nblk = (hist + BLOCK_M - 1) // BLOCK_M
    ar = tl.arange(0, E_PAD)
    if e == E:
        for b0 in range(tl.sum(nblk), max_blk, CHUNK):
            b = b0 + offs
            tl.store(blk_expert_ptr + b, tl.full((CHUNK,), -1, tl.int32), mask=b < max_blk)
    else:
        cnt = tl.sum(tl.where(ar == e, hist, 0))
        blk0 = tl.sum(tl.where(ar < e, nblk, 0))
        seg0 = tl.sum(tl.where(ar < e, hist, 0))
        nb = (cnt + BLOCK_M - 1) // BLOCK_M
        for b0 in range(0, nb, CHUNK):
            b = b0 + offs
            m = b < nb
            tl.store(blk_expert_ptr + blk0 + b, tl.full((CHUNK,), 0, tl.int32) + e, mask=m)
            tl.store(blk_start_ptr + blk0 + b, seg0 + b * BLOCK_M, mask=m)
            tl.store(blk_count_ptr + blk0 + b, tl.minimum(cnt - b * BLOCK_M, BLOCK_M), mask=m)


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
    _write_blocks(e, E, hist, max_blk, blk_expert_ptr, blk_start_ptr, blk_count_ptr, E_PAD, CHUNK, BLOCK_M)
    if e == E:
        return
    ar = tl.arange(0, E_PAD)
    cnt = tl.sum(tl.where(ar == e, hist, 0))
    if cnt == 0:
        return
    running = tl.sum(tl.where(ar < e, hist, 0))
    for c0 in range(0, P, CHUNK):
        p = c0 + offs
        ids = _local_ids(ids_ptr, map_ptr, p, p < P, HAS_MAP)
        hit = (ids == e).to(tl.int32)
        pos = running + tl.cumsum(hit, axis=0) - 1
        tl.store(pairs_ptr + pos, p, mask=hit > 0)
        running += tl.sum(hit)


# ---- prefill sizes: the same table in O(P) work, three launches. moe_align_kernel's E + 1 programs each
# read every pair twice; here each of P / CHUNK programs reads its chunk: (1) the chunk's expert counts,
# (2) the chunk sorted by (expert, pair) and each pair written to its expert's segment at the offset of
# the chunks before it, (3) the blocks from the summed counts. Pairs of an expert stay in increasing order.

@triton.jit
def moe_chunk_count_kernel(ids_ptr, map_ptr, P, counts_ptr,
                           HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """counts[c, e]: pairs of chunk c routed to local expert e."""
    c = tl.program_id(0)
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = _local_ids(ids_ptr, map_ptr, p, p < P, HAS_MAP)
    valid = ids >= 0
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), tl.histogram(tl.where(valid, ids, 0), E_PAD, mask=valid))


@triton.jit
def _count_sums(counts_ptr, n_chunks, c, E_PAD: tl.constexpr):
    """(all chunks' counts, the counts of the chunks before c, chunk c's counts), each [E_PAD]."""
    ar = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    before = tl.zeros((E_PAD,), dtype=tl.int32)
    mine = tl.zeros((E_PAD,), dtype=tl.int32)
    for r in range(0, n_chunks):
        row = tl.load(counts_ptr + r * E_PAD + ar)
        total += row
        before += tl.where(r < c, row, 0)
        mine += tl.where(r == c, row, 0)
    return total, before, mine


@triton.jit
def moe_chunk_scatter_kernel(ids_ptr, map_ptr, P, counts_ptr, n_chunks, pairs_ptr,
                             HAS_MAP: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk c's pairs into `pairs`: expert e's segment starts after all pairs of experts < e, and
    chunk c's run of it after the chunks before c."""
    c = tl.program_id(0)
    total, before, mine = _count_sums(counts_ptr, n_chunks, c, E_PAD)
    # sorted position j of expert e's run in this chunk goes to base[e] + j
    base = (tl.cumsum(total, 0) - total) + before - (tl.cumsum(mine, 0) - mine)
    offs = tl.arange(0, CHUNK)
    ids = _local_ids(ids_ptr, map_ptr, c * CHUNK + offs, c * CHUNK + offs < P, HAS_MAP)
    # key = expert * CHUNK + offset (CHUNK a power of two); pairs of no local expert sort last
    key = tl.sort(tl.where(ids >= 0, ids, E_PAD - 1) * CHUNK + offs)
    ex = key // CHUNK
    local = ex < E_PAD - 1
    dest = tl.gather(base, tl.where(local, ex, 0), 0) + offs
    tl.store(pairs_ptr + dest, c * CHUNK + key % CHUNK, mask=local)


@triton.jit
def moe_chunk_blocks_kernel(counts_ptr, n_chunks, E, max_blk, blk_expert_ptr, blk_start_ptr, blk_count_ptr,
                            E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr):
    """moe_align_kernel's blocks from the chunks' counts: program e < E expert e's, program E the unused."""
    total, _, _ = _count_sums(counts_ptr, n_chunks, 0, E_PAD)
    _write_blocks(tl.program_id(0), E, total, max_blk, blk_expert_ptr, blk_start_ptr, blk_count_ptr,
                  E_PAD, CHUNK, BLOCK_M)
