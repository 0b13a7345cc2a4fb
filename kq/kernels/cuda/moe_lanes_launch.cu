// Host entry of the decode MoE kernel (moe_lanes.cuh): flat arguments from the torch binding
// (moe_lanes_binding.cpp), dispatched to the group size's instances.
#include "moe_lanes.cuh"

int kq_moe_lanes_g128(const kq_lanes::Params&, int, int, int, int, int, int, int, int, int, cudaStream_t);
int kq_moe_lanes_g64(const kq_lanes::Params&, int, int, int, int, int, int, int, int, int, cudaStream_t);
int kq_moe_lanes_g32(const kq_lanes::Params&, int, int, int, int, int, int, int, int, int, cudaStream_t);
int kq_dense_lanes_g128(const kq_lanes::Params&, int, int, int, int, int, int, cudaStream_t);
int kq_dense_lanes_g64(const kq_lanes::Params&, int, int, int, int, int, int, cudaStream_t);
int kq_dense_lanes_g32(const kq_lanes::Params&, int, int, int, int, int, int, cudaStream_t);

// returns cudaGetLastError() of the launch, or -1 when no instance matches (n_tiles must be even)
int kq_moe_lanes_launch(const void* a, const void* q, const void* s, void* out, const int* pairs,
                        const int* blk_expert, const int* blk_start, const int* blk_count, int n_blocks,
                        int lda, int ldo, int K, int kb_total, int groups, int n_tiles, int n_tiles_all,
                        int up_tiles, int a_row_div, int gated, int group, int nt, int ksplit, int stages, int fold,
                        int xsm, const int* cids, const float* cw, void* fin, int* counter, float cscale,
                        int cpairs, void* stream) {
  const kq_lanes::Params p{static_cast<const __nv_bfloat16*>(a), static_cast<const int4*>(q),
                           static_cast<const __nv_bfloat16*>(s), static_cast<__nv_bfloat16*>(out), pairs,
                           blk_expert, blk_start, blk_count, lda, ldo, K, kb_total, groups, n_tiles,
                           n_tiles_all, up_tiles, a_row_div, 0, cids, cw,
                           static_cast<__nv_bfloat16*>(fin), counter, cscale, cpairs};
  if (counter && (gated || cids == nullptr || cw == nullptr || fin == nullptr)) return -1;
  if (n_tiles % 2) return -1;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (group) {
    case 128: return kq_moe_lanes_g128(p, n_blocks, K, n_tiles, gated, nt, ksplit, stages, fold, xsm, st);
    case 64: return kq_moe_lanes_g64(p, n_blocks, K, n_tiles, gated, nt, ksplit, stages, fold, xsm, st);
    case 32: return kq_moe_lanes_g32(p, n_blocks, K, n_tiles, gated, nt, ksplit, stages, fold, xsm, st);
    default: return -1;
  }
}

// one matrix, y [rows, N] = a [rows, K] W^T, no routing table (the kernel's DENSE instances)
int kq_dense_lanes_launch(const void* a, const void* q, const void* s, void* out, int rows, int lda, int ldo,
                          int K, int kb_total, int groups, int n_tiles, int group, int nt, int ksplit, int stages,
                          int xpre, void* stream) {
  const kq_lanes::Params p{static_cast<const __nv_bfloat16*>(a), static_cast<const int4*>(q),
                           static_cast<const __nv_bfloat16*>(s), static_cast<__nv_bfloat16*>(out), nullptr,
                           nullptr, nullptr, nullptr, lda, ldo, K, kb_total, groups, n_tiles,
                           n_tiles, 0, 1, rows};
  if (n_tiles % 2 || rows <= 0) return -1;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (group) {
    case 128: return kq_dense_lanes_g128(p, K, n_tiles, nt, ksplit, stages, xpre, st);
    case 64: return kq_dense_lanes_g64(p, K, n_tiles, nt, ksplit, stages, xpre, st);
    case 32: return kq_dense_lanes_g32(p, K, n_tiles, nt, ksplit, stages, xpre, st);
    default: return -1;
  }
}
