"""wanswarm.kernels: the codec registry, its quantization kernels (Triton on CUDA) and their
pure-torch references.

Knows tensors, nothing of networks. Triton is imported lazily, only on CUDA.
"""
