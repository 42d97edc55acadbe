"""Benchmarks of vllm-chunkattn against stock vLLM: kernels (CPU and GPU) and serving."""
