// W4A16 fused-MoE stage for decode on Hopper (sm_90a), CUDA. Instances per group size: moe_lanes_g*.cu.
//
// One kernel for both MoE stages: gate+up (GATED: silu(x W_gate^T) * (x W_up^T), bf16 out) and down.
// Weights in the lane layout (kq/kernels/lane_layout.py): each lane loads the 16 bytes it needs for a
// 128-input block with one global load straight into registers, DEPTH - 1 blocks ahead; no shared
// memory and no barrier in the loop, so the warps of a CTA never wait for each other (the Triton
// kernel's stalls were mostly warps waiting on one another and on short dependency chains, not on
// memory: benchmarks/results/kernels.md).
//
// Per warp: NT pairs of n-tiles of 8 output columns (of gate and of up when GATED), all rows (<= 8
// pairs) of one routed block, the whole K or a 1/KSPLIT share of it. mma.m16n8k16 bf16 -> fp32; the codes enter as 128 + nibble = q + 136 and
// 136 * sum(x) comes off per group from one extra mma of x with a constant (shared by all tiles).
// Activations come from global memory (L1/L2: every CTA of the block reads the same rows), 8 bytes
// per lane and step: a lane's inputs of a step are 4 consecutive values (see lane_layout.py).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace kq_lanes {

__device__ __forceinline__ uint32_t pair_bf16(uint32_t w) {
  // (w & 0x000F000F) | 0x43004300: bf16 128 + nibble in both halves
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(0x000F000F), "n"(0x43004300));
  return r;
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t v) {
  return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
}

__device__ __forceinline__ uint32_t float2_to_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

struct Params {
  const __nv_bfloat16* a;      // activations [rows, K], row stride lda
  const int4* q;               // lane words [E][n_tiles_all][KB][32 lanes] (16 B per lane)
  const __nv_bfloat16* s;      // scales [E][n_tiles_all][8][G]
  __nv_bfloat16* out;          // [rows_out, N] (row stride ldo)
  const int* pairs;            // routing table (kq/kernels/moe_routing.py)
  const int* blk_expert;
  const int* blk_start;
  const int* blk_count;
  int lda, ldo, K, kb_total, groups, n_tiles, n_tiles_all, up_tiles, a_row_div;
  int l2_ahead;                // blocks of each weight stream asked into L2 ahead of their load (0: none)
};

constexpr uint32_t NEG136 = 0xC308C308u;   // bf16x2 (-136, -136)

// bf16 number lg (0..3) of the up-to-four scales loaded for a block, as float
__device__ __forceinline__ float scale_at(uint2 v, int lg) {
  const uint32_t w = lg < 2 ? v.x : v.y;
  return __uint_as_float((lg & 1) ? (w & 0xFFFF0000u) : (w << 16));
}

// The tensor-core roles are swapped for decode: A = weights (16 columns: n-tiles 2m and 2m+1 of the
// lane layout, so lane (g, t) dequantises columns g and g + 8), B = activations (8 rows of the routed
// block, token g for lane g), C = [16 columns x 8 rows]. With at most a few rows per expert, none of
// the mma's 16-wide side is wasted on padding rows, the A fragment {col g h0, col g+8 h0, col g h1,
// col g+8 h1} is built by the dequantising lop3s in place, and the B fragment is one 8-byte load.
// The routing table is built with blocks of at most 8 pairs (ROWS16 is kept in the device code for a
// later 16-row variant; the kernel instantiates it off).
template <int NT, int MATS, int GROUP, bool ROWS16>
__device__ __forceinline__ void block_mma(const int4 (&w)[NT][MATS][2], const uint2 (&xb)[2][8],
                                          const uint2 (&sc)[NT][MATS][2], float (&part)[NT][MATS][2][4],
                                          float (&acc)[NT][MATS][2][4], float (&xoff)[2][4]) {
  constexpr int WORDS_PER_GROUP = GROUP / 32;   // a word covers 2 steps = 32 inputs
  constexpr int RB = ROWS16 ? 2 : 1;            // 8-row halves of the block
  const uint32_t neg[4] = {NEG136, NEG136, NEG136, NEG136};
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {       // step 2wd + half uses shifts 4(2 half + h)
      const int st = 2 * wd + half;
#pragma unroll
      for (int r = 0; r < RB; ++r) mma(xoff[r], neg, xb[r][st].x, xb[r][st].y);
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int m = 0; m < MATS; ++m) {
          const uint32_t lo = reinterpret_cast<const uint32_t*>(&w[i][m][0])[wd] >> (8 * half);   // column g
          const uint32_t hi = reinterpret_cast<const uint32_t*>(&w[i][m][1])[wd] >> (8 * half);   // column g + 8
          const uint32_t a[4] = {pair_bf16(lo), pair_bf16(hi), pair_bf16(lo >> 4), pair_bf16(hi >> 4)};
#pragma unroll
          for (int r = 0; r < RB; ++r) mma(part[i][m][r], a, xb[r][st].x, xb[r][st].y);
        }
      }
    }
    if ((wd + 1) % WORDS_PER_GROUP == 0) {       // a group ends: scale, add, restart
      const int lg = wd / WORDS_PER_GROUP;        // the group's place among this block's 128 / GROUP
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int m = 0; m < MATS; ++m) {
          const float s0 = scale_at(sc[i][m][0], lg);     // column g
          const float s1 = scale_at(sc[i][m][1], lg);     // column g + 8
#pragma unroll
          for (int r = 0; r < RB; ++r) {
            acc[i][m][r][0] += (part[i][m][r][0] + xoff[r][0]) * s0;
            acc[i][m][r][1] += (part[i][m][r][1] + xoff[r][1]) * s0;
            acc[i][m][r][2] += (part[i][m][r][2] + xoff[r][2]) * s1;
            acc[i][m][r][3] += (part[i][m][r][3] + xoff[r][3]) * s1;
            part[i][m][r][0] = part[i][m][r][1] = part[i][m][r][2] = part[i][m][r][3] = 0.f;
          }
        }
      }
#pragma unroll
      for (int r = 0; r < RB; ++r) xoff[r][0] = xoff[r][1] = xoff[r][2] = xoff[r][3] = 0.f;
    }
  }
}


// One 128-input block's operands in registers: the weight words (one 16-byte load per column half,
// tile and matrix), the scales of its groups (one 2-, 4- or 8-byte load per column) and the
// activations (one 8-byte load per step and 8-row half). DEPTH of these form a ring, so DEPTH - 1
// blocks are in flight while one is multiplied.
template <int NT, int MATS>
struct Stage {
  int4 w[NT][MATS][2];
  uint2 sc[NT][MATS][2];
  uint2 x[2][8];
};

// token g's inputs 16 step + 4t .. +3 of block kb; zero past K unless EVEN_K
template <int NT, int MATS, int GROUP, bool ROWS16, bool EVEN_K>
__device__ __forceinline__ void block_load(Stage<NT, MATS>& s, const int4* const (&qb)[NT][MATS][2],
                                           const __nv_bfloat16* const (&sb)[NT][MATS][2],
                                           const __nv_bfloat16* const (&xr)[2], const bool (&vr)[2], int kb, int K4) {
  constexpr int GPB = 128 / GROUP;               // groups per block
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        s.w[i][m][c] = __ldg(qb[i][m][c] + (size_t)kb * 32);
        const __nv_bfloat16* sp = sb[i][m][c] + kb * GPB;
        if (GPB == 4) {
          s.sc[i][m][c] = __ldg(reinterpret_cast<const uint2*>(sp));
        } else if (GPB == 2) {
          s.sc[i][m][c] = make_uint2(__ldg(reinterpret_cast<const uint32_t*>(sp)), 0u);
        } else {
          s.sc[i][m][c] = make_uint2(__ldg(reinterpret_cast<const unsigned short*>(sp)), 0u);
        }
      }
#pragma unroll
  for (int r = 0; r < (ROWS16 ? 2 : 1); ++r) {
#pragma unroll
    for (int st = 0; st < 8; ++st) {
      const int k = kb * 128 + 16 * st;            // + 4t inside xr; K4 = K - 4t
      const bool ok = vr[r] && (EVEN_K || k < K4);
      s.x[r][st] = ok ? __ldg(reinterpret_cast<const uint2*>(xr[r] + k)) : make_uint2(0, 0);
    }
  }
}

// Launch shape: CTAs of WARPS warps; KSPLIT consecutive warps share NT column pairs and split the
// 128-input blocks between them (summed through shared memory at the end: the CTA's one barrier),
// so a layer with few routed blocks or few columns (1 token; Kimi's TP-8 slice) still fills the GPU.
template <int NT, bool GATED, int GROUP, int WARPS, int KSPLIT, int DEPTH, bool EVEN_K>
__global__ void __launch_bounds__(32 * WARPS, DEPTH == 2 && GROUP == 128 ? 4 : 1) moe_lanes_kernel(Params p) {
  constexpr int MATS = GATED ? 2 : 1;
  constexpr int RB = 1;                           // 8-row routed blocks (moe_align block_m 8)
  constexpr int ACC = NT * MATS * 2 * 4;          // accumulators per lane
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int e = p.blk_expert[blockIdx.y];
  if (e < 0) return;                              // a block the routing did not use (uniform per CTA)
  const int start = p.blk_start[blockIdx.y], count = p.blk_count[blockIdx.y];
  const int cgroup = blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT;
  const int kpart = warp % KSPLIT;
  const int pair0 = cgroup * NT;                  // 16-column tiles = pairs of 8-column n-tiles
  const bool active = 2 * pair0 < p.n_tiles;      // warps past the last column still meet the barrier
  if (KSPLIT == 1 && !active) return;

  bool vr[2];
  const __nv_bfloat16* xr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    vr[r] = r < RB && row < count;
    const int o = vr[r] ? p.pairs[start + row] : 0;
    xr[r] = p.a + (size_t)(o / p.a_row_div) * p.lda + 4 * t;
  }
  const int4* qb[NT][MATS][2];
  const __nv_bfloat16* sb[NT][MATS][2];
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int tile = min(2 * (pair0 + i) + c, p.n_tiles - 1) + m * p.up_tiles;   // past the end: repeat
        const size_t et = (size_t)e * p.n_tiles_all + tile;
        qb[i][m][c] = p.q + et * p.kb_total * 32 + lane;   // lane 4g + t: column g of this n-tile, chunk t
        sb[i][m][c] = p.s + (et * 8 + g) * p.groups;       // column g's groups, contiguous
      }

  float acc[NT][MATS][2][4] = {};
  float part[NT][MATS][2][4] = {};
  float xoff[2][4] = {};
  const int K4 = p.K - 4 * t;
  const int per = (p.kb_total + KSPLIT - 1) / KSPLIT;
  const int kb0 = kpart * per;
  const int kb1 = active ? min(p.kb_total, kb0 + per) : kb0;
  // L2 prefetch: lane s < NT*MATS*2 owns weight stream s (one column half of one tile and matrix, 512
  // contiguous bytes per block); registers hold only DEPTH - 1 blocks in flight, the L2 holds more.
  constexpr int STREAMS = NT * MATS * 2;
  const char* pf = nullptr;
  if (lane < STREAMS && p.l2_ahead > 0) {        // the stream's (i, m, c) as in qb, from the lane number
    const int c = lane & 1, m = (lane >> 1) % MATS, i = lane / (2 * MATS);
    const int tile = min(2 * (pair0 + i) + c, p.n_tiles - 1) + m * p.up_tiles;
    pf = reinterpret_cast<const char*>(p.q + ((size_t)e * p.n_tiles_all + tile) * p.kb_total * 32);
  }
  if (pf != nullptr && kb0 < kb1) {
    const int n = min(p.l2_ahead, kb1 - kb0);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pf + (size_t)kb0 * 512), "r"(n * 512));
  }
  Stage<NT, MATS> st[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH - 1; ++d)
    if (kb0 + d < kb1) block_load<NT, MATS, GROUP, false, EVEN_K>(st[d], qb, sb, xr, vr, kb0 + d, K4);
  for (int kb = kb0; kb < kb1; kb += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (kb + d + DEPTH - 1 < kb1)
        block_load<NT, MATS, GROUP, false, EVEN_K>(st[(d + DEPTH - 1) % DEPTH], qb, sb, xr, vr, kb + d + DEPTH - 1, K4);
      if (pf != nullptr && kb + d + p.l2_ahead < kb1)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], 512;" ::"l"(pf + (size_t)(kb + d + p.l2_ahead) * 512));
      if (kb + d < kb1) block_mma<NT, MATS, GROUP, false>(st[d].w, st[d].x, st[d].sc, part, acc, xoff);
    }
  }

  if constexpr (KSPLIT > 1) {   // sum the K parts: lane-major so the stores and loads are conflict-free
    __shared__ float red[WARPS][ACC][32];
    float* a = &acc[0][0][0][0];
#pragma unroll
    for (int j = 0; j < ACC; ++j) red[warp][j][lane] = a[j];
    __syncthreads();
    if (kpart != 0 || !active) return;
#pragma unroll
    for (int q = 1; q < KSPLIT; ++q)
#pragma unroll
      for (int j = 0; j < ACC; ++j) a[j] += red[warp + q][j][lane];
  }

  // C fragment [16 columns x 8 rows]: c0, c1 = column g, rows 2t, 2t+1; c2, c3 = column g + 8
  const int* rows_out = p.pairs + start;
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int tile = 2 * (pair0 + i) + c;
      if (tile >= p.n_tiles) continue;
      const int col = tile * 8 + g;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int row = 2 * t + j;
        if (row >= count) continue;
        float y = acc[i][0][0][2 * c + j];
        if (GATED) {
          const float up = acc[i][MATS - 1][0][2 * c + j];
          y = y / (1.f + __expf(-y)) * up;
        }
        p.out[(size_t)rows_out[row] * p.ldo + col] = __float2bfloat16_rn(y);
      }
    }
  }
}

}  // namespace kq_lanes

// The host side of one group size's instances (moe_lanes_g*.cu): grid (ceil(n_tiles / (2 NT WARPS /
// KSPLIT)), routed blocks). Returns cudaGetLastError(), or -1 when no instance matches.
#define KQ_LANES_TRY(NT_, GATED_, GROUP_, KSPLIT_, DEPTH_)                                               \
  if (nt == NT_ && (gated != 0) == GATED_ && ksplit == KSPLIT_ && depth == DEPTH_) {                     \
    constexpr int CG = kq_lanes_warps / KSPLIT_;                                                         \
    const dim3 grid((n_tiles + 2 * NT_ * CG - 1) / (2 * NT_ * CG), n_blocks);                            \
    if (K % 128 == 0)                                                                                    \
      kq_lanes::moe_lanes_kernel<NT_, GATED_, GROUP_, kq_lanes_warps, KSPLIT_, DEPTH_, true>             \
          <<<grid, dim3(32 * kq_lanes_warps), 0, stream>>>(p);                                           \
    else                                                                                                 \
      kq_lanes::moe_lanes_kernel<NT_, GATED_, GROUP_, kq_lanes_warps, KSPLIT_, DEPTH_, false>            \
          <<<grid, dim3(32 * kq_lanes_warps), 0, stream>>>(p);                                           \
    return static_cast<int>(cudaGetLastError());                                                         \
  }
constexpr int kq_lanes_warps = 4;

// every (NT, GATED, KSPLIT, DEPTH) a group size's file builds; the host picks one (cuda_lanes.py)
#define KQ_LANES_VARIANTS(G)                                                                                    \
  KQ_LANES_TRY(1, true, G, 1, 2) KQ_LANES_TRY(1, true, G, 1, 3) KQ_LANES_TRY(1, true, G, 2, 2)                  \
  KQ_LANES_TRY(1, true, G, 4, 2) KQ_LANES_TRY(2, false, G, 1, 2) KQ_LANES_TRY(2, false, G, 1, 3)                \
  KQ_LANES_TRY(2, false, G, 2, 2) KQ_LANES_TRY(2, false, G, 4, 2)

#define KQ_LANES_ENTRY(G)                                                                                       \
  int kq_moe_lanes_g##G(const kq_lanes::Params& p, int n_blocks, int K, int n_tiles, int gated, int nt,         \
                        int ksplit, int depth, cudaStream_t stream) {                                           \
    KQ_LANES_VARIANTS(G)                                                                                        \
    return -1;                                                                                                  \
  }
