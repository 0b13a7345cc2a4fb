"""The W4A8 MoE GEMM written in Gluon (Triton's explicit-layout dialect), so the weight conversion of
the next K block overlaps the tensor cores working on this one.

Same operands, maths and launch as w4a8_kernel.w4a8_moe_kernel at CVT 2 (the codes' nibbles as e4m3
bytes c * 2^-9, the offset taken off with the activations' block sums r each step). What Triton's own
pipeliner cannot do with a register-converted operand, this does by hand, per K block kb:

    barrier  (every warp has stored B[kb % 2] and finished the wgmma of kb - 1)
    cp.async the activations of block kb + STAGES - 1 into the ring slot kb - 1 freed
    wgmma (async) of A[kb] with B[kb % 2]            gate, and up when GATED
    convert the words of kb + 1 (loaded one block earlier) into B[(kb + 1) % 2]; load those of kb + 2
    wait for the wgmma; acc += (part - r) * scale

so only the fp32 rescale waits on the tensor cores. The converted tile is written as int32 words
and read by the wgmma as e4m3 through a reinterpreted view of the same 128-byte-swizzled buffer (the
swizzle moves 16-byte chunks, the same bytes either way).
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _codes_to_smem(w, buf):
    """[BLOCK_N, 16] words -> the buffer's [BLOCK_N, 32] words: low nibbles then high nibbles of each word,
    every byte an e4m3 c * 2^-9."""
    lo = w & 0x0F0F0F0F
    hi = (w >> 4) & 0x0F0F0F0F
    x = gl.join(lo, hi)
    buf.store(gl.reshape(x, [x.shape[0], 32]))


@gluon.jit
def w4a8_moe_gluon_kernel(
    a_ptr, stride_am, as_ptr, r_ptr, stride_rm, q_ptr, stride_qe, s_ptr, stride_se, stride_sk,
    out_ptr, stride_om, pairs_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr, N, KB, up_offset,
    A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PREFETCH: gl.constexpr,   # 1: block kb + 2's words loaded into registers during block kb; 0: loaded at use
):
    # one warpgroup (4 warps) per 64 rows; the weight tiles are converted once for all of them
    NW: gl.constexpr = BLOCK_M // 16
    gl.static_assert(BLOCK_M == 64 or BLOCK_M == 128, "64 or 128 rows: one or two warpgroups")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    al: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])         # [BLOCK_M, 128] e4m3, 16 B a thread
    wl: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [NW, 1], [1, 0])          # [BLOCK_N, 16] int32, 16 B a thread
    a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    b_wl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    e = gl.load(blk_expert_ptr + pid_m)
    if e < 0:
        return
    start = gl.load(blk_start_ptr + pid_m)
    cnt = gl.load(blk_count_ptr + pid_m)
    e64 = e.to(gl.int64)

    # activation rows (the A gather) in the copy layout and in the accumulator's row layout
    m_a = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, al))
    pair_a = gl.load(pairs_ptr + start + m_a, mask=m_a < cnt, other=0)
    a_ptrs = (a_ptr + (pair_a // A_ROW_DIV).to(gl.int64)[:, None] * stride_am
              + gl.arange(0, 128, layout=gl.SliceLayout(0, al))[None, :])
    m_r = gl.arange(0, BLOCK_M, layout=row_l)
    row_mask = m_r < cnt
    pair = gl.load(pairs_ptr + start + m_r, mask=row_mask, other=0)
    arow = pair // A_ROW_DIV
    r_ptrs = r_ptr + arow.to(gl.int64) * stride_rm

    # weight words: a column's 16 words of one block are contiguous; 8-column tiles of KB * 128 words
    tile_words = KB * 128
    n_w = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wl))
    n_w = gl.where(n_w < N, n_w, 0)
    w_ptrs = (q_ptr + e64 * stride_qe + ((n_w // 8) * tile_words + (n_w % 8) * 16)[:, None]
              + gl.arange(0, 16, layout=gl.SliceLayout(0, wl))[None, :])
    up_words = (up_offset // 8) * tile_words
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    n_mask = offs_n < N
    s_ptrs = s_ptr + e64 * stride_se + offs_n

    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], a_sl)
    bg_w = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, 32], b_wl)
    bg = bg_w._reinterpret(gl.float8e4nv, [2, BLOCK_N, 128], a_sl)
    if GATED:
        bu_w = gl.allocate_shared_memory(gl.int32, [2, BLOCK_N, 32], b_wl)
        bu = bu_w._reinterpret(gl.float8e4nv, [2, BLOCK_N, 128], a_sl)

    # prologue: activations of blocks 0 .. STAGES-2 in flight, block 0's weights converted, block 1's loaded
    for i in gl.static_range(STAGES - 1):
        async_copy.async_copy_global_to_shared(a_smem.index(i), a_ptrs + gl.minimum(i, KB - 1) * 128)
        async_copy.commit_group()
    _codes_to_smem(gl.load(w_ptrs), bg_w.index(0))
    nxt = gl.minimum(1, KB - 1) * 128
    wg = gl.load(w_ptrs + nxt)
    if GATED:
        _codes_to_smem(gl.load(w_ptrs + up_words), bu_w.index(0))
        wu = gl.load(w_ptrs + up_words + nxt)
    sg = gl.load(s_ptrs, mask=n_mask, other=0.0).to(gl.float32)
    if GATED:
        su = gl.load(s_ptrs + up_offset, mask=n_mask, other=0.0).to(gl.float32)
    r = gl.load(r_ptrs)

    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    acc_g = zero
    acc_u = zero
    for kb in range(0, KB):
        async_copy.wait_group(STAGES - 2)
        # the proxy fence (a MEMBAR in SASS) also waits for this thread's loads still in flight
        fence_async_shared()
        gl.thread_barrier()
        # the ring slot of block kb - 1 is free (its wgmma was waited for before the barrier)
        ahead = gl.minimum(kb + STAGES - 1, KB - 1) * 128
        async_copy.async_copy_global_to_shared(a_smem.index((kb + STAGES - 1) % STAGES), a_ptrs + ahead)
        async_copy.commit_group()
        a = a_smem.index(kb % STAGES)
        tg = warpgroup_mma(a, bg.index(kb % 2).permute((1, 0)), zero, use_acc=False, is_async=True)
        if GATED:
            tu = warpgroup_mma(a, bu.index(kb % 2).permute((1, 0)), zero, use_acc=False, is_async=True)
        # while the tensor cores run: the next block's weights into the other buffer
        nk = gl.minimum(kb + 1, KB - 1)
        if PREFETCH:
            _codes_to_smem(wg, bg_w.index((kb + 1) % 2))
            wg = gl.load(w_ptrs + gl.minimum(kb + 2, KB - 1) * 128)
        else:
            _codes_to_smem(gl.load(w_ptrs + nk * 128), bg_w.index((kb + 1) % 2))
        sg_n = gl.load(s_ptrs + nk * stride_sk, mask=n_mask, other=0.0).to(gl.float32)
        r_n = gl.load(r_ptrs + nk)
        if GATED:
            if PREFETCH:
                _codes_to_smem(wu, bu_w.index((kb + 1) % 2))
                wu = gl.load(w_ptrs + up_words + gl.minimum(kb + 2, KB - 1) * 128)
            else:
                _codes_to_smem(gl.load(w_ptrs + up_words + nk * 128), bu_w.index((kb + 1) % 2))
            su_n = gl.load(s_ptrs + up_offset + nk * stride_sk, mask=n_mask, other=0.0).to(gl.float32)
            pg, pu = warpgroup_mma_wait(0, deps=(tg, tu))
            acc_u += (pu - r[:, None]) * su[None, :]
            su = su_n
        else:
            pg = warpgroup_mma_wait(0, deps=(tg,))
        acc_g += (pg - r[:, None]) * sg[None, :]
        sg = sg_n
        r = r_n
    async_copy.wait_group(0)

    a_s = gl.load(as_ptr + arow) * 512.0          # the codes were c * 2^-9
    if GATED:
        g = acc_g * a_s[:, None]
        res = g / (1.0 + gl.exp(-g)) * (acc_u * a_s[:, None])
    else:
        res = acc_g * a_s[:, None]
    o_ptrs = out_ptr + pair.to(gl.int64)[:, None] * stride_om + offs_n[None, :]
    gl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])
