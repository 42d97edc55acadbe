"""For tests, demos and benchmarks, not the serving path: the oracle
(reference.py), generated test models (models.py), workloads (workload.py),
a `vllm serve` runner (server.py), random paged-attention cases (paged_cases.py),
the low-precision comparison rule (compare.py) and the end-to-end runs (e2e_runs.py)."""
