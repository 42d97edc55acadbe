"""Install tooling: the vLLM patches and their applier (patching.py), and the
CUDA toolkit lookup for the build (cuda_toolkit.py). Standard library only:
setup.py imports it before torch's build helpers."""
