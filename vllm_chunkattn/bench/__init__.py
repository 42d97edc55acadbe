"""Benchmarks of the kernels and of serving (see each module's docstring)."""
