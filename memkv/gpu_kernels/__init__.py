"""memkv's data work as CUDA kernels (CuPy), with a CPU reference of the same math.

``cuda/*.cu`` holds the kernels: int8 and 4-bit group quantisation, fp32/fp16/bf16
casts with an overflow count, the token-axis delta of Delta+RL, block gather and
scatter, and the paged-cache copies of the vLLM connector. :mod:`.ops` is the API
(a kernel for CUDA tensors where a GPU is usable, :mod:`.reference` otherwise);
:mod:`.loader` compiles and caches the modules; :mod:`.unified` is the optional
managed-memory arena. ``backend()`` says which runs here.
"""

from memkv.gpu_kernels.loader import backend, kernel_sources

__all__ = ["backend", "kernel_sources"]
