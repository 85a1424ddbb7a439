"""The GPU engine: the forward pass as kernels (backend), one way to launch them (runtime), the step plan replayed
for every token (plan), CUDA graphs (graphs) and the paged KV cache (kv_cache)."""
