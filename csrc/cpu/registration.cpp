// Registers the CPU kernels as torch custom ops in the `chunkattn` namespace,
// so Python calls them as torch.ops.chunkattn.<name>, like vLLM's own ops.
#include <torch/extension.h>

#include "chunkattn.h"

TORCH_LIBRARY(chunkattn, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(chunkattn, CPU, m) {
  m.impl("write_kv_cache", &chunkattn::write_kv_cache);
}

// Importing vllm_chunkattn._C loads this library and runs the registrations above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
