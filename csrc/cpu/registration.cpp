// The `chunkattn` torch library: the one place the op schemas are written
// (TORCH_LIBRARY), and the CPU kernels (TORCH_LIBRARY_IMPL). Python calls the
// ops as torch.ops.chunkattn.<name>, like vLLM's own ops; the CUDA extension
// (csrc/cuda/registration.cpp) adds CUDA kernels to these schemas and
// vllm_chunkattn/kernels/fake_ops.py their fake kernels, by op name.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "chunkattn.h"
#include "cpu/kernels.h"

namespace {
std::string cpu_isa() { return chunkattn::cpu::active_isa(); }

pybind11::dict tuning_dict(const chunkattn::cpu::CpuTuning& tuning) {
  pybind11::dict d;
  for (const auto& f : chunkattn::cpu::kCpuTuningFields) d[f.name] = tuning.*f.value;
  return d;
}
}  // namespace

TORCH_LIBRARY(chunkattn, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  // The decode step's work plan (csrc/common/decode_plan.h), built once per step into
  // the five plan tensors (resized here on the CPU; on CUDA, fixed buffers).
  m.def(
      "tpp_decode_plan(Tensor(a!) plan_header, Tensor(b!) plan_items, Tensor(c!) plan_node_work, "
      "Tensor(d!) plan_partial_work, Tensor(e!) plan_row_order, Tensor block_table, Tensor seq_lens, "
      "Tensor order, Tensor node_begin, Tensor node_end, Tensor node_chunk_begin, Tensor node_chunk_end, "
      "Tensor node_partial_offset, Tensor shared_chunks, Tensor row_partial_offsets, Tensor row_partials, "
      "int num_partial_rows, int num_heads, int num_kv_heads, int head_size, int block_size, "
      "ScalarType dtype) -> ()");
  // The variant arguments (sliding_window, logits_soft_cap: 0 for none; sinks, alibi_slopes:
  // None or float32 [num_heads]) are vLLM's; csrc/chunkattn.h says what each computes.
  m.def(
      "tpp_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor order, Tensor node_begin, Tensor node_end, Tensor node_chunk_begin, Tensor node_chunk_end, "
      "Tensor node_partial_offset, Tensor shared_chunks, Tensor row_partial_offsets, Tensor row_partials, "
      "Tensor plan_header, Tensor plan_items, Tensor plan_node_work, Tensor plan_partial_work, "
      "Tensor plan_row_order, float scale, int sliding_window=0, float logits_soft_cap=0., Tensor? sinks=None, "
      "Tensor? alibi_slopes=None) -> ()");
  m.def(
      "paged_prefill(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
      "Tensor block_table, float scale, int sliding_window=0, float logits_soft_cap=0., Tensor? sinks=None, "
      "Tensor? alibi_slopes=None) -> ()");
  // vLLM's merge_attn_states (vllm/v1/attention/ops/merge_attn_states.py), argument for argument, less
  // its FP8 output_scale: outputs [T, H, D], log-sum-exps [H, T] float32.
  m.def(
      "merge_attn_states(Tensor(a!) output, Tensor prefix_output, Tensor prefix_lse, Tensor suffix_output, "
      "Tensor suffix_lse, Tensor(b!)? output_lse=None, int? prefill_tokens_with_context=None) -> ()");
  // Which SIMD build the CPU kernels use now (amx|avx512bf16|avx512|avx2|scalar); for tests and benchmarks.
  m.def("cpu_isa() -> str", &cpu_isa);
}

TORCH_LIBRARY_IMPL(chunkattn, CPU, m) {
  m.impl("write_kv_cache", &chunkattn::write_kv_cache);
  m.impl("tpp_decode_plan", &chunkattn::tpp_decode_plan);
  m.impl("tpp_decode", &chunkattn::tpp_decode);
  m.impl("paged_prefill", &chunkattn::paged_prefill);
  m.impl("merge_attn_states", &chunkattn::merge_attn_states);
}

// Importing vllm_chunkattn._C loads this library and runs the registrations above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "kernel_support",
      [] {
        const chunkattn::cpu::CompiledSupport& s = chunkattn::cpu::compiled_support();
        pybind11::dict d;
        d["head_sizes"] = s.head_sizes;
        d["dtypes"] = s.dtypes;
        return d;
      },
      "Head sizes and dtypes (torch names) the CPU kernels are instantiated for (csrc/cpu/kernel_tables.h).");
  m.def(
      "cpu_tuning", [] { return tuning_dict(chunkattn::cpu::cpu_tuning()); },
      "The CPU kernels' run-time tile parameters now (CpuTuning, csrc/cpu/kernels.h).");
  m.def(
      "cpu_tuning_defaults", [] { return tuning_dict(chunkattn::cpu::CpuTuning{}); },
      "The built-in values of the CPU tile parameters.");
  m.def(
      "cpu_tuning_limits",
      [] {
        pybind11::dict d;
        for (const auto& f : chunkattn::cpu::kCpuTuningFields) d[f.name] = pybind11::make_tuple(f.min, f.max);
        return d;
      },
      "[min, max] of each CPU tuning parameter.");
  m.def(
      "set_cpu_tuning",
      [](const pybind11::dict& values) {
        TORCH_CHECK(values.size() == std::size(chunkattn::cpu::kCpuTuningFields),
                    "chunkattn: set_cpu_tuning needs every parameter of cpu_tuning_limits() and no other, got ",
                    static_cast<std::string>(pybind11::repr(values)));
        chunkattn::cpu::CpuTuning t;
        for (const auto& f : chunkattn::cpu::kCpuTuningFields) {
          TORCH_CHECK(values.contains(f.name), "chunkattn: set_cpu_tuning is missing ", f.name);
          t.*f.value = values[f.name].cast<int>();
        }
        chunkattn::cpu::set_cpu_tuning(t);
      },
      pybind11::arg("values"),
      "Sets the CPU kernels' tile parameters from {name: value}, every one and each within cpu_tuning_limits(); "
      "call before kernels run.");
}
