"""Benchmarks of vllm-chunkattn against stock vLLM."""
