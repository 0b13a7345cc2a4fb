// torch binding of the decode MoE kernel (moe_lanes_launch.cu): tensors in, the launch on torch's stream.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

int kq_moe_lanes_launch(const void* a, const void* q, const void* s, void* out, const int* pairs,
                        const int* blk_expert, const int* blk_start, const int* blk_count, int n_blocks,
                        int lda, int ldo, int K, int kb_total, int groups, int n_tiles, int n_tiles_all,
                        int up_tiles, int a_row_div, int gated, int group, int nt, int ksplit, int stages, int fold,
                        int xsm, const int* cids, const float* cw, void* fin, int* counter, float cscale,
                        int cpairs, void* stream);

// a [rows, K] bf16, q lane words [E, tiles, KB, 8, 4, 4], s scales [E, tiles, 8, G], out [rows_out, N]
int64_t launch(torch::Tensor a, torch::Tensor q, torch::Tensor s, torch::Tensor out, torch::Tensor pairs,
               torch::Tensor be, torch::Tensor bs, torch::Tensor bc, int64_t K, int64_t n_tiles,
               int64_t n_tiles_all, int64_t up_tiles, int64_t a_row_div, int64_t gated, int64_t group,
               int64_t nt, int64_t ksplit, int64_t stages, int64_t fold, int64_t xsm) {
  return kq_moe_lanes_launch(a.data_ptr(), q.data_ptr(), s.data_ptr(), out.data_ptr(), pairs.data_ptr<int>(),
                             be.data_ptr<int>(), bs.data_ptr<int>(), bc.data_ptr<int>(), be.numel(),
                             a.stride(0), out.stride(0), K, q.size(2), s.size(3), n_tiles, n_tiles_all,
                             up_tiles, a_row_div, gated, group, nt, ksplit, stages, fold, xsm, nullptr, nullptr,
                             nullptr, nullptr, 0.f, 0, at::cuda::getCurrentCUDAStream().stream());
}

// the down stage of one token with its top-k combine (moe_lanes.cuh combine_tail): ids [k] int32,
// w [k] f32, fin [N] bf16, counter int32 zeros (one per column group)
int64_t launch_down_combine(torch::Tensor a, torch::Tensor q, torch::Tensor s, torch::Tensor out,
                            torch::Tensor pairs, torch::Tensor be, torch::Tensor bs, torch::Tensor bc, int64_t K,
                            int64_t n_tiles, int64_t group, int64_t nt, int64_t ksplit, int64_t stages,
                            int64_t fold, torch::Tensor ids, torch::Tensor w, torch::Tensor fin,
                            torch::Tensor counter, double scale) {
  return kq_moe_lanes_launch(a.data_ptr(), q.data_ptr(), s.data_ptr(), out.data_ptr(), pairs.data_ptr<int>(),
                             be.data_ptr<int>(), bs.data_ptr<int>(), bc.data_ptr<int>(), be.numel(),
                             a.stride(0), out.stride(0), K, q.size(2), s.size(3), n_tiles, n_tiles, 0, 1, 0,
                             group, nt, ksplit, stages, fold, 0, ids.data_ptr<int>(), w.data_ptr<float>(),
                             fin.data_ptr(), counter.data_ptr<int>(), static_cast<float>(scale),
                             static_cast<int>(ids.numel()), at::cuda::getCurrentCUDAStream().stream());
}

int kq_dense_lanes_launch(const void* a, const void* q, const void* s, void* out, int rows, int lda, int ldo,
                          int K, int kb_total, int groups, int n_tiles, int group, int nt, int ksplit, int stages,
                          int xpre, void* stream);

// a [rows, K] bf16, q lane words [N/8, KB, 8, 4, 4], s scales [N/8, 8, G], out [rows, N]
int64_t launch_dense(torch::Tensor a, torch::Tensor q, torch::Tensor s, torch::Tensor out, int64_t K,
                     int64_t group, int64_t nt, int64_t ksplit, int64_t stages, int64_t xpre) {
  return kq_dense_lanes_launch(a.data_ptr(), q.data_ptr(), s.data_ptr(), out.data_ptr(), a.size(0), a.stride(0),
                               out.stride(0), K, q.size(1), s.size(2), q.size(0), group, nt, ksplit, stages,
                               xpre, at::cuda::getCurrentCUDAStream().stream());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launch", &launch, "kq decode MoE stage (lane layout)");
  m.def("launch_down_combine", &launch_down_combine, "kq decode MoE down stage of one token with its combine");
  m.def("launch_dense", &launch_dense, "kq W4A16 linear for few rows (lane layout)");
}
