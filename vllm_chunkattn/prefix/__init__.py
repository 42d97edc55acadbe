"""The prefix tree of a step's requests, recovered from vLLM's block tables
(tree.py), and its fixed-capacity device copy for CUDA graphs (device_buffers.py)."""
