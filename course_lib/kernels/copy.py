"""A plain copy, to measure the memory bandwidth the other kernels should be compared with."""

import numpy as np

from course_lib.kernels import cuda, empty, launch

THREADS = 256  # threads per block
MAX_BLOCKS = 132 * 8  # grid cap: 8 blocks per SM of an H200; the grid-stride loop covers the rest


@cuda.jit
def copy_grid_stride(src, dst):
    """dst[i] = src[i] for all i: thread g copies g, g + s, g + 2s, ... (s = grid size), four loads in flight
    before the four stores (3.5 TB/s on the H200, against 2.9 with one load at a time)."""
    i, s, n = cuda.grid(1), cuda.gridsize(1), src.size
    while i + 3 * s < n:
        a, b, c, d = src[i], src[i + s], src[i + 2 * s], src[i + 3 * s]
        dst[i], dst[i + s], dst[i + 2 * s], dst[i + 3 * s] = a, b, c, d
        i += 4 * s
    while i < n:
        dst[i] = src[i]
        i += s


def copy(src, dst=None, blocks=None, stream=0, rt=None):
    """src [n] float32 -> dst [n] float32. blocks: grid size (default: enough for one element per thread, at
    most MAX_BLOCKS). Launches on stream, or through rt (a course_lib.runtime.Runtime) when given."""
    dst = empty(src.shape, np.float32, stream, rt) if dst is None else dst
    if dst.shape != src.shape:
        raise ValueError(f"copy: src {src.shape}, dst {dst.shape}")
    if blocks is None:
        blocks = max(1, min(MAX_BLOCKS, -(-src.size // THREADS)))
    launch(copy_grid_stride, blocks, THREADS, stream, rt, src, dst)
    return dst


@cuda.jit
def hold(microseconds):
    """Keep the GPU busy for about `microseconds` (one thread sleeping in 100 us steps). Launched before a timed
    region, it lets the host queue all the region's work first, so that events time the kernels back to back
    rather than the host's launches."""
    for _ in range(microseconds // 100):
        cuda.nanosleep(100_000)
