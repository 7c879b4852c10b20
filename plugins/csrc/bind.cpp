// Python binding of the kernels in ops.cu; plugins/cuda.py registers them as the CUDA kernels of the ops.
#include <torch/extension.h>

#include <tuple>

at::Tensor unique_first_rows(at::Tensor ids, at::Tensor first, at::Tensor batch);
std::tuple<at::Tensor, at::Tensor> window_update_rows(at::Tensor ring, at::Tensor head, at::Tensor count,
                                                      at::Tensor slot_of, at::Tensor id_of, at::Tensor first,
                                                      at::Tensor new_ids, at::Tensor batch);
void gather_rows(at::Tensor src, at::Tensor ids, at::Tensor dst, at::Tensor slots);
std::tuple<at::Tensor, at::Tensor> logsoftmax_topk(at::Tensor logits, at::Tensor id_of, int64_t k);
int64_t topk_max_rows();
int64_t topk_max_k();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("unique_first_rows", &unique_first_rows, "ops.unique_first_rows");
  m.def("window_update_rows", &window_update_rows, "ops.window_update_rows");
  m.def("gather_rows", &gather_rows, "ops.gather_rows (skips rows aimed at the last row of dst)");
  m.def("logsoftmax_topk", &logsoftmax_topk, "the epilogue of ops.packed_head over logits [T, R]");
  m.def("topk_max_rows", &topk_max_rows, "the largest R logsoftmax_topk takes");
  m.def("topk_max_k", &topk_max_k, "the largest k logsoftmax_topk takes");
}
