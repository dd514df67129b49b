"""Kernels of our own where XLA's leave speed behind (`matmul`: decode's small-row
products on CPU; `append_attention`: a GPU decode call's attention, RoPE and cache
write in one kernel where XLA launches six), each with XLA's own operations as
the fallback.

`cpu_matmul` dispatches, `build` compiles and loads the kernel, `calibration`
times it against XLA's dot per product shape, `cpu` says what this CPU offers.
"""

from specjax.kernels.cpu_matmul import kernel_status, matmul, uses_kernel

__all__ = ["kernel_status", "matmul", "uses_kernel"]
