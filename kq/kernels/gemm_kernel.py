"""The one Triton W4A16 GEMM kernel behind both the dense linear and the fused-MoE stages.

out[row, n] = sum_k a[a_row, k] * (nibble[k, n] - 8) * scale[k // G, n]

Rows come either straight (dense: rows pid_m*BM ..) or from a routing table (MoE: a block of
pairs that all go to one expert). Weights are in the prepacked layout of `layout.py`, or (LANE,
or a dense matrix as one expert) in the CUDA lane kernel's layout of `lane_layout.py` (see _lane_loop).

Dequantization without int->float conversions: a nibble c is or-ed into the mantissa of the
bf16 number 128.0 (bits 0x4300), which gives exactly 128 + c; one packed bf16 subtract
(HADD2.BF16, two values per instruction) of 136 = 128 + 8 leaves q exactly.  The tensor core
multiplies the exact integer codes; the group scale is applied after the dot, once per group
and output on the fp32 partial sums, not on every weight.

FOLD drops that subtract too: the dot takes the codes as 128 + nibble = q + 136, and the
136 * sum(x) they add is taken off once per group from one extra dot of x with a constant
(shared by gate and up).  At group 128 this is 64 fewer instructions per warp and K block
(390 -> 330 in the sm_90 SASS of the decode gate+up loop); at group 32
the per-group correction takes back most of it (538 -> 530), so the host turns it on for group >= 64.
EVEN_K / EVEN_N (K a multiple of 128, N of BLOCK_N) drop the K and N load masks; the row mask
stays (without it the padding rows of a decode tile, 14-15 of 16, become real activation reads).
The host sets them with FOLD only: at group 32 the unmasked loads measured 4-30 % slower on
the H200, at group 128 FOLD + EVEN 0-5 % faster.
"""
import triton
import triton.language as tl



@triton.jit
def _bf16_pairs(w, J: tl.constexpr):
    """[32, BN] int32 (row r = word r//2) -> [32, BN] bf16 holding 128 + nibble (q + 136).

    pack=2 hands the asm the two elements (k, k+1) that share one 32-bit register of the
    tensor-core fragment; both come from the same word, nibbles J and J+4 at bits 4J and
    16+4J: one shift and one lop3 ((t & 0x000F000F) | 0x43004300) make the bf16 pair."""
    if J == 0:
        c = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, 0x43004300, 0xEA;",
                                      "=r,r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
    elif J == 1:
        c = tl.inline_asm_elementwise(
            "{.reg .b32 t; shr.u32 t, $1, 4; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;}",
            "=r,r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
    elif J == 2:
        c = tl.inline_asm_elementwise(
            "{.reg .b32 t; shr.u32 t, $1, 8; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;}",
            "=r,r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        c = tl.inline_asm_elementwise(
            "{.reg .b32 t; shr.u32 t, $1, 12; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;}",
            "=r,r,r", [w], dtype=tl.bfloat16, is_pure=True, pack=2)
    return c


@triton.jit
def _dot_planes(a_base, row_mask, w, kb, j: tl.constexpr, K, acc, xoff, offs_w, F32: tl.constexpr,
                FOLD: tl.constexpr, OFFSET: tl.constexpr):
    """Plain-ops path, one nibble plane at a time: nibble j+4i of word w is input 128kb+32j+2w+i.
    With FOLD (fp32 path only) the codes enter as 136 + q; OFFSET: xoff gathers -136 * sum(x)."""
    for i in tl.static_range(2):
        kk = kb * 128 + j * 32 + i + 2 * offs_w
        x = tl.load(a_base + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
        if F32:
            if FOLD:
                c = ((w >> (4 * (j + 4 * i))) & 0xF).to(tl.float32) + 128.0
                acc = tl.dot(x.to(tl.float32), c, acc)
                if OFFSET:
                    xoff = tl.dot(x.to(tl.float32), tl.full(c.shape, -136.0, tl.float32), xoff)
            else:
                c = ((w >> (4 * (j + 4 * i))) & 0xF).to(tl.float32) - 8.0
                acc = tl.dot(x.to(tl.float32), c, acc)
        else:
            c = (((w >> (4 * (j + 4 * i))) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            acc = tl.dot(x, c - 136.0, acc)
    return acc, xoff


@triton.jit
def _lane_codes(w, shifts, BLOCK_N: tl.constexpr, F32: tl.constexpr, FOLD: tl.constexpr):
    """[4, BN] int32 words of one word column (row t = lane chunk) -> [32, BN] codes, row
    r = 8t + 2j + i holding nibble j + 4i of word t (shifts[2j + i] = 4 (j + 4i)).

    FOLD: q + 136 (the dot's extra 136 * sum(x) is taken off per group); else q. F32: fp32 (the
    interpreter); else bf16 from the plain-ops construction: a nibble or-ed into the mantissa of
    128.0 is exactly 128 + nibble (the inline-asm pairs of _bf16_pairs assume the tiles layout's
    one shift per tile, here the shift changes from row to row)."""
    c = tl.reshape((w[:, None, :] >> shifts[None, :, None]) & 0xF, (32, BLOCK_N))
    if F32:
        if FOLD:
            c = c.to(tl.float32) + 128.0
        else:
            c = c.to(tl.float32) - 8.0
    else:
        c = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        if not FOLD:
            c = c - 136.0
    return c


@triton.jit
def _lane_words(ptrs, n_mask, EVEN_N: tl.constexpr):
    if EVEN_N:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=n_mask[None, :], other=0)
    return w


@triton.jit
def _lane_scaled(acc, part, xoff, s_ptrs, n_mask, FOLD: tl.constexpr, EVEN_N: tl.constexpr):
    """acc + the group's partial sums times its scales (FOLD: with the -136 * sum(x) offset)."""
    if EVEN_N:
        sc = tl.load(s_ptrs).to(tl.float32)
    else:
        sc = tl.load(s_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    if FOLD:
        acc += (part + xoff) * sc[None, :]
    else:
        acc += part * sc[None, :]
    return acc


@triton.jit
def _lane_index(offs_n, stride_tile):
    """Where the lane layout keeps things, shared by LANE mode and dequant_lane_kernel: column n's
    word offset inside a 128-input block (n-tile (n // 8), column n % 8 of its 16 words), the
    shifts of nibbles j + 4i in code-row order m = 2j + i, and code row r = 8t + 2j + i's input
    inside its 32-input word column."""
    col_off = (offs_n // 8) * stride_tile + (offs_n % 8) * 16
    m8 = tl.arange(0, 8)
    shifts = 4 * (m8 // 2 + 4 * (m8 % 2))
    r = tl.arange(0, 32)
    k_r = 16 * ((r % 8) // 4) + 4 * (r // 8) + 2 * ((r // 2) % 2) + r % 2
    return col_off, shifts, k_r


@triton.jit
def _lane_loop(a_base, row_mask, q_base, s_base, offs_n, n_mask, K, stride_tile, stride_col, up_offset,
               kb_lo, kblocks, acc_g, acc_u, GROUP: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, FOLD: tl.constexpr, F32: tl.constexpr, EVEN_K: tl.constexpr,
               EVEN_N: tl.constexpr):
    """LANE mode's K loop (weights from lane_layout.lane_pack, the CUDA lane kernel's layout).

    Word wd of chunk t of column n in block kb sits at (n // 8) * stride_tile + kb * 128 + (n % 8) * 16
    + 4t + wd, and its nibble j + 4i is input 128 kb + 32 wd + 16 (j // 2) + 4t + 2 (j % 2) + i: so
    word column wd is exactly the 32 inputs 128 kb + 32 wd .. +31, one dot per column (activations
    gathered in the codes' row order), and a group of 32/64/128 ends after a whole column."""
    col_off, shifts, k_r = _lane_index(offs_n, stride_tile)
    up_words = (up_offset // 8) * stride_tile      # up's n-tiles follow gate's (I is a multiple of 16)
    t4 = tl.arange(0, 4)
    s_g = s_base + offs_n * stride_col
    s_u = s_base + (offs_n + up_offset) * stride_col
    COLS_PER_GROUP: tl.constexpr = GROUP // 32
    for kb_i in range(0, kblocks):
        kb = kb_lo + kb_i
        part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        xoff = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for wd in tl.static_range(4):
            w_ptrs = q_base + col_off[None, :] + (kb * 128 + 4 * t4 + wd)[:, None]      # [4, BN]
            kk = kb * 128 + 32 * wd + k_r
            if EVEN_K:
                x = tl.load(a_base + kk[None, :], mask=row_mask[:, None], other=0.0)
            else:       # inputs past K: padded weights are code 8 with scale 0, x = 0 is enough
                x = tl.load(a_base + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
            if F32:
                x = x.to(tl.float32)
            part_g = tl.dot(x, _lane_codes(_lane_words(w_ptrs, n_mask, EVEN_N), shifts, BLOCK_N, F32, FOLD),
                            part_g)
            if GATED:
                part_u = tl.dot(x, _lane_codes(_lane_words(w_ptrs + up_words, n_mask, EVEN_N), shifts, BLOCK_N,
                                               F32, FOLD), part_u)
            if FOLD:        # shared by gate and up: the same x
                xoff = tl.dot(x, tl.full((32, BLOCK_N), -136.0, x.dtype), xoff)
            if (wd + 1) % COLS_PER_GROUP == 0:
                g = (kb * 128 + wd * 32) // GROUP
                acc_g = _lane_scaled(acc_g, part_g, xoff, s_g + g, n_mask, FOLD, EVEN_N)
                part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if GATED:
                    acc_u = _lane_scaled(acc_u, part_u, xoff, s_u + g, n_mask, FOLD, EVEN_N)
                    part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                xoff = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    return acc_g, acc_u


@triton.jit
def w4a16_gemm_kernel(
    a_ptr, stride_am,                       # activations [rows, K] bf16, K contiguous
    q_ptr, stride_qe, stride_qk,            # prepacked int32 [E, Kp/8, NW], NW contiguous
    s_ptr, stride_se, stride_sg,            # scales bf16 [E, Kp/G, NW]
    out_ptr, stride_os, stride_om,          # out [SPLIT, rows_out, width], width contiguous
    pairs_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr,   # MoE routing table (unused if DENSE)
    M, N, K, up_offset, kblocks_per_split,
    A_ROW_DIV: tl.constexpr,                # MoE stage 1: a row = pair // top_k; else 1
    GROUP: tl.constexpr,
    DENSE: tl.constexpr,
    GATED: tl.constexpr,                    # w13: columns n (gate) and up_offset + n (up)
    SPLIT_K: tl.constexpr,                  # > 1: write fp32 partial sums, a reduce kernel finishes
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FOLD: tl.constexpr = False,             # codes enter the dot as q + 136 (see the module doc)
    EVEN_K: tl.constexpr = False,           # K % 128 == 0: no K mask on the activation loads
    EVEN_N: tl.constexpr = False,           # N % BLOCK_N == 0: no N mask on weight and scale loads
    DEQ: tl.constexpr = 2,                  # 2: inline-PTX pairs (mma.sync tiles, BLOCK_M < 64);
                                            # 1: plain bf16 ops (BLOCK_M >= 64, where Triton uses wgmma
                                            #    and the operand's register pairs run along N, not K);
                                            # 0: fp32 (Triton's CPU interpreter: no PTX, no bf16 dots)
    LANE: tl.constexpr = False,             # MoE weights in the lane layout (_lane_loop); then stride_qk is
                                            # the words per n-tile (KBP * 128), stride_sg the scales per
                                            # column (Gp), and up_offset still up's first column
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)

    offs_m = tl.arange(0, BLOCK_M)
    if DENSE:
        expert = tl.program_id(2) * 0          # one matrix; a tensor so .to() works in both branches
        rows = pid_m * BLOCK_M + offs_m
        row_mask = rows < M
        a_rows = rows
        out_rows = rows
    else:
        expert = tl.load(blk_expert_ptr + pid_m)
        if expert < 0:              # a block the routing did not use (grid sized for the worst case)
            return
        start = tl.load(blk_start_ptr + pid_m)
        count = tl.load(blk_count_ptr + pid_m)
        row_mask = offs_m < count
        out_rows = tl.load(pairs_ptr + start + offs_m, mask=row_mask, other=0)
        a_rows = out_rows // A_ROW_DIV

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, 16)

    q_base = q_ptr + expert.to(tl.int64) * stride_qe
    s_base = s_ptr + expert.to(tl.int64) * stride_se
    a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am          # [BM, 1] row pointers

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    SUBS_PER_GROUP: tl.constexpr = (GROUP if GROUP < 128 else 128) // 32
    offs_k32 = tl.arange(0, 32)

    kb_lo = pid_s * kblocks_per_split          # the host makes SPLIT_K divide the K blocks
    if LANE:
        acc_g, acc_u = _lane_loop(a_base, row_mask, q_base, s_base, offs_n, n_mask, K, stride_qk, stride_sg,
                                  up_offset, kb_lo, kblocks_per_split, acc_g, acc_u, GROUP, GATED, BLOCK_M,
                                  BLOCK_N, FOLD and DEQ != 1, DEQ == 0, EVEN_K, EVEN_N)
    else:
        for kb_i in range(0, kblocks_per_split):
            kb = kb_lo + kb_i
            if DEQ < 2:
                q_ptrs = q_base + (kb * 16 + offs_w)[:, None] * stride_qk + offs_n[None, :]     # [16, BN]
            else:
                # [32, BN]: row r is word r // 2, so each thread's (k, k+1) pair of the B fragment
                # sees the one word that holds both (the compiler loads it once)
                q_ptrs = q_base + (kb * 16 + offs_k32 // 2)[:, None] * stride_qk + offs_n[None, :]
            if EVEN_N:
                wg = tl.load(q_ptrs)
                if GATED:
                    wu = tl.load(q_ptrs + up_offset)
            else:
                wg = tl.load(q_ptrs, mask=n_mask[None, :], other=0)
                if GATED:
                    wu = tl.load(q_ptrs + up_offset, mask=n_mask[None, :], other=0)
            part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            xoff = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)     # FOLD: -136 * sum(x) of the group
            for j in tl.static_range(4):           # inputs 128kb + 32j .. +31, all in one group
                if DEQ < 2:
                    part_g, xoff = _dot_planes(a_base, row_mask, wg, kb, j, K, part_g, xoff, offs_w, DEQ == 0,
                                               FOLD and DEQ == 0, True)
                    if GATED:     # the same x as gate's: its offset is already in xoff
                        part_u, _unused = _dot_planes(a_base, row_mask, wu, kb, j, K, part_u, xoff, offs_w,
                                                     DEQ == 0, FOLD and DEQ == 0, False)
                else:
                    kk = kb * 128 + j * 32 + offs_k32
                    if EVEN_K:          # the row mask stays: padding rows must not cost memory traffic
                        x = tl.load(a_base + kk[None, :], mask=row_mask[:, None], other=0.0)
                    else:
                        x = tl.load(a_base + kk[None, :], mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
                    if FOLD:
                        part_g = tl.dot(x, _bf16_pairs(wg, j), part_g)
                        if GATED:
                            part_u = tl.dot(x, _bf16_pairs(wu, j), part_u)
                        xoff = tl.dot(x, tl.full((32, BLOCK_N), -136.0, tl.bfloat16), xoff)
                    else:
                        part_g = tl.dot(x, _bf16_pairs(wg, j) - 136.0, part_g)
                        if GATED:
                            part_u = tl.dot(x, _bf16_pairs(wu, j) - 136.0, part_u)
                if (j + 1) % SUBS_PER_GROUP == 0:
                    g = (kb * 128 + j * 32) // GROUP
                    folded = FOLD and DEQ != 1
                    if EVEN_N:
                        sg = tl.load(s_base + g * stride_sg + offs_n).to(tl.float32)
                    else:
                        sg = tl.load(s_base + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
                    if folded:
                        acc_g += (part_g + xoff) * sg[None, :]
                    else:
                        acc_g += part_g * sg[None, :]
                    part_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    if GATED:
                        if EVEN_N:
                            su = tl.load(s_base + g * stride_sg + up_offset + offs_n).to(tl.float32)
                        else:
                            su = tl.load(s_base + g * stride_sg + up_offset + offs_n, mask=n_mask,
                                         other=0.0).to(tl.float32)
                        if folded:
                            acc_u += (part_u + xoff) * su[None, :]
                        else:
                            acc_u += part_u * su[None, :]
                        part_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    xoff = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    o_mask = row_mask[:, None] & n_mask[None, :]
    o_ptrs = out_ptr + pid_s.to(tl.int64) * stride_os + out_rows.to(tl.int64)[:, None] * stride_om \
        + offs_n[None, :]
    if SPLIT_K > 1:
        tl.store(o_ptrs, acc_g, mask=o_mask)
        if GATED:
            tl.store(o_ptrs + N, acc_u, mask=o_mask)
    else:
        if GATED:
            y = acc_g * tl.sigmoid(acc_g) * acc_u
        else:
            y = acc_g
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def splitk_reduce_kernel(part_ptr, stride_ps, stride_pm, out_ptr, stride_om, R, N,
                         SPLIT_K: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, n] = sum_s part[s, r, n]  (GATED: silu(sum gate) * sum up, up at column N + n)."""
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.zeros((BLOCK,), dtype=tl.float32)
    u = tl.zeros((BLOCK,), dtype=tl.float32)
    base = part_ptr + r.to(tl.int64) * stride_pm
    for s in tl.static_range(SPLIT_K):
        g += tl.load(base + s * stride_ps + offs, mask=mask, other=0.0)
        if GATED:
            u += tl.load(base + s * stride_ps + N + offs, mask=mask, other=0.0)
    if GATED:
        g = g * tl.sigmoid(g) * u
    tl.store(out_ptr + r.to(tl.int64) * stride_om + offs, g.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequant_kernel(q_ptr, stride_qk, s_ptr, stride_sg, w_ptr, stride_wk, N, K,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Prepacked int4 -> bf16 W^T [K, N] (one 128-input block per program row): for large M,
    where one dequantisation pass plus a cuBLAS GEMM beats dequantising inside every tile."""
    kb = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_w = tl.arange(0, 16)
    w = tl.load(q_ptr + (kb * 16 + offs_w)[:, None] * stride_qk + offs_n[None, :], mask=n_mask[None, :], other=0)
    for j in tl.static_range(4):
        g = (kb * 128 + j * 32) // GROUP
        s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        for i in tl.static_range(2):
            kk = kb * 128 + j * 32 + i + 2 * offs_w                  # nibble j + 4i of word w
            c = ((w >> (4 * (j + 4 * i))) & 0xF).to(tl.float32) - 8.0
            tl.store(w_ptr + kk[:, None].to(tl.int64) * stride_wk + offs_n[None, :],
                     (c * s[None, :]).to(tl.bfloat16), mask=(kk < K)[:, None] & n_mask[None, :])


@triton.jit
def dequant_lane_kernel(q_ptr, stride_tile, s_ptr, stride_col, w_ptr, stride_wk, N, K,
                        GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Lane-layout int4 (lane_layout.lane_pack, one matrix) -> bf16 W^T [K, N], one 128-input
    block per program row: the large-M path of a lane-layout linear, like dequant_kernel. Word
    column wd of a block is inputs 128 kb + 32 wd .. +31 (code row r -> input k_r, as in _lane_loop)."""
    kb = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    col_off, shifts, k_r = _lane_index(offs_n, stride_tile)
    t4 = tl.arange(0, 4)
    for wd in tl.static_range(4):
        w = tl.load(q_ptr + col_off[None, :] + (kb * 128 + 4 * t4 + wd)[:, None], mask=n_mask[None, :], other=0)
        c = _lane_codes(w, shifts, BLOCK_N, True, False)                  # fp32 q
        g = (kb * 128 + wd * 32) // GROUP
        s = tl.load(s_ptr + offs_n * stride_col + g, mask=n_mask, other=0.0).to(tl.float32)
        kk = kb * 128 + wd * 32 + k_r
        tl.store(w_ptr + kk[:, None].to(tl.int64) * stride_wk + offs_n[None, :],
                 (c * s[None, :]).to(tl.bfloat16), mask=(kk < K)[:, None] & n_mask[None, :])
