"""Numba CUDA kernels, one module per topic."""
