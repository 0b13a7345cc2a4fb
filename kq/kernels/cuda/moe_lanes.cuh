// W4A16 fused-MoE stage for decode on Hopper (sm_90a), CUDA. Instances per group size: moe_lanes_g*.cu.
//
// One kernel for both MoE stages: gate+up (GATED: silu(x W_gate^T) * (x W_up^T), bf16 out) and down.
// Weights in the lane layout (kq/kernels/lane_layout.py): each lane loads the 16 bytes it needs for a
// 128-input block with one 16-byte copy into its own slot of a per-warp shared-memory ring, STAGES - 1
// blocks ahead, and reads back only its own bytes: no barrier in the loop, so the warps of a CTA never
// wait for each other (a register-buffered loop keeps too few bytes in flight).
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
  int rows;                    // DENSE: rows of a (one matrix, no routing table)
  // The down stage of one token with counter set: the top-k combine in the same launch (combine_tail)
  const int* cids;             // [cpairs] the token's expert ids (-1: a pair not computed here)
  const float* cw;             // [cpairs] its top-k weights
  __nv_bfloat16* fin;          // [N] the combined row
  int* counter;                // [column groups] arrivals, 0 between launches (the last warp resets it)
  float cscale;                // routed scaling factor
  int cpairs;
};

constexpr uint32_t NEG136 = 0xC308C308u;   // bf16x2 (-136, -136)

// bf16x2 (128 + c) - 136 = c - 8 = q, exact (small integers)
__device__ __forceinline__ uint32_t sub136(uint32_t v) {
  uint32_t r;
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(NEG136));
  return r;
}

// bf16 number lg (0..3) of the up-to-four scales loaded for a block, as float
__device__ __forceinline__ float scale_at(uint2 v, int lg) {
  const uint32_t w = lg < 2 ? v.x : v.y;
  return __uint_as_float((lg & 1) ? (w & 0xFFFF0000u) : (w << 16));
}

// the same scale twice, as a bf16x2 pair (one PRMT)
__device__ __forceinline__ uint32_t scale_pair(uint2 v, int lg) {
  return __byte_perm(lg < 2 ? v.x : v.y, 0, (lg & 1) ? 0x3232 : 0x1010);
}

// bf16x2 q * s, rounded to nearest: a weight as a bf16 dequantisation stores it
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// The tensor-core roles are swapped for decode: A = weights (16 columns: n-tiles 2m and 2m+1 of the
// lane layout, so lane (g, t) dequantises columns g and g + 8), B = activations (8 rows of the routed
// block, token g for lane g), C = [16 columns x 8 rows]. With at most a few rows per expert, none of
// the mma's 16-wide side is wasted on padding rows, the A fragment {col g h0, col g+8 h0, col g h1,
// col g+8 h1} is built by the dequantising lop3s in place, and the B fragment is one 8-byte load.
// FOLD 1: the codes enter the mma as q + 136 and one extra mma per step of x with -136 gives the offset,
// added once per group; FOLD 0: one packed bf16 subtract per register makes the codes q exactly (no offset
// mma, no per-group add: fewer instructions when groups are short); FOLD 2 (SCALE_A, groups 32 and 64):
// the exact codes times the group's scale in one packed bf16 multiply, so the mma sums the weights
// themselves (each q * s rounded to bf16, as a bf16 dequantisation stores it) straight into the
// accumulators: no per-group partial sums, scale conversions or multiply-adds, and fewer registers.
template <int NT, int MATS, int GROUP, int FOLD>
__device__ __forceinline__ void block_mma(const int4 (&w)[NT][MATS][2], const uint2 (&xb)[8],
                                          const uint2 (&sc)[NT][MATS][2], float (&part)[NT][MATS][4],
                                          float (&acc)[NT][MATS][4], float (&xoff)[4]) {
  constexpr int WORDS_PER_GROUP = GROUP / 32;   // a word covers 2 steps = 32 inputs
  const uint32_t neg[4] = {NEG136, NEG136, NEG136, NEG136};
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {       // step 2wd + half uses shifts 4(2 half + h)
      const int st = 2 * wd + half;
      if (FOLD == 1) mma(xoff, neg, xb[st].x, xb[st].y);
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int m = 0; m < MATS; ++m) {
          const uint32_t lo = reinterpret_cast<const uint32_t*>(&w[i][m][0])[wd] >> (8 * half);   // column g
          const uint32_t hi = reinterpret_cast<const uint32_t*>(&w[i][m][1])[wd] >> (8 * half);   // column g + 8
          uint32_t a[4] = {pair_bf16(lo), pair_bf16(hi), pair_bf16(lo >> 4), pair_bf16(hi >> 4)};
          if (FOLD != 1) {
#pragma unroll
            for (int r = 0; r < 4; ++r) a[r] = sub136(a[r]);
          }
          if (FOLD == 2) {                        // a[0], a[2]: column g; a[1], a[3]: column g + 8
            const uint32_t s0 = scale_pair(sc[i][m][0], wd / WORDS_PER_GROUP);
            const uint32_t s1 = scale_pair(sc[i][m][1], wd / WORDS_PER_GROUP);
            a[0] = mul_bf16x2(a[0], s0);
            a[1] = mul_bf16x2(a[1], s1);
            a[2] = mul_bf16x2(a[2], s0);
            a[3] = mul_bf16x2(a[3], s1);
            mma(acc[i][m], a, xb[st].x, xb[st].y);
          } else {
            mma(part[i][m], a, xb[st].x, xb[st].y);
          }
        }
      }
    }
    if (FOLD != 2 && (wd + 1) % WORDS_PER_GROUP == 0) {   // a group ends: scale, add, restart
      const int lg = wd / WORDS_PER_GROUP;        // the group's place among this block's 128 / GROUP
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int m = 0; m < MATS; ++m) {
          const float s0 = scale_at(sc[i][m][0], lg);     // column g
          const float s1 = scale_at(sc[i][m][1], lg);     // column g + 8
          if (FOLD == 1) {
            acc[i][m][0] += (part[i][m][0] + xoff[0]) * s0;
            acc[i][m][1] += (part[i][m][1] + xoff[1]) * s0;
            acc[i][m][2] += (part[i][m][2] + xoff[2]) * s1;
            acc[i][m][3] += (part[i][m][3] + xoff[3]) * s1;
          } else {   // no "+ 0.f": the compiler keeps that add (it turns -0 into +0), one FADD per value
            acc[i][m][0] += part[i][m][0] * s0;
            acc[i][m][1] += part[i][m][1] * s0;
            acc[i][m][2] += part[i][m][2] * s1;
            acc[i][m][3] += part[i][m][3] * s1;
          }
          part[i][m][0] = part[i][m][1] = part[i][m][2] = part[i][m][3] = 0.f;
        }
      }
      xoff[0] = xoff[1] = xoff[2] = xoff[3] = 0.f;
    }
  }
}

// XPRE instances: the bytes of one activation row in shared memory (K padded to whole blocks, plus 32 so
// that the 4 rows a half-warp reads for an mma's B fragment fill the 32 banks once); kernel and host
__host__ __device__ constexpr int xpre_row_bytes(int kb_total) { return kb_total * 256 + 32; }

// XSM instances: the activations go through the ring too, each lane copying its own 8 bytes per step
// (XSLOT bytes per warp and slot, chunk-major so a lane reads them back with 4 conflict-free 16-byte
// loads), STAGES - 1 blocks ahead like the weights, instead of register sets one block ahead. Nsight
// Compute put the top stall of the cases with few warps (about one wave) on the first mma of a block,
// waiting for the activations; the ring slot grows by 2 KB, so fewer CTAs fit on a multiprocessor:
// cuda_lanes.pick takes these instances for gate+up at group 128 up to about four waves of warps.
constexpr int XSLOT_BYTES = 2048;

// The activations and scales of one 128-input block, in registers (two sets: the next block's are
// loaded while this one is multiplied): one 8-byte load per step (token g's inputs 16 step + 4t .. +3,
// zero past K unless EVEN_K) and one 2-, 4- or 8-byte load of each column's scales.
template <int NT, int MATS>
struct XS {
  uint2 x[8];
  uint2 sc[NT][MATS][2];
};

template <int NT, int MATS, int GROUP, bool EVEN_K, bool LOAD_X>
__device__ __forceinline__ void load_xs(XS<NT, MATS>& s, const __nv_bfloat16* const (&sb)[NT][MATS][2],
                                        const __nv_bfloat16* xr, bool vr, int kb, int K4) {
  constexpr int GPB = 128 / GROUP;               // groups per block
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const __nv_bfloat16* sp = sb[i][m][c] + kb * GPB;
        if (GPB == 4) {
          s.sc[i][m][c] = __ldg(reinterpret_cast<const uint2*>(sp));
        } else if (GPB == 2) {
          s.sc[i][m][c] = make_uint2(__ldg(reinterpret_cast<const uint32_t*>(sp)), 0u);
        } else {
          s.sc[i][m][c] = make_uint2(__ldg(reinterpret_cast<const unsigned short*>(sp)), 0u);
        }
      }
  if constexpr (LOAD_X) {                          // else the ring (XSM) or shared memory (XPRE) brings them
#pragma unroll
    for (int st = 0; st < 8; ++st) {
      const int k = kb * 128 + 16 * st;            // + 4t inside xr; K4 = K - 4t
      const bool ok = vr && (EVEN_K || k < K4);
      s.x[st] = ok ? __ldg(reinterpret_cast<const uint2*>(xr + k)) : make_uint2(0, 0);
    }
  }
}

// The weights go through a per-warp ring of STAGES shared-memory slots: each lane copies its own 16
// bytes of each stream (cp.async, 16 B) and later reads back exactly those bytes, so no lane waits for
// another (no barrier, no __syncwarp); STAGES - 1 blocks are in flight without holding registers.
// A slot holds STREAMS = NT*MATS*2 streams (one column half of one tile and matrix) of 512 bytes.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// 8 bytes (cp.async.ca: below 16 bytes only through L1); src_bytes 0 writes zeros (inputs past K)
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }


template <bool EVEN_K>
__device__ __forceinline__ void issue_x(uint32_t xslot, const __nv_bfloat16* xr, bool vr, int kb, int K4) {
  if (!vr) return;                               // rows past the block's count: their outputs are never stored
#pragma unroll
  for (int st = 0; st < 8; ++st) {
    const int k = kb * 128 + 16 * st;
    cp_async8(xslot + ((st >> 1) * 32) * 16 + (st & 1) * 8, xr + (EVEN_K || k < K4 ? k : 0), EVEN_K || k < K4 ? 8 : 0);
  }
}

template <int NT, int MATS>
__device__ __forceinline__ void issue_w(uint32_t slot, const int4* const (&qb)[NT][MATS][2], int kb) {
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int m = 0; m < MATS; ++m)
#pragma unroll
      for (int c = 0; c < 2; ++c) cp_async16(slot + ((i * MATS + m) * 2 + c) * 512, qb[i][m][c] + (size_t)kb * 32);
}

// The top-k combine of one token inside the down stage: every routed block's warp of column group cg
// counts itself in once its rows of out are written (fence, then one atomic); the last of them (gridDim.y
// arrivals) sums the token's rows of out for the group's 16 NT columns in pair order, as
// moe_combine.py's kernel does (fp32, the same order), and resets the count for the next launch.
template <int NT>
__device__ __forceinline__ void combine_tail(const Params& p, int cg, int lane) {
  __threadfence();                                 // this lane's stores, device-wide, before the count
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(p.counter + cg, 1) == static_cast<int>(gridDim.y) - 1;
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  __threadfence();
  const int n = p.n_tiles * 8;
  for (int c = lane; c < 16 * NT; c += 32) {
    const int col = 16 * NT * cg + c;
    if (col >= n) break;
    float acc = 0.f;
    for (int j = 0; j < p.cpairs; ++j)             // rows written by other CTAs: read through L2
      if (p.cids[j] >= 0) acc += p.cw[j] * __bfloat162float(__ldcg(p.out + (size_t)j * p.ldo + col));
    p.fin[col] = __float2bfloat16_rn(acc * p.cscale);
  }
  if (lane == 0) p.counter[cg] = 0;
}

// Launch shape: CTAs of WARPS warps; KSPLIT consecutive warps share NT column pairs and split the
// 128-input blocks between them (summed through shared memory at the end: the CTA's one barrier),
// so a layer with few routed blocks or few columns (1 token; Kimi's TP-8 slice) still fills the GPU.
// Dynamic shared memory: WARPS * STAGES * STREAMS * 512 bytes.
// DENSE: one matrix (E = 1) and rows 8 blk .. 8 blk + 7 of a as the routed block, no routing table;
// the grid is (row blocks, column groups) so the CTAs that read the same weights run side by side,
// for L2 to serve all but the first (measured: 16 rows take 1.7x the time of 8, so it mostly does not).
// Occupancy bound (CTAs per SM) for the register budget: 4 for the plain group-128 instances; 2 for
// the widest tiles and for the MoE's K-split instances at group 32 (which spill at 3 CTAs' 168
// registers; they run where few warps are resident anyway: cuda_lanes.pick); 3 otherwise.
template <int NT, bool GATED, int GROUP, int KSPLIT, int STAGES, bool DENSE, bool XPRE>
constexpr int min_ctas() {
  // XPRE (no activation registers): 73-80 registers at one tile pair (group 32 spills at 80: 5 CTAs there)
  if (XPRE) return NT == 1 ? (GROUP == 32 ? 5 : 6) : (GROUP == 128 ? 4 : 3);
  if (NT * (GATED ? 2 : 1) > 2 || (GROUP == 32 && KSPLIT > 1 && !DENSE)) return 2;
  return STAGES <= 6 && KSPLIT == 1 && GROUP == 128 ? 4 : 3;
}

template <int NT, bool GATED, int GROUP, int WARPS, int KSPLIT, int STAGES, int FOLD, bool XSM, bool EVEN_K, bool DENSE,
          bool XPRE = false>
__global__ void __launch_bounds__(32 * WARPS, (WARPS > 4 ? 1 : min_ctas<NT, GATED, GROUP, KSPLIT, STAGES, DENSE, XPRE>()))
    moe_lanes_kernel(Params p) {
  static_assert(STAGES % 2 == 0, "the activation sets alternate with the block's parity");
  static_assert(!XPRE || (DENSE && !XSM), "the preloaded activations are a dense instance's");
  constexpr int MATS = GATED ? 2 : 1;
  constexpr int STREAMS = NT * MATS * 2;
  constexpr int ACC = NT * MATS * 4;              // accumulators per lane
  static_assert(ACC * 4 <= STREAMS * 16, "the K-split sum reuses a ring slot");
  constexpr int XSLOT = XSM ? XSLOT_BYTES : 0;
  constexpr int SLOT16 = STREAMS * 32 + XSLOT / 16;   // one ring slot of a warp, in 16-byte units
  extern __shared__ int4 ring[];                   // [WARPS][STAGES][SLOT16]: [STREAMS][32 lanes] (+ x chunks)
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int blk = DENSE ? blockIdx.x : blockIdx.y;
  const int e = DENSE ? 0 : p.blk_expert[blk];
  if (e < 0) {                                    // a block the routing did not use (uniform per CTA)
    if constexpr (!DENSE && !GATED) {              // it still counts for the combine of its column groups
      const int cg = blockIdx.x * (WARPS / KSPLIT) + warp / KSPLIT;
      if (p.counter && warp % KSPLIT == 0 && 2 * cg * NT < p.n_tiles) combine_tail<NT>(p, cg, lane);
    }
    return;
  }
  const int start = DENSE ? 8 * blk : p.blk_start[blk];
  const int count = DENSE ? min(8, p.rows - start) : p.blk_count[blk];
  const int cgroup = (DENSE ? blockIdx.y : blockIdx.x) * (WARPS / KSPLIT) + warp / KSPLIT;
  const int kpart = warp % KSPLIT;
  const int pair0 = cgroup * NT;                  // 16-column tiles = pairs of 8-column n-tiles
  const bool active = 2 * pair0 < p.n_tiles;      // warps past the last column still meet the barrier
  if (KSPLIT == 1 && !active && !XPRE) return;
  // XPRE: the block's rows of a, all of K, copied once into shared memory behind the rings (8-byte
  // cp.async by every thread of the CTA, zeros past K), row stride xpre_row_bytes; the oldest cp.async group
  const uint32_t xpre = static_cast<uint32_t>(__cvta_generic_to_shared(ring + WARPS * STAGES * SLOT16));
  const int xstride = xpre_row_bytes(p.kb_total);
  if constexpr (XPRE) {
    const int chunks = p.kb_total * 32;            // 8-byte chunks of a row
    for (int idx = threadIdx.x; idx < count * chunks; idx += 32 * WARPS) {
      const int r = idx / chunks, c = idx - r * chunks;
      const bool ok = EVEN_K || 4 * c < p.K;
      cp_async8(xpre + r * xstride + c * 8, p.a + (size_t)(start + r) * p.lda + (ok ? 4 * c : 0), ok ? 8 : 0);
    }
    cp_commit();
  }

  // B: token g of the routed block (8-row blocks: moe_align block_m 8)
  const bool vr = g < count;
  const int arow = DENSE ? (vr ? start + g : 0) : (vr ? p.pairs[start + g] : 0) / p.a_row_div;
  const __nv_bfloat16* xr = p.a + (size_t)arow * p.lda + 4 * t;
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

  float acc[NT][MATS][4] = {};
  float part[NT][MATS][4] = {};
  float xoff[4] = {};
  const int K4 = p.K - 4 * t;
  const int per = (p.kb_total + KSPLIT - 1) / KSPLIT;
  const int kb0 = kpart * per;
  const int kb1 = active ? min(p.kb_total, kb0 + per) : kb0;
  int4* mine = ring + (size_t)warp * STAGES * SLOT16 + lane;
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(mine));
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (kb0 + s < kb1) {
      issue_w<NT, MATS>(base + s * SLOT16 * 16, qb, kb0 + s);
      if (XSLOT) issue_x<EVEN_K>(base + s * SLOT16 * 16 + STREAMS * 512, xr, vr, kb0 + s, K4);
    }
    cp_commit();                                   // empty groups too: one group per block, always
  }
  if constexpr (XPRE) {                             // every thread's copies of a have landed, then all threads'
    cp_wait<STAGES - 1>();
    __syncthreads();
    if (KSPLIT == 1 && !active) return;
  }
  // lane g's row of the preloaded activations (rows past the block's count read row 0: never stored)
  const uint32_t xrow = xpre + (vr ? g : 0) * xstride + 8 * t;
  XS<NT, MATS> xs[2];
  if (kb0 < kb1) load_xs<NT, MATS, GROUP, EVEN_K, !XSM && !XPRE>(xs[0], sb, xr, vr, kb0, K4);
  for (int kb = kb0; kb < kb1; kb += STAGES) {
#pragma unroll
    for (int j = 0; j < STAGES; ++j) {
      const int blk = kb + j;
      if (blk < kb1) {
        if (blk + STAGES - 1 < kb1) {
          const uint32_t slot = base + ((j + STAGES - 1) % STAGES) * SLOT16 * 16;
          issue_w<NT, MATS>(slot, qb, blk + STAGES - 1);
          if (XSLOT) issue_x<EVEN_K>(slot + STREAMS * 512, xr, vr, blk + STAGES - 1, K4);
        }
        cp_commit();
        if (blk + 1 < kb1) load_xs<NT, MATS, GROUP, EVEN_K, !XSM && !XPRE>(xs[(j + 1) & 1], sb, xr, vr, blk + 1, K4);
        cp_wait<STAGES - 1>();                     // this block's group has landed
        int4 w[NT][MATS][2];
#pragma unroll
        for (int i = 0; i < NT; ++i)
#pragma unroll
          for (int m = 0; m < MATS; ++m)
#pragma unroll
            for (int c = 0; c < 2; ++c) w[i][m][c] = mine[j * SLOT16 + ((i * MATS + m) * 2 + c) * 32];
        if (XSLOT) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int4 v = mine[j * SLOT16 + STREAMS * 32 + c * 32];
            xs[j & 1].x[2 * c] = make_uint2(v.x, v.y);
            xs[j & 1].x[2 * c + 1] = make_uint2(v.z, v.w);
          }
        }
        if constexpr (XPRE) {
#pragma unroll
          for (int st = 0; st < 8; ++st) xs[j & 1].x[st] = lds64(xrow + blk * 256 + 32 * st);
        }
        block_mma<NT, MATS, GROUP, FOLD>(w, xs[j & 1].x, xs[j & 1].sc, part, acc, xoff);
      }
    }
  }

  if constexpr (KSPLIT > 1) {   // sum the K parts in the warps' own slot 0, lane-major (conflict-free)
    cp_wait<0>();
    float* a = &acc[0][0][0];
    float* red = reinterpret_cast<float*>(ring + (size_t)warp * STAGES * SLOT16);
#pragma unroll
    for (int j = 0; j < ACC; ++j) red[j * 32 + lane] = a[j];
    __syncthreads();
    if (kpart != 0 || !active) return;
#pragma unroll
    for (int q = 1; q < KSPLIT; ++q) {
      const float* other = reinterpret_cast<const float*>(ring + (size_t)(warp + q) * STAGES * SLOT16);
#pragma unroll
      for (int j = 0; j < ACC; ++j) a[j] += other[j * 32 + lane];
    }
  }

  // C fragment [16 columns x 8 rows]: c0, c1 = column g, rows 2t, 2t+1; c2, c3 = column g + 8
  const int* rows_out = DENSE ? nullptr : p.pairs + start;
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
        float y = acc[i][0][2 * c + j];
        if (GATED) {
          const float up = acc[i][MATS - 1][2 * c + j];
          y = y / (1.f + __expf(-y)) * up;
        }
        p.out[(size_t)(DENSE ? start + row : rows_out[row]) * p.ldo + col] = __float2bfloat16_rn(y);
      }
    }
  }
  if constexpr (!DENSE && !GATED) {
    if (p.counter) combine_tail<NT>(p, cgroup, lane);
  }
}

}  // namespace kq_lanes

// The host side of one group size's instances (moe_lanes_g*.cu): grid (ceil(n_tiles / (2 NT WARPS /
// KSPLIT)), routed blocks), dynamic shared memory for the rings. Returns cudaGetLastError(), or -1
// when no instance matches.
#define KQ_LANES_TRY(NT_, GATED_, GROUP_, KSPLIT_, STAGES_, FOLD_, XSM_)                                  \
  if (nt == NT_ && (gated != 0) == GATED_ && ksplit == KSPLIT_ && stages == STAGES_ && fold == (FOLD_) &&     \
      (xsm != 0) == XSM_) {                                                                              \
    constexpr int W_ = kq_lanes_cta_warps(KSPLIT_);                                                      \
    constexpr int CG = W_ / KSPLIT_;                                                                     \
    constexpr int SMEM = W_ * STAGES_ * (NT_ * (GATED_ ? 2 : 1) * 2 * 512 + (XSM_ ? kq_lanes::XSLOT_BYTES : 0)); \
    const dim3 grid((n_tiles + 2 * NT_ * CG - 1) / (2 * NT_ * CG), n_blocks);                            \
    if (K % 128 == 0) {                                                                                  \
      auto* k = kq_lanes::moe_lanes_kernel<NT_, GATED_, GROUP_, W_, KSPLIT_, STAGES_, FOLD_, XSM_, true, false>; \
      cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);                        \
      k<<<grid, dim3(32 * W_), SMEM, stream>>>(p);                                           \
    } else {                                                                                             \
      auto* k = kq_lanes::moe_lanes_kernel<NT_, GATED_, GROUP_, W_, KSPLIT_, STAGES_, FOLD_, XSM_, false, false>; \
      cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);                        \
      k<<<grid, dim3(32 * W_), SMEM, stream>>>(p);                                           \
    }                                                                                                    \
    return static_cast<int>(cudaGetLastError());                                                         \
  }
constexpr int kq_lanes_warps = 4;
// warps of a CTA: 4, or KSPLIT where that is more (KSPLIT 8: 8 warps share the columns and split K)
constexpr int kq_lanes_cta_warps(int ksplit) { return ksplit > kq_lanes_warps ? ksplit : kq_lanes_warps; }

// every instance a group size's file builds, generated from kq/kernels/lanes_variants.py
#include "moe_lanes_instances.h"
#define KQ_LANES_VARIANTS(G) KQ_LANES_VARIANTS_##G

// dense instances (one matrix, no routing): grid (row blocks of 8, column groups); XPRE: the rows of a
// block (min(8, rows)) preloaded into shared memory behind the rings
#define KQ_LANES_DENSE_TRY(NT_, GROUP_, KSPLIT_, STAGES_, XPRE_)                                          \
  if (nt == NT_ && ksplit == KSPLIT_ && stages == STAGES_ && (xpre != 0) == XPRE_) {                     \
    constexpr int W_ = kq_lanes_cta_warps(KSPLIT_);                                                      \
    constexpr int CG = W_ / KSPLIT_;                                                                     \
    const int smem = W_ * STAGES_ * NT_ * 2 * 512 +                                          \
                     (XPRE_ ? (p.rows < 8 ? p.rows : 8) * kq_lanes::xpre_row_bytes(p.kb_total) : 0);     \
    const dim3 grid((p.rows + 7) / 8, (n_tiles + 2 * NT_ * CG - 1) / (2 * NT_ * CG));                    \
    auto* k = K % 128 == 0                                                                               \
        ? kq_lanes::moe_lanes_kernel<NT_, false, GROUP_, W_, KSPLIT_, STAGES_, true, false, true, true, XPRE_>   \
        : kq_lanes::moe_lanes_kernel<NT_, false, GROUP_, W_, KSPLIT_, STAGES_, true, false, false, true, XPRE_>; \
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);                          \
    k<<<grid, dim3(32 * W_), smem, stream>>>(p);                                             \
    return static_cast<int>(cudaGetLastError());                                                         \
  }

#define KQ_LANES_ENTRY(G)                                                                                       \
  int kq_moe_lanes_g##G(const kq_lanes::Params& p, int n_blocks, int K, int n_tiles, int gated, int nt,         \
                        int ksplit, int stages, int fold, int xsm, cudaStream_t stream) {                       \
    KQ_LANES_VARIANTS(G)                                                                                        \
    return -1;                                                                                                  \
  }                                                                                                             \
  int kq_dense_lanes_g##G(const kq_lanes::Params& p, int K, int n_tiles, int nt, int ksplit, int stages,        \
                          int xpre, cudaStream_t stream) {                                                      \
    KQ_LANES_DENSE_VARIANTS(G)                                                                                  \
    return -1;                                                                                                  \
  }
