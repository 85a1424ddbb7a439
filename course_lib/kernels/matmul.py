"""The baseline matrix product, as a training framework would do it: C = A @ B with 64 x 64 output tiles.

A [M, K] holds activations (float32), B [K, N] weights (float32 or bf16 as uint16). Each block of 16 x 16
threads owns a 64 x 64 tile of C; it walks K in steps of 16, staging a 64 x 16 slice of A and a 16 x 64 slice of
B in shared memory, and each thread accumulates a 4 x 4 micro-tile: rows ty + 16 i and columns tx + 16 j
(i, j < 4), so that neighbouring threads read neighbouring shared-memory words and write neighbouring columns.
Good at large M; at M = 1 (decoding one token) it launches N / 64 blocks that each use 1 row of 64.
"""

import functools

import numpy as np
from numba import float32, uint16

from course_lib.kernels import cuda, empty, for_weight_dtypes, launch, pick, sized

SIDE = sized(16, 4)  # threads per block: SIDE x SIDE = 256 (16 in the simulator)
MICRO = 4  # each thread computes MICRO x MICRO outputs (SIDE * MICRO = 64)
THREADS = SIDE * SIDE
TILE_M = TILE_N = SIDE * MICRO  # rows and columns of C per block: 64 (16 in the simulator)
TILE_K = 16  # step along K
BIAS_THREADS = sized(256, 64)
T_TILE = sized(32, 8)  # transpose: 32 x 32 tiles (8 x 8 in the simulator)
T_ROWS = sized(8, 2)  # transpose: a block of T_TILE x T_ROWS threads, 4 rows each
T_PITCH = T_TILE + 1  # shared tile row length: the extra column avoids bank conflicts


@functools.cache
def tile_product_for(to_f32):
    """The device function tile_product(a, b, row0, col0, acc) of the weights read by to_f32: the body of the
    tiled matmul, shared with the fused SwiGLU kernels (kernels/fused.py), so that each sums in the same order."""

    @cuda.jit(device=True)
    def tile_product(a, b, row0, col0, acc):
        """acc[i, j] = a[row0 + ty + 16 i, :] . b[:, col0 + tx + 16 j] for i, j < 4 (the block's 64 x 64 tile of
        a [M, K] @ b [K, N] from (row0, col0); zeros staged outside a and b). Every thread of the block calls."""
        a_tile = cuda.shared.array((TILE_K, TILE_M), dtype=float32)  # a_tile[k, m]: A's slice, transposed
        b_tile = cuda.shared.array((TILE_K, TILE_N), dtype=float32)  # b_tile[k, n]
        M, K, N = a.shape[0], a.shape[1], b.shape[1]
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        tid = ty * SIDE + tx
        for i in range(MICRO):
            for j in range(MICRO):
                acc[i, j] = float32(0)
        for k0 in range(0, K, TILE_K):
            for e in range(tid, TILE_M * TILE_K, THREADS):  # stage A[row0:+64, k0:+16], zeros outside A
                m, k = e // TILE_K, e % TILE_K
                inside = row0 + m < M and k0 + k < K
                a_tile[k, m] = a[row0 + m, k0 + k] if inside else float32(0)
            for e in range(tid, TILE_K * TILE_N, THREADS):  # stage B[k0:+16, col0:+64], zeros outside B
                k, n = e // TILE_N, e % TILE_N
                inside = k0 + k < K and col0 + n < N
                b_tile[k, n] = to_f32(b[k0 + k, col0 + n]) if inside else float32(0)
            cuda.syncthreads()
            for k in range(TILE_K):
                for i in range(MICRO):
                    a_ik = a_tile[k, ty + SIDE * i]
                    for j in range(MICRO):
                        acc[i, j] += a_ik * b_tile[k, tx + SIDE * j]
            cuda.syncthreads()

    return tile_product


@cuda.jit(device=True)
def store_tile(acc, c, row0, col0):
    """c[row0 + ty + 16 i, col0 + tx + 16 j] = acc[i, j], inside c: a thread's micro-tile (tile_product's layout)."""
    for i in range(MICRO):
        for j in range(MICRO):
            r, col = row0 + cuda.threadIdx.y + SIDE * i, col0 + cuda.threadIdx.x + SIDE * j
            if r < c.shape[0] and col < c.shape[1]:
                c[r, col] = acc[i, j]


def _make_matmul(to_f32):
    tile_product = tile_product_for(to_f32)

    @cuda.jit
    def matmul_tiled(a, b, c):
        """c[M, N] = a[M, K] @ b[K, N]; grid (ceil(N / 64), ceil(M / 64)), block (16, 16)."""
        acc = cuda.local.array((MICRO, MICRO), dtype=float32)
        row0, col0 = cuda.blockIdx.y * TILE_M, cuda.blockIdx.x * TILE_N
        tile_product(a, b, row0, col0, acc)
        store_tile(acc, c, row0, col0)

    return matmul_tiled


def _make_add_bias(to_f32):
    @cuda.jit
    def add_bias_rows(c, bias):
        """c[r, n] += bias[n], one thread per element."""
        i = cuda.grid(1)
        N = c.shape[1]
        if i < c.shape[0] * N:
            c[i // N, i % N] += to_f32(bias[i % N])

    return add_bias_rows


def _make_transpose(tile_dtype):
    @cuda.jit
    def transpose_tiled(x, out):
        """out[n, m] = x[m, n] through a 32 x 33 shared tile; grid (ceil(N / 32), ceil(M / 32)), block (32, 8)."""
        tile = cuda.shared.array((T_TILE, T_PITCH), dtype=tile_dtype)
        M, N = x.shape[0], x.shape[1]
        m0, n0 = cuda.blockIdx.y * T_TILE, cuda.blockIdx.x * T_TILE
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        for dy in range(0, T_TILE, T_ROWS):  # read rows of x, coalesced along n
            if m0 + ty + dy < M and n0 + tx < N:
                tile[ty + dy, tx] = x[m0 + ty + dy, n0 + tx]
        cuda.syncthreads()
        for dy in range(0, T_TILE, T_ROWS):  # write rows of out, coalesced along m
            if n0 + ty + dy < N and m0 + tx < M:
                out[n0 + ty + dy, m0 + tx] = tile[tx, ty + dy]

    return transpose_tiled


_MATMUL = for_weight_dtypes(_make_matmul)
_ADD_BIAS = for_weight_dtypes(_make_add_bias)
_TRANSPOSE = {np.dtype(np.float32): _make_transpose(float32), np.dtype(np.uint16): _make_transpose(uint16)}


# host wrappers: stream, a CUDA stream; rt, a course_lib.gpu.runtime.Runtime used instead when given

def matmul(a, b, out=None, stream=0, rt=None):
    """a [M, K] float32 @ b [K, N] float32 or bf16 (uint16) -> out [M, N] float32."""
    (M, K), (K2, N) = a.shape, b.shape
    if K != K2:
        raise ValueError(f"matmul: a is {a.shape}, b is {b.shape}")
    out = empty((M, N), np.float32, stream, rt) if out is None else out
    grid = (-(-N // TILE_N), -(-M // TILE_M))
    launch(pick(_MATMUL, b), grid, (SIDE, SIDE), stream, rt, a, b, out)
    return out


def add_bias(c, bias, stream=0, rt=None):
    """c [M, N] float32 += bias [N] float32 or bf16 (uint16), in place. Returns c."""
    n = c.shape[0] * c.shape[1]
    launch(pick(_ADD_BIAS, bias), max(1, -(-n // BIAS_THREADS)), BIAS_THREADS, stream, rt, c, bias)
    return c


def transpose(x, out=None, stream=0, rt=None):
    """x [M, N] float32 or uint16 (bf16 bits) -> out [N, M] of the same dtype (e.g. embed.T for the logits)."""
    M, N = x.shape
    out = empty((N, M), x.dtype, stream, rt) if out is None else out
    grid = (-(-N // T_TILE), -(-M // T_TILE))
    launch(pick(_TRANSPOSE, x), grid, (T_TILE, T_ROWS), stream, rt, x, out)
    return out
