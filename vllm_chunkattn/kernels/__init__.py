"""The kernels: op wrappers dispatching by device (ops.py), op schemas' fake
kernels (fake_ops.py), the PyTorch fallback (torch_fallback.py), the KV layout
(layout.py) and what each platform supports (support.py). Importing this package
loads nothing compiled; importing ops.py loads the extensions."""
