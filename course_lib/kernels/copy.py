"""A plain copy and a plain read, to measure the memory bandwidth the other kernels should be compared with."""

import numpy as np
from numba import float32

from course_lib.kernels import cuda, empty, launch, sm_count
from course_lib.kernels.overlap import inputs_ready, waits_for_inputs
from course_lib.kernels.vector import aligned16, f32x8, words

THREADS = 256  # threads per block
MAX_BLOCKS = 132 * 8  # grid cap: 8 blocks per SM of an H200; the grid-stride loop covers the rest


@cuda.jit
def copy_grid_stride(src, dst):
    """dst[i] = src[i] for all i: thread g copies g, g + s, g + 2s, ... (s = grid size), four loads in flight
    before the four stores (one load at a time leaves the memory system idle between them)."""
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
    most MAX_BLOCKS). Launches on stream, or through rt (a course_lib.gpu.runtime.Runtime) when given."""
    dst = empty(src.shape, np.float32, stream, rt) if dst is None else dst
    if dst.shape != src.shape:
        raise ValueError(f"copy: src {src.shape}, dst {dst.shape}")
    if blocks is None:
        blocks = max(1, min(MAX_BLOCKS, -(-src.size // THREADS)))
    launch(copy_grid_stride, blocks, THREADS, stream, rt, src, dst)
    return dst


READ_BLOCKS_PER_SM = 4  # the best grid of `read` from 1 MB to 1 GB among 1 to 32 blocks per SM


@cuda.jit
def read_grid_stride(w, out):
    """out[g] = the sum of the 8-element float32 groups g, g + s, g + 2s, ... of an array seen as uint32 words w, s
    the grid size (16-byte loads, four groups in flight before the adds): every byte is read once and each thread
    writes one float, so the time is the reading."""
    g, s, n = cuda.grid(1), cuda.gridsize(1), w.size // 8
    acc, i = float32(0), g
    while i + 3 * s < n:
        a, b, c, d = f32x8(w, i), f32x8(w, i + s), f32x8(w, i + 2 * s), f32x8(w, i + 3 * s)
        for e in range(8):
            acc += (a[e] + b[e]) + (c[e] + d[e])
        i += 4 * s
    while i < n:
        a = f32x8(w, i)
        for e in range(8):
            acc += a[e]
        i += s
    out[g] = acc


def read(src, blocks=None, out=None, stream=0, rt=None):
    """Reads src [n] float32 (n a multiple of 8, 16-byte aligned) once -> out [blocks * THREADS] float32, each
    thread's sum of its groups (their total is src.sum()). blocks: grid size (default READ_BLOCKS_PER_SM per SM).
    The time of this kernel is the shortest in which one kernel can read n bytes: the ceiling of the others."""
    if src.ndim != 1 or src.size % 8 or not aligned16(src):
        raise ValueError(f"read: src must be 1-D, 16-byte aligned, a multiple of 8 elements; got {src.shape}")
    blocks = READ_BLOCKS_PER_SM * sm_count() if blocks is None else blocks
    out = empty((blocks * THREADS,), np.float32, stream, rt) if out is None else out
    if out.shape != (blocks * THREADS,):
        raise ValueError(f"read: out {out.shape}, expected {(blocks * THREADS,)}")
    launch(read_grid_stride, blocks, THREADS, stream, rt, words(src), out)
    return out


@cuda.jit
def hold(microseconds):
    """Keep the GPU busy for about `microseconds` (one thread sleeping in 100 us steps). Launched before a timed
    region, it lets the host queue all the region's work first, so that events time the kernels back to back
    rather than the host's launches."""
    for _ in range(microseconds // 100):
        cuda.nanosleep(100_000)


@waits_for_inputs
@cuda.jit
def plus_one(x, y):
    """y = x + 1 (float32, flat): one link of a chain of kernels, each reading what the one before wrote, that may be
    launched programmatically (kernels/overlap.py). One thread per element."""
    inputs_ready()
    i = cuda.grid(1)
    if i < y.size:
        y[i] = x[i] + float32(1)
