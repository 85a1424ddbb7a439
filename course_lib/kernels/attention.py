"""Baseline causal grouped-query attention over a contiguous KV cache: one block per (query head, token).

Two passes over the visible keys 0..positions[t], scores recomputed rather than stored, so any cache length S
works with fixed shared memory:
  1. each thread scores keys tid, tid + THREADS, ...; the block takes the maximum m;
  2. keys in chunks of THREADS: each thread turns one score into p = exp(score - m) in shared memory, then
     every thread adds sum_j p_j v[j, d] for its output components d; the block sums the p's into l.
out = (sum_j p_j v_j) / l. Query head h reads KV head h // (H / Hkv).
"""

import math

import numpy as np
from numba import float32

from course_lib.kernels import cuda, empty, launch, sized
from course_lib.kernels.elementwise import block_max, block_sum

THREADS = sized(128, 32)  # threads per block; a multiple of 32
MAX_HEAD_DIM = 256  # shared memory for one query row
D_PER_THREAD = MAX_HEAD_DIM // THREADS  # output components per thread


@cuda.jit(device=True)
def scaled_score(q_row, k, s, kv_head, scale):
    """(q . k[s, kv_head]) * scale."""
    dot = float32(0)
    for d in range(k.shape[2]):
        dot += q_row[d] * k[s, kv_head, d]
    return dot * scale


@cuda.jit
def attention_two_pass(q, k, v, positions, scale, out):
    """out[t, h] = softmax(q[t, h] . k[:n] * scale) @ v[:n], n = positions[t] + 1; grid (H, T), block THREADS."""
    q_row = cuda.shared.array(MAX_HEAD_DIM, dtype=float32)
    p_chunk = cuda.shared.array(THREADS, dtype=float32)
    scratch = cuda.shared.array(32, dtype=float32)
    acc = cuda.local.array(D_PER_THREAD, dtype=float32)
    h, t, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    hd = q.shape[2]
    kv_head = h // (q.shape[1] // k.shape[1])
    n_keys = min(positions[t] + 1, k.shape[0])
    for d in range(tid, hd, THREADS):
        q_row[d] = q[t, h, d]
    cuda.syncthreads()

    m = float32(-math.inf)  # pass 1: the largest score
    for s in range(tid, n_keys, THREADS):
        m = max(m, scaled_score(q_row, k, s, kv_head, scale))
    m = block_max(m, scratch)

    for i in range(D_PER_THREAD):  # pass 2: exp(score - m), weighted sum of the values
        acc[i] = float32(0)
    l_part = float32(0)
    for s0 in range(0, n_keys, THREADS):
        s = s0 + tid
        p = float32(0)
        if s < n_keys:
            p = float32(math.exp(scaled_score(q_row, k, s, kv_head, scale) - m))
        l_part += p
        p_chunk[tid] = p
        cuda.syncthreads()
        for i in range(D_PER_THREAD):
            d = tid + i * THREADS
            if d < hd:
                a = acc[i]
                for j in range(min(THREADS, n_keys - s0)):
                    a += p_chunk[j] * v[s0 + j, kv_head, d]
                acc[i] = a
        cuda.syncthreads()
    l_sum = block_sum(l_part, scratch)
    for i in range(D_PER_THREAD):
        d = tid + i * THREADS
        if d < hd:
            out[t, h, d] = acc[i] / l_sum


def attention(q, k, v, positions, out=None, stream=0, rt=None):
    """q [T, H, hd], k and v [S, Hkv, hd] (cache rows 0..S-1), positions [T] int32 (each < S), all float32
    -> out [T, H, hd] float32. Query t sees keys 0..positions[t]; H a multiple of Hkv; hd <= MAX_HEAD_DIM.
    Launches on stream, or through rt (a course_lib.gpu.runtime.Runtime) when given."""
    T, H, hd = q.shape
    if H % k.shape[1] or hd > MAX_HEAD_DIM or k.shape[2] != hd or v.shape != k.shape:
        raise ValueError(f"attention: q {q.shape}, k {k.shape}, v {v.shape} (hd <= {MAX_HEAD_DIM})")
    out = empty((T, H, hd), np.float32, stream, rt) if out is None else out
    scale = np.float32(1.0 / np.sqrt(hd))
    launch(attention_two_pass, (H, T), THREADS, stream, rt, q, k, v, positions, scale, out)
    return out
