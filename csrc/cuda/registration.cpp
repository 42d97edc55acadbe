// Registers the CUDA kernels as the CUDA implementations of the torch custom
// ops in the `chunkattn` namespace. The schemas are defined once, by the CPU
// extension's TORCH_LIBRARY(chunkattn, ...) (csrc/cpu/registration.cpp), so
// this library only adds TORCH_LIBRARY_IMPL(chunkattn, CUDA, ...): one Python
// call (torch.ops.chunkattn.<name>) dispatches on the tensors' device.
// Import order: vllm_chunkattn._C, then vllm_chunkattn._C_cuda (ops.py).
// Fake kernels for torch.compile live in Python (vllm_chunkattn/kernels/fake_ops.py).
#include <torch/extension.h>

#include "cuda/torch_ops.h"

TORCH_LIBRARY_IMPL(chunkattn, CUDA, m) {
  m.impl("write_kv_cache", &chunkattn::cuda_ops::write_kv_cache);
  m.impl("tpp_decode_plan", &chunkattn::cuda_ops::tpp_decode_plan);
  m.impl("tpp_decode", &chunkattn::cuda_ops::tpp_decode);
  m.impl("paged_prefill", &chunkattn::cuda_ops::paged_prefill);
  m.impl("merge_attn_states", &chunkattn::cuda_ops::merge_attn_states);
}

// Importing vllm_chunkattn._C_cuda loads this library and runs the registrations above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
