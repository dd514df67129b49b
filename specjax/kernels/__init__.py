"""Kernels of our own where XLA's leave speed behind (`matmul`: decode's small-row
products on CPU), each with XLA's own operation as the fallback.

`cpu_matmul` dispatches, `build` compiles and loads the kernel, `calibration`
times it against XLA's dot per product shape, `cpu` says what this CPU offers.
"""

from specjax.kernels.cpu_matmul import kernel_status, matmul, uses_kernel

__all__ = ["kernel_status", "matmul", "uses_kernel"]
