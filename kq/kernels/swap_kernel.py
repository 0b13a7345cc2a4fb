"""The dense W4A16 GEMM for 33-255 rows on Hopper: the weights are the wgmma's A operand.

out[m, n] = sum_k x[m, k] * (nibble[k, n] - 8) * scale[k // G, n]   (the tiles layout of layout.py)

Why another kernel. gemm_kernel.py computes x @ W^T with the weights as the dot's second operand.
wgmma reads that operand from shared memory only, so from 64 rows (where Triton takes wgmma) every
dequantised tile makes a round trip through shared memory, and below it the kernel stays on
mma.sync: 221 TFLOP/s at M = 64, 0.89x cuBLAS BF16 on 12288x6144 (BENCHMARKS.md). Computing the
transpose, out^T = W x^T, makes the weights the *first* operand, which wgmma takes from registers:
the dequantised codes go straight from the lop3 into the tensor core, and only the activations
(x^T, small, from L2) pass through shared memory.

Dequantisation, two instructions a weight: one shift and one lop3 of a word leave inputs k, k+1 as
the bf16 pair 128 + nibble (layout.py), a packed subtract of 136 leaves q exactly, and a packed
multiply by the group scale rounds q * s to bf16, the value a bf16 dequantisation would store (the
other kernels multiply the scale into the fp32 sums; here it must be in the operand: a group's
rows are A's rows, and the sums of a group stay inside the wgmma accumulator).

Words are loaded as [BLOCK_N, 32] with column c reading word c // 2, so the two elements of each
register of wgmma's A fragment (kWidth 2: inputs k, k+1 of one row) are the same word and the
inline asm (pack=2) makes the pair with one shift and one lop3.
"""
import triton
import triton.language as tl


@triton.jit
def _scaled_pairs(w, shift, s):
    """pack=2 elements (w, w): one word; (shift, shift); s: the bf16 pair {s, s}. Returns the bf16x2
    of (nibble J, nibble J + 4) of w >> shift, minus 8, times s: inputs k, k+1 of one weight row."""
    return tl.inline_asm_elementwise(
        "{.reg .b32 t, o; shr.u32 t, $1, $3; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;"
        " mov.b32 o, 0x43084308; sub.rn.bf16x2 t, t, o; mul.rn.bf16x2 $0, t, $5;}",
        "=r,r,r,r,r,r", [w, shift, s], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _round_bf16(v):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32. In integer ops: the interpreter's own
    fp32 -> bf16 cast truncates, and the GPU's mul.rn.bf16x2 rounds to nearest."""
    b = v.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True)


@triton.jit
def w4a16_swap_kernel(
    a_ptr, stride_am,                   # x [M, K] bf16, K contiguous
    q_ptr, stride_qk,                   # prepacked int32 [Kp/8, N], N contiguous
    s_ptr, stride_sg,                   # scales bf16 [Kp/G, N]
    out_ptr, stride_os, stride_om,      # out [SPLIT, M, N] (fp32 partial sums when SPLIT_K > 1), N contiguous
    M, N, K, kblocks_per_split,
    GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,              # weight rows per program: wgmma's M (64 per warpgroup)
    BLOCK_M: tl.constexpr,              # activation rows per program: wgmma's N
    EVEN_K: tl.constexpr = False,       # K % 128 == 0: no K mask on the activations
    EVEN_N: tl.constexpr = False,       # N % BLOCK_N == 0: no N mask on the weights
    ASM: tl.constexpr = True,           # False: plain ops and fp32 dots, for Triton's CPU interpreter
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    c = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    kb_lo = pid_s * kblocks_per_split          # the host makes SPLIT_K divide the K blocks
    for kb_i in range(0, kblocks_per_split):
        kb = kb_lo + kb_i
        w_ptrs = q_ptr + (kb * 16 + c // 2)[None, :] * stride_qk + offs_n[:, None]        # [BN, 32]
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
        for j in tl.static_range(4):            # inputs 128 kb + 32 j .. +31: one group's
            g = (kb * 128) // GROUP + (32 * j) // GROUP     # written so the group-128 scale is loaded once
            if EVEN_N:
                s = tl.load(s_ptr + g * stride_sg + offs_n)
            else:
                s = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_mask, other=0.0)
            if ASM:
                wq = _scaled_pairs(w, tl.full((BLOCK_N, 32), 4 * j, tl.int32),
                                   tl.broadcast_to(s[:, None], (BLOCK_N, 32)))
            else:               # column c: nibble j + 4 (c % 2) of its word; q * s rounded to bf16 as above
                q = ((w >> (4 * j + 16 * (c % 2))[None, :]) & 0xF) - 8
                wq = _round_bf16(q.to(tl.float32) * s.to(tl.float32)[:, None])
            kk = kb * 128 + 32 * j + c
            x_ptrs = a_ptr + offs_m[None, :].to(tl.int64) * stride_am + kk[:, None]     # x^T [32, BM]
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            else:
                x = tl.load(x_ptrs, mask=m_mask[None, :] & (kk < K)[:, None], other=0.0)
            if not ASM:
                x = x.to(tl.float32)
            acc = tl.dot(wq, x, acc)
    o_ptrs = out_ptr + pid_s.to(tl.int64) * stride_os + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    o_mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K > 1:
        tl.store(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
