"""Greedy sampling: the index of the largest logit, in one block.

Ties go to the lowest index (as numpy.argmax). NaN does not win silently: if any logit is NaN the result is
NO_TOKEN (-1), which is no token id, so the caller must check for it (numpy.argmax would return the index of
the first NaN instead). If every logit is -inf the result is 0.
"""

import math

import numpy as np
from numba import float32, int32

from course_lib.kernels import cuda, empty, launch, sized

THREADS = sized(256, 32)  # one block; a multiple of 32
FULL_MASK = 0xFFFFFFFF
NO_TOKEN = -1
_NONE = 2**31 - 1  # index of a thread that saw no element


@cuda.jit(device=True)
def better(v, i, other_v, other_i):
    """Does (other_v, other_i) beat (v, i)? Larger value, or the same value at a lower index."""
    return other_v > v or (other_v == v and other_i < i)


@cuda.jit(device=True)
def warp_argmax(v, i, nan):
    """(value, index, any NaN) of the warp's best candidate, in lane 0 (shfl_down_sync tree)."""
    offset = 16
    while offset > 0:
        other_v = cuda.shfl_down_sync(FULL_MASK, v, offset)
        other_i = cuda.shfl_down_sync(FULL_MASK, i, offset)
        nan |= cuda.shfl_down_sync(FULL_MASK, nan, offset)
        if better(v, i, other_v, other_i):
            v, i = other_v, other_i
        offset //= 2
    return v, i, nan


@cuda.jit
def argmax_block(logits, out):
    """out[0] = argmax(logits), or NO_TOKEN if a logit is NaN; launch with one block of THREADS threads."""
    best_v = cuda.shared.array(32, dtype=float32)
    best_i = cuda.shared.array(32, dtype=int32)
    any_nan = cuda.shared.array(32, dtype=int32)
    tid = cuda.threadIdx.x
    lane, warp = tid % 32, tid // 32
    v, i, nan = float32(-math.inf), int32(_NONE), int32(0)
    for j in range(tid, logits.size, THREADS):  # increasing j: only a strictly larger value replaces
        x = logits[j]
        if x != x:
            nan = int32(1)
        elif x > v or i == _NONE:
            v, i = x, int32(j)
    v, i, nan = warp_argmax(v, i, nan)
    if lane == 0:
        best_v[warp], best_i[warp], any_nan[warp] = v, i, nan
    cuda.syncthreads()
    if warp == 0:
        n_warps = THREADS // 32
        v = best_v[lane] if lane < n_warps else float32(-math.inf)
        i = best_i[lane] if lane < n_warps else int32(_NONE)
        nan = any_nan[lane] if lane < n_warps else int32(0)
        v, i, nan = warp_argmax(v, i, nan)
        if lane == 0:
            out[0] = NO_TOKEN if nan else i


def argmax(logits, out=None, stream=0, rt=None):
    """logits [V] float32 -> out [1] int32: the lowest index of the largest logit; NO_TOKEN (-1) if any is NaN.
    Launches on stream, or through rt (a course_lib.runtime.Runtime) when given."""
    out = empty(1, np.int32, stream, rt) if out is None else out
    launch(argmax_block, 1, THREADS, stream, rt, logits, out)
    return out
