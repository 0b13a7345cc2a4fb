"""The W4A8 MoE GEMM with the weights as wgmma's register operand (Gluon): out^T = W a^T.

Why. In w4a8_kernel.py the converted weights are the dot's second operand, which wgmma reads from
shared memory only: every K block the int4 words go global -> shared -> registers -> (converted)
shared -> tensor cores, and the small 64 x 64 tiles of an expert's rows read the activations from
shared memory twice. Swapping the roles makes the weights the first operand, which wgmma takes from
registers: the converted words (two masks a word, CVT 2's offset bytes) go straight into the registers
of wgmma's A fragment, and the routed tokens become the MMA's N, read from shared memory.

The lane layout already fits the fragment. For one 64-row warpgroup tile and one k32 step, thread
(g, t) of warp w holds rows 16w + g and 16w + g + 8, inputs 4t..4t+3 and 16 + 4t..16 + 4t + 3, four
bytes a register. In the lane layout the 16 words of one column and 128-input block are contiguous
(word 4t + wd), so step s takes word (t, s) of the thread's column: its low nibbles (the bytes of
`w & 0x0F0F0F0F`) are the first register, its high nibbles the second. The activations are written in
the matching order (w4a8_kernel._k_of ORDER 3): position p = 32s + 16h + 4t + i holds the input of
nibble 2i + h of word (t, s).

Rows of a tile: for gate+up (GATED), rows 16w..16w+7 are 8 gate columns and rows 16w+8..16w+15 the
same 8 up columns, so each thread holds a gate value and its up value and SiLU*mul needs no exchange;
for down, the tile's rows are consecutive columns. Maths (CVT 2's offset bytes): per K block kb
    acc[n, m] += dot(c[n, kb] * 2^-9, a[m, kb]) * scale[n, kb]
one FFMA an accumulator element; after the loop the offset's share, sum over kb of scale[n, kb] * r[m, kb],
is taken off by one small bf16 wgmma (K = the blocks; -r as two bf16 terms, hi + lo); then the activation's
row scale times 512, as in w4a8_kernel. (Taking r off in the step cost an FADD an element and the block
sums' shared loads: the loop was 153 instructions a block and a warp, it is 94.)

Pipeline: the activations and the words of block kb + STAGES - 1 go into a cp.async ring while block
kb is computed (each thread copies exactly the 16 bytes of words it reads back); the ring is one buffer
a slot, the loop unrolled by STAGES so that each slot is a constant, which lets Triton's barrier
analysis see that the slot being refilled is not the one being read: one barrier a block, not two. The
tile's group scales are staged in shared memory once. No global load into a register is left in the K
loop: on an H200 the words loaded straight into registers two blocks ahead cost 1.13-1.29x, a scale
loaded in the step up to 1.35x (benchmarks/results/h200/w4a8_rs_sweeps_*.jsonl). The rescale moved out
of the step and the single barrier took the two stages to 0.77-0.87x their time (GLM-5.2, 2048-16384 tokens).
"""
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait


@triton.constexpr_function
def _word_layout(wg):
    """The words [64 wg, 4 (t), 4 (s)]: thread (g, t) of warp w holds rows 16w + g and 16w + g + 8, its four
    words (t, 0..3) of each (16 contiguous bytes, s fastest: one vector load or copy)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << i, 0, 0] for i in range(1 + wg.bit_length())], block_bases=[], shape=[64 * wg, 4, 4])


@gluon.jit
def _columns(r, pid_n, N, up_offset, COLS: gl.constexpr, GATED: gl.constexpr):
    """The weight column of tile row r (module doc); a row past N reads column 0 (never stored)."""
    if GATED:
        out = pid_n * COLS + (r // 16) * 8 + r % 8
        return gl.where(out < N, out, 0) + ((r // 8) % 2) * up_offset
    else:
        out = pid_n * COLS + r
        return gl.where(out < N, out, 0)


@gluon.jit
def _fragment(w, dl: gl.constexpr):
    """[ROWS, 4 (t), 4 (s)] int32 words (the word layout) -> wgmma's A operand [ROWS, 128] e4m3 in `dl`
    (k = 32s + 16h + 4t + i), with no data movement: the joins and the reshape only rename registers."""
    lo = w & 0x0F0F0F0F
    hi = (w >> 4) & 0x0F0F0F0F
    y = gl.permute(gl.join(lo, hi), (0, 2, 3, 1))               # [R, s, h, t]
    y = gl.join(y, y)
    y = gl.join(y, y)                                          # the same word four times: bytes i = 0..3
    y = gl.reshape(y, [w.shape[0], 128])
    # four copies of one word in, that word out as four e4m3 bytes (no instruction after register allocation)
    f = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [y], dtype=gl.float8e4nv, is_pure=True, pack=4)
    return gl.convert_layout(f, dl, assert_trivial=True)


@gluon.jit
def _ring(dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr, STAGES: gl.constexpr):
    """STAGES separate shared buffers (2 to 4) as a tuple."""
    gl.static_assert(STAGES >= 2 and STAGES <= 4, "a ring of 2 to 4 slots")
    b0 = gl.allocate_shared_memory(dtype, shape, layout)
    b1 = gl.allocate_shared_memory(dtype, shape, layout)
    if STAGES == 2:
        ring = (b0, b1)
    elif STAGES == 3:
        ring = (b0, b1, gl.allocate_shared_memory(dtype, shape, layout))
    else:
        ring = (b0, b1, gl.allocate_shared_memory(dtype, shape, layout), gl.allocate_shared_memory(dtype, shape, layout))
    return ring


@gluon.jit
def _issue(kb, j: gl.constexpr, w_ptrs, a_ptrs, b_smem, w_smem, zero, KB, dl: gl.constexpr, wl: gl.constexpr,
           STAGES: gl.constexpr):
    """Block kb's wgmma (ring slot j = kb % STAGES, a constant), issued async; the slot freed by block
    kb - 1 is refilled with block kb + STAGES - 1."""
    async_copy.wait_group(STAGES - 2)
    # the barrier after this wait (every thread's copies of block kb landed, block kb - 1's wgmma done
    # everywhere) is the one Triton's barrier analysis puts before the next shared access; an explicit
    # gl.thread_barrier() here made two a block (the compile test pins one, right after the wait)
    w = w_smem[j].load(wl)
    ahead = gl.minimum(kb + STAGES - 1, KB - 1)
    async_copy.async_copy_global_to_shared(b_smem[(j + STAGES - 1) % STAGES], a_ptrs + ahead * 128)
    async_copy.async_copy_global_to_shared(w_smem[(j + STAGES - 1) % STAGES], w_ptrs + ahead * 128)
    async_copy.commit_group()
    return warpgroup_mma(_fragment(w, dl), b_smem[j].permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _rescale(acc, part, kb, s_smem, row_l: gl.constexpr):
    """acc + part * scale[kb]: block kb's group scale applied (read from shared memory, staged there at
    the start; the offset's correction comes after the loop)."""
    sc = s_smem.index(kb).load(row_l).to(gl.float32)
    return acc + part * sc[:, None]


@gluon.jit
def w4a8_rs_kernel(
    a_ptr, stride_am, as_ptr,               # activations [rows, KB*128] e4m3 (ORDER 3), row scales [rows] f32
    r_ptr, stride_rm,                       # the activations' block sums / 64 [rows, KB] f32
    q_ptr, stride_qe,                       # lane words [E, N_all/8, KB, 8, 4, 4] int32
    s_ptr, stride_se, stride_sk,            # scales [E, KB, N_all] bf16
    out_ptr, stride_om,                     # out [pairs, N] bf16
    pairs_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr,
    N, KB, up_offset,
    A_ROW_DIV: gl.constexpr, GATED: gl.constexpr,
    BLOCK_T: gl.constexpr,                  # routed rows per program (wgmma N; the routing's block)
    WG: gl.constexpr,                       # warpgroups: 64 weight rows each
    STAGES: gl.constexpr,                   # ring slots (blocks STAGES - 1 ahead)
    KB_MAX: gl.constexpr,                   # KB rounded up to a power of two, 16 at least (the correction's K)
):
    ROWS: gl.constexpr = 64 * WG
    NW: gl.constexpr = 4 * WG
    COLS: gl.constexpr = ROWS // 2 if GATED else ROWS          # output columns per program
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_T, 32])
    dl: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    wl: gl.constexpr = _word_layout(WG)
    al: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])           # [BLOCK_T, 128] e4m3 copies
    b_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    tok_l: gl.constexpr = gl.SliceLayout(0, mma)

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    e = gl.load(blk_expert_ptr + pid_m)
    if e < 0:
        return
    start = gl.load(blk_start_ptr + pid_m)
    cnt = gl.load(blk_count_ptr + pid_m)
    e64 = e.to(gl.int64)

    # the routed rows: gathered into the shared ring, and in the accumulator's column layout
    t_a = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, al))
    pair_a = gl.load(pairs_ptr + start + t_a, mask=t_a < cnt, other=0)
    a_ptrs = (a_ptr + (pair_a // A_ROW_DIV).to(gl.int64)[:, None] * stride_am
              + gl.arange(0, 128, layout=gl.SliceLayout(0, al))[None, :])
    t_c = gl.arange(0, BLOCK_T, layout=tok_l)
    tok_mask = t_c < cnt
    pair = gl.load(pairs_ptr + start + t_c, mask=tok_mask, other=0)
    arow = pair // A_ROW_DIV

    # a tile row's weight column (module doc), in the word layout and in the accumulator's row layout
    col_w = _columns(gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, wl))), pid_n, N, up_offset,
                     COLS, GATED)
    tile_words = KB * 128
    t_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, wl)))
    s_w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, wl)))
    w_ptrs = (q_ptr + e64 * stride_qe + ((col_w // 8) * tile_words + (col_w % 8) * 16)[:, None, None]
              + (4 * t_w)[None, :, None] + s_w[None, None, :])

    # the ring: one buffer a slot (a tuple indexed by constants), so that Triton's barrier analysis sees
    # the slot being refilled and the slot being read as different memory and puts one barrier a block
    # (after the copies' wait) instead of two
    b_smem = _ring(gl.float8e4nv, [BLOCK_T, 128], b_sl, STAGES)
    w_smem = _ring(gl.int32, [ROWS, 4, 4], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]), STAGES)
    for i in gl.static_range(STAGES - 1):
        async_copy.async_copy_global_to_shared(b_smem[i], a_ptrs + gl.minimum(i, KB - 1) * 128)
        async_copy.async_copy_global_to_shared(w_smem[i], w_ptrs + gl.minimum(i, KB - 1) * 128)
        async_copy.commit_group()

    # the tile rows' group scales, all K blocks, staged in shared memory once: a global load in the step
    # itself waited ~L2 latency
    rl: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
    kb_r = gl.arange(0, KB_MAX, layout=gl.SliceLayout(1, rl))
    col_r = _columns(gl.arange(0, ROWS, layout=gl.SliceLayout(0, rl)), pid_n, N, up_offset, COLS, GATED)
    sv = gl.load(s_ptr + e64 * stride_se + kb_r[:, None] * stride_sk + col_r[None, :], mask=(kb_r < KB)[:, None],
                 other=0.0)
    s_all = gl.allocate_shared_memory(gl.bfloat16, [KB_MAX, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]), sv)
    s_smem = s_all._reinterpret(gl.bfloat16, [KB_MAX, ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # the offset's correction, sum over kb of scale[n, kb] * r[m, kb], is one small bf16 wgmma after the
    # loop (K = the blocks): the scales are bf16 already, -r goes in as two bf16 terms (hi + lo, ~2^-16)
    # so the step is one FFMA an element and reads no block sums
    t_r = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, rl))
    kc_r = gl.arange(0, KB_MAX, layout=gl.SliceLayout(0, rl))
    pair_r = gl.load(pairs_ptr + start + t_r, mask=t_r < cnt, other=0)
    nr = -gl.load(r_ptr + (pair_r // A_ROW_DIV).to(gl.int64)[:, None] * stride_rm + kc_r[None, :],
                  mask=(kc_r < KB)[None, :], other=0.0)
    r_hi = nr.to(gl.bfloat16)
    r_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, KB_MAX], gl.bfloat16)
    r_hs = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, KB_MAX], r_sl, r_hi)
    r_ls = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_T, KB_MAX], r_sl, (nr - r_hi.to(gl.float32)).to(gl.bfloat16))
    s_t = gl.allocate_shared_memory(gl.bfloat16, [ROWS, KB_MAX],
                                    gl.NVMMASharedLayout.get_default_for([ROWS, KB_MAX], gl.bfloat16),
                                    gl.permute(sv, (1, 0)))
    gl.thread_barrier()

    zero = gl.zeros([ROWS, BLOCK_T], gl.float32, mma)
    acc = zero
    for kb0 in range(0, KB, STAGES):
        for j in gl.static_range(STAGES):
            kb = kb0 + j
            if kb < KB:
                tok = _issue(kb, j, w_ptrs, a_ptrs, b_smem, w_smem, zero, KB, dl, wl, STAGES)
                acc = _rescale(acc, warpgroup_mma_wait(0, deps=(tok,)), kb, s_smem, row_l)
    async_copy.wait_group(0)
    mma16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                     instr_shape=[16, BLOCK_T, 16])
    acc = gl.convert_layout(acc, mma16, assert_trivial=True)
    acc = warpgroup_mma(s_t, r_hs.permute((1, 0)), acc)
    acc = warpgroup_mma(s_t, r_ls.permute((1, 0)), acc)
    acc = gl.convert_layout(acc, mma, assert_trivial=True)

    a_s = gl.load(as_ptr + arow) * 512.0           # the codes were c * 2^-9
    acc = acc * a_s[None, :]
    sl: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, NW], [0, 1])             # [COLS, BLOCK_T] stores
    if GATED:
        # rows 16w + g (gate) and 16w + 8 + g (up) of warp w: split the row bit of 8
        y = gl.permute(gl.reshape(acc, [NW, 2, 8, BLOCK_T]), (0, 2, 3, 1))
        g, u = gl.split(y)
        g = gl.reshape(g, [COLS, BLOCK_T])
        u = gl.reshape(u, [COLS, BLOCK_T])
        res = gl.convert_layout(g / (1.0 + gl.exp(-g)) * u, sl)
    else:
        res = gl.convert_layout(acc, sl)
    c_o = pid_n * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(1, sl))
    t_o = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, sl))
    pair_o = gl.load(pairs_ptr + start + t_o, mask=t_o < cnt, other=0)
    o_ptrs = out_ptr + pair_o.to(gl.int64)[None, :] * stride_om + c_o[:, None]
    gl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=(c_o < N)[:, None] & (t_o < cnt)[None, :])
