"""Triton kernels of the W4A8 prefill MoE: INT4 expert weights (lane layout, group 128) times FP8 e4m3
activations on Hopper's FP8 tensor cores (wgmma), fp32 accumulation. The GEMM here (conversions 0-2) is
no longer the default: w4a8_rs.py (conversion 3) takes the weights as wgmma's register operand and runs
its stages in 0.60-0.78x this kernel's time on an H200 (GLM-5.2, 2048-16384 tokens; w4a8_rs_sweeps_37460b8_bab47a9
.jsonl); the quantisation kernel serves both.

INT4 codes -8..7 are exact in e4m3, so a weight tile is converted to e4m3 in registers and multiplied as
is; the group scale (group = one 128-input block = one K step) multiplies each block's fp32 partial
product, and the activation's per-row scale multiplies the sum once at the end:
    out[m, n] = a_scale[m] * sum_kb wscale[n, kb] * dot(a_fp8[m, kb], codes[n, kb])

Weights are read where the decode path keeps them (lane_layout.lane_pack: words [E, N/8, KB, 8, 4, 4]):
the 16 words of one column and block are contiguous, and expanding them in storage order (word 4t + wd,
nibble J) gives the 128 inputs of the block in the order p = 32t + 8wd + J, a permutation inside the
block (lane_layout.lane_input). The activations are written in that same order by the quantisation
kernel (`quant_rows_kernel`), so both operands are plain contiguous tiles and the product is unchanged.

The int4 -> e4m3 conversion (CVT):
  0: plain Triton ops, a nibble or-ed into the fp16 number 1024 (bits 0x6400) is 1024 + c exactly, minus
     1032 leaves q, and the fp16 -> e4m3 cast (cvt.rn.satfinite.e4m3x2.f16x2, two values an instruction);
  1: inline PTX, four codes at a time by byte permutes: prmt with a table of e4m3(-8..-1) for codes 0..7
     (its sign-replicate mode gives 0xFF for codes 8..15), prmt with a table of e4m3(0..7) on the codes
     xor 8 (0x00 for codes 0..7), a prmt mask of the codes' top bits and one lop3 to pick;
  2: no conversion at all: a byte holding a code c = q + 8 in its low nibble, read as e4m3, is c * 2^-9
     exactly (bytes 0..7 are the subnormals m * 2^-9, bytes 8..15 the exponent-1 numbers (8 + m) * 2^-9),
     so `w & 0x0F0F0F0F` and `(w >> 4) & 0x0F0F0F0F` are eight e4m3 weights c * 2^-9 in three
     instructions. The tensor cores then sum a * c; with the activations' block sums
     r[m, kb] = sum(a[m, kb-block]) / 64 (written by the quantisation kernel)
         sum a * q = sum a * (c - 8) = 512 * (dot(a, c * 2^-9) - r),
     taken off each step; the 512 goes into the row scale at the end. Bytes come in the order nibbles
     0, 2, 4, 6 then 1, 3, 5, 7 of each word, so the activations are written in that order (ORDER 2 of
     quant_rows_kernel; `_k_of`).
"""
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _k_of(p, ORDER: tl.constexpr):
    """Input offset inside a 128-input block of position p (0..127): ORDER 1, the lane layout's storage
    order p = 32t + 8wd + J (lane_layout.lane_input); ORDER 2, the same words with each word's nibbles
    in the order 0, 2, 4, 6, 1, 3, 5, 7 (CVT 2's bytes); ORDER 3, p = 32s + 16h + 4t + i holding nibble
    2i + h of word (t, wd = s) (wgmma's register fragment, w4a8_rs.py)."""
    if ORDER == 3:
        t = (p // 4) % 4
        wd = p // 32
        jj = 2 * (p % 4) + (p // 16) % 2
    else:
        t = p // 32
        wd = (p // 8) % 4
        jj = p % 8
        if ORDER == 2:
            jj = 2 * (jj % 4) + jj // 4
    j = jj % 4
    i = jj // 4
    q = 4 * wd + j
    return 16 * (q // 2) + 4 * t + 2 * (q % 2) + i


@triton.jit
def quant_rows_kernel(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, r_ptr, stride_rm, K, KP: tl.constexpr,
                      BLOCK: tl.constexpr, ORDER: tl.constexpr):
    """One row: scale = amax / 448 (dynamic per-token FP8), q[p] = e4m3(x[k(p)] / scale) in the order
    ORDER (see _k_of), inputs past K (the K padding) as 0; ORDER 2 also writes r[kb] = the sum of the
    block's e4m3 values / 64 (CVT 2's offset correction)."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK)
    if ORDER == 3:
        # ORDER 3 permutes the 7 bits of a position inside its block (k = p1 + 2 p4 + 4 p2 + 8 p3 + 16 p0
        # + 32 p5 + 64 p6): the row is loaded in input order, contiguous (vectorised loads instead of a
        # gather), and permuted on chip
        x = tl.load(x_ptr + row * stride_xm + p, mask=p < K, other=0.0).to(tl.float32)
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK // 128, 2, 2, 2, 2, 2, 2, 2)), (0, 1, 2, 6, 4, 5, 7, 3)),
                       (BLOCK,))
    else:
        k = (p // 128) * 128 + _k_of(p % 128, ORDER)
        x = tl.load(x_ptr + row * stride_xm + k, mask=(k < K) & (p < KP), other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.maximum(amax, 1e-10) / FP8_MAX
    q = (x / scale).to(tl.float8e4nv)
    tl.store(q_ptr + row * stride_qm + p, q, mask=p < KP)
    tl.store(s_ptr + row, scale)
    if ORDER >= 2:
        r = tl.sum(tl.reshape(q.to(tl.float32), (BLOCK // 128, 128)), axis=1) * (1.0 / 64.0)
        kb = tl.arange(0, BLOCK // 128)
        tl.store(r_ptr + row * stride_rm + kb, r, mask=kb < KP // 128)


@triton.jit
def _spread8(x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N: tl.constexpr):
    """Eight [BLOCK_N, 16] tensors -> [BLOCK_N, 128], position 8 * word + J holding xJ; built with joins,
    so one thread holds a word's eight positions in order (no shared-memory shuffle; what pack=4 of
    the inline PTX relies on)."""
    a = tl.join(tl.join(x0, x4), tl.join(x2, x6))          # [.., 2 (J//2 %2), 2 (J//4)]
    b = tl.join(tl.join(x1, x5), tl.join(x3, x7))
    c = tl.join(a, b)                                      # [BN, 16, 2 (J//4), 2 (J//2 % 2), 2 (J % 2)]
    return tl.reshape(c, (BLOCK_N, 128))


@triton.jit
def _codes_fp8(w, BLOCK_N: tl.constexpr, CVT: tl.constexpr):
    """[BLOCK_N, 16] int32 words (one column's block) -> [BLOCK_N, 128] e4m3 q = c - 8, position
    p = 8 * word + nibble."""
    if CVT == 0:
        c = _spread8(w & 0xF, (w >> 4) & 0xF, (w >> 8) & 0xF, (w >> 12) & 0xF,
                     (w >> 16) & 0xF, (w >> 20) & 0xF, (w >> 24) & 0xF, (w >> 28) & 0xF, BLOCK_N)
        f = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        return f.to(tl.float8e4nv)
    elif CVT == 2:
        # the codes as bytes (see the module doc); the asm only hands Triton each register as four e4m3
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
        x = _spread8(lo, lo, lo, lo, hi, hi, hi, hi, BLOCK_N)
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [x], dtype=tl.float8e4nv,
                                         is_pure=True, pack=4)
    else:
        # each asm instance takes four consecutive positions (nibbles 0-3 or 4-7 of a word, brought to
        # the low 16 bits) and returns their four e4m3 bytes in one register
        hi = w >> 16
        x = _spread8(w, w, w, w, hi, hi, hi, hi, BLOCK_N)
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 u, h, p1, p2, m, ln0, ln1, lp0, lp1;
            mov.b32 ln0, 0xCACCCED0;
            mov.b32 ln1, 0xB8C0C4C8;
            mov.b32 lp0, 0x44403800;
            mov.b32 lp1, 0x4E4C4A48;
            xor.b32 u, $1, 0x8888;
            prmt.b32 p1, ln0, ln1, $1;
            prmt.b32 p2, lp0, lp1, u;
            shl.b32 h, $1, 4;
            prmt.b32 m, $1, h, 0x9D8C;
            lop3.b32 $0, p1, m, p2, 0xBA;
            }""",
            "=r,r,r,r,r", [x], dtype=tl.float8e4nv, is_pure=True, pack=4)


@triton.jit
def w4a8_moe_kernel(
    a_ptr, stride_am, as_ptr,               # activations [rows, KB*128] e4m3 (lane input order), scales [rows] f32
    r_ptr, stride_rm,                       # CVT 2: the activations' block sums / 64 [rows, KB] f32
    q_ptr, stride_qe,                       # lane words [E, N_all/8, KB, 8, 4, 4] int32
    s_ptr, stride_se, stride_sk,            # scales [E, KB, N_all] bf16 (group 128: one row per block, N contiguous)
    out_ptr, stride_om,                     # out [pairs, N] bf16
    pairs_ptr, blk_expert_ptr, blk_start_ptr, blk_count_ptr,
    N, KB, up_offset,
    A_ROW_DIV: tl.constexpr,                # stage 1: an activation row is pair // top_k
    GATED: tl.constexpr,                    # w13: gate columns n, up columns up_offset + n; out silu(g) * u
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CVT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(blk_expert_ptr + pid_m)
    if e < 0:
        return
    start = tl.load(blk_start_ptr + pid_m)
    cnt = tl.load(blk_count_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < cnt
    # rows past the block's count read pair 0's row (valid memory) and are never stored
    pair = tl.load(pairs_ptr + start + offs_m, mask=row_mask, other=0)
    arow = pair // A_ROW_DIV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    n_c = tl.where(n_mask, offs_n, 0)
    tile_words = KB * 128                                    # words of one 8-column n-tile
    col = (n_c // 8) * tile_words + (n_c % 8) * 16
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + arow.to(tl.int64)[:, None] * stride_am + tl.arange(0, 128)[None, :]
    w_ptrs = q_ptr + e64 * stride_qe + col[:, None] + tl.arange(0, 16)[None, :]
    s_ptrs = s_ptr + e64 * stride_se + offs_n      # offs_n, not n_c: keeps the loads vectorised
    up_words = (up_offset // 8) * tile_words
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    r_row = r_ptr + arow.to(tl.int64) * stride_rm
    for kb in range(0, KB):
        a = tl.load(a_ptrs + kb * 128)
        part = tl.dot(a, tl.trans(_codes_fp8(tl.load(w_ptrs + kb * 128), BLOCK_N, CVT)))
        if CVT == 2:
            r = tl.load(r_row + kb)[:, None]
            part = part - r
        acc_g += part * tl.load(s_ptrs + kb * stride_sk, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            part_u = tl.dot(a, tl.trans(_codes_fp8(tl.load(w_ptrs + up_words + kb * 128), BLOCK_N, CVT)))
            if CVT == 2:
                part_u = part_u - r
            acc_u += part_u * tl.load(s_ptrs + up_offset + kb * stride_sk, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    a_s = tl.load(as_ptr + arow)[:, None]
    if CVT == 2:        # the codes were c * 2^-9
        a_s = a_s * 512.0
    if GATED:
        g = acc_g * a_s
        res = g / (1.0 + tl.exp(-g)) * (acc_u * a_s)
    else:
        res = acc_g * a_s
    o_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])
