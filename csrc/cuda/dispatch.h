// What the CUDA kernels are built for: the one list of head sizes, dtypes and
// block (chunk) sizes. The kernel dispatchers (tpp_decode.cu, prefill.cu,
// merge_attn_states.cu), the torch wrappers' argument checks and messages
// (torch_ops.cpp), the DType enum (launch.h) and the CPU emulator
// (tests/cuda/emulator) expand these lists; tests/cuda/test_cuda_dispatch.py
// holds them to vllm_chunkattn/kernels/support.py (CUDA).
//
// Plain macros and <string> only: included by nvcc (the .cu files), by the
// host compiler against the torch headers (torch_ops.cpp) and by a test
// program that prints the lists.
#pragma once

#include <string>

// X(head size)
#ifdef CHUNKATTN_CI_MINIMAL  // a quick compile check of one head size (scripts/check_cuda_compile.py --minimal)
#define CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(X) X(128)
#else
#define CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(X) X(64) X(128) X(256)
#endif

// X(DType enumerator, CUDA element type, c10::ScalarType enumerator, torch name)
#define CHUNKATTN_CUDA_FOR_EACH_DTYPE(X) \
  X(kHalf, __half, Half, "float16") X(kBFloat16, __nv_bfloat16, BFloat16, "bfloat16")

// X(block size): powers of two (positions map to blocks by shifts), each a
// multiple of 16 (one MMA row group of keys).
#define CHUNKATTN_CUDA_FOR_EACH_BLOCK_SIZE(X) X(16) X(32) X(64) X(128)

namespace chunkattn::cuda {

inline bool supports_head_size(int head_size) {
#define CHUNKATTN_IS_HEAD_SIZE(D) head_size == D ||
  return CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(CHUNKATTN_IS_HEAD_SIZE) false;
#undef CHUNKATTN_IS_HEAD_SIZE
}

inline bool supports_block_size(int block_size) {
#define CHUNKATTN_IS_BLOCK_SIZE(B) block_size == B ||
  return CHUNKATTN_CUDA_FOR_EACH_BLOCK_SIZE(CHUNKATTN_IS_BLOCK_SIZE) false;
#undef CHUNKATTN_IS_BLOCK_SIZE
}

// "64, 128, 256", "float16, bfloat16", "16, 32, 64, 128": what error messages name.
inline std::string supported_head_sizes() {
  std::string text;
#define CHUNKATTN_NAME_HEAD_SIZE(D) text += (text.empty() ? "" : ", ") + std::to_string(D);
  CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(CHUNKATTN_NAME_HEAD_SIZE)
#undef CHUNKATTN_NAME_HEAD_SIZE
  return text;
}

inline std::string supported_dtypes() {
  std::string text;
#define CHUNKATTN_NAME_DTYPE(ENUM, T, SCALAR, NAME) text += (text.empty() ? "" : ", ") + std::string(NAME);
  CHUNKATTN_CUDA_FOR_EACH_DTYPE(CHUNKATTN_NAME_DTYPE)
#undef CHUNKATTN_NAME_DTYPE
  return text;
}

inline std::string supported_block_sizes() {
  std::string text;
#define CHUNKATTN_NAME_BLOCK_SIZE(B) text += (text.empty() ? "" : ", ") + std::to_string(B);
  CHUNKATTN_CUDA_FOR_EACH_BLOCK_SIZE(CHUNKATTN_NAME_BLOCK_SIZE)
#undef CHUNKATTN_NAME_BLOCK_SIZE
  return text;
}

}  // namespace chunkattn::cuda
