"""Row and element kernels of the baseline: embedding, RMSNorm, RoPE, SwiGLU's silu(gate) * up, residual add.

Also the block reductions (warp shuffles, then one value per warp in shared memory) that RMSNorm and attention
use. Activations are float32; `table` and `w` may be float32 or bf16 (uint16), see `course_lib.kernels`.
"""

import math
import operator

import numpy as np
from numba import float32

from course_lib.kernels import SIMULATOR, cuda, empty, for_weight_dtypes, launch, pick, reshaped, sized
from course_lib.kernels.overlap import inputs_ready, waits_for_inputs

THREADS = sized(256, 64)  # threads per block of the flat (one thread per element) kernels
NORM_THREADS = sized(256, 32)  # threads per block of rms_norm (one block per row); a multiple of 32
FULL_MASK = 0xFFFFFFFF


# ---- block reductions (blockDim.x a multiple of 32, at most 1024; every thread of the block must call) ----

@cuda.jit(device=True)
def segment_sum(v, width):
    """Sum of v over the aligned segment of `width` lanes (a power of two <= 32; 32: the warp) that holds this
    lane; every lane gets it (butterfly of shfl_xor_sync). Every lane of the warp calls, with the same width."""
    offset = width // 2
    while offset > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, offset)
        offset //= 2
    return v


@cuda.jit(device=True)
def segment_max(v, width):
    """Maximum of v over the aligned segment of `width` lanes that holds this lane (as segment_sum)."""
    offset = width // 2
    while offset > 0:
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, offset))
        offset //= 2
    return v


if SIMULATOR:  # the same butterflies exchanged once (the simulator's barriers are its slowest part; same bits)
    from course_lib.kernels import _sim

    shuffled_segment_sum, shuffled_segment_max = segment_sum, segment_max  # kept for the test of the twins
    segment_sum, segment_max = _sim.segment_reduce(operator.add), _sim.segment_reduce(max)


def _make_block_reduce(segment_reduce, identity):
    @cuda.jit(device=True)
    def block_reduce(v, scratch):
        """v reduced over the block (each warp, then the warps' results); every thread gets it. scratch: shared
        float32[32], free again on return."""
        lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
        v = segment_reduce(v, 32)
        if lane == 0:
            scratch[warp] = v
        cuda.syncthreads()
        v = scratch[lane] if lane < cuda.blockDim.x // 32 else identity
        v = segment_reduce(v, 32)
        cuda.syncthreads()
        return v

    return block_reduce


block_sum = _make_block_reduce(segment_sum, float32(0))  # block_sum(v, scratch): the sum of v over the block
block_max = _make_block_reduce(segment_max, float32(-math.inf))  # block_max(v, scratch): its maximum


@cuda.jit(device=True)
def row_rms(x, r, eps, scratch):
    """sqrt(mean(x[r]^2) + eps) for the row r of x [T, d], to every thread of the block (blockDim.x >=
    NORM_THREADS, a multiple of 32; scratch: shared float32[32]). The first NORM_THREADS threads add the squares,
    the others add nothing: the same bits in rms_norm's blocks and in the wider blocks of the kernels that fuse
    the norm into a matmul (the extra warps contribute zeros, which leave every sum of the reduction as it was)."""
    sum_sq = float32(0)
    if cuda.threadIdx.x < NORM_THREADS:
        for j in range(cuda.threadIdx.x, x.shape[1], NORM_THREADS):
            sum_sq += x[r, j] * x[r, j]
    return rms_of(block_sum(sum_sq, scratch), x.shape[1], eps)


@cuda.jit(device=True)
def rms_of(sum_sq, n, eps):
    """sqrt(sum_sq / n + eps) in float32: the end of row_rms, shared by the kernels that add the squares their own
    way (in row_rms's order)."""
    return float32(math.sqrt(sum_sq / float32(n) + eps))


# ---- kernels ----

def _make_embedding(to_f32):
    @waits_for_inputs
    @cuda.jit
    def embedding_rows(table, ids, out):
        """out[t, j] = table[ids[t], j]: one thread per output element."""
        inputs_ready()
        i = cuda.grid(1)
        d = out.shape[1]
        if i < out.shape[0] * d:
            t, j = i // d, i % d
            out[t, j] = to_f32(table[ids[t], j])

    return embedding_rows


def _make_rms_norm(to_f32):
    @waits_for_inputs
    @cuda.jit
    def rms_norm_rows(x, w, eps, out):
        """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w: one block per row r."""
        inputs_ready()
        scratch = cuda.shared.array(32, dtype=float32)
        r = cuda.blockIdx.x
        rms = row_rms(x, r, eps, scratch)
        for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            out[r, j] = x[r, j] / rms * to_f32(w[j])

    return rms_norm_rows


_EMBEDDING = for_weight_dtypes(_make_embedding)
_RMS_NORM = for_weight_dtypes(_make_rms_norm)


@cuda.jit(device=True)
def rotated_first(a, b, c, s):
    """The first element of the pair (a, b) rotated by the angle of cosine c and sine s: a c - b s, as fma(a, c,
    -(b s)). The fma is written out: left to itself, the compiler contracts a c - b s one way or the other depending
    on the kernel around it, and RoPE in its own kernel and in a matmul's epilogue would round differently."""
    return cuda.fma(a, c, -(b * s))


@cuda.jit(device=True)
def rotated_second(a, b, c, s):
    """The second element of the pair (a, b) rotated: a s + b c, as fma(a, s, b c) (see rotated_first)."""
    return cuda.fma(a, s, b * c)


@cuda.jit
def rope_pairs(x, cos, sin, positions):
    """In place, one thread per pair (t, head, i < hd/2): (a, b) = x[t, head, i], x[t, head, i + hd/2] becomes
    (a c - b s, a s + b c) with c, s = cos, sin[positions[t], i]."""
    k = cuda.grid(1)
    n_heads, half = x.shape[1], x.shape[2] // 2
    if k < x.shape[0] * n_heads * half:
        t, rest = k // (n_heads * half), k % (n_heads * half)
        h, i = rest // half, rest % half
        c, s = cos[positions[t], i], sin[positions[t], i]
        a, b = x[t, h, i], x[t, h, i + half]
        x[t, h, i] = rotated_first(a, b, c, s)
        x[t, h, i + half] = rotated_second(a, b, c, s)


@cuda.jit(device=True)
def silu(g):
    """silu(g) = g / (1 + exp(-g))."""
    return g / (float32(1) + float32(math.exp(-g)))


@cuda.jit(device=True)
def silu_times(g, u):
    """silu(g) * u, SwiGLU's product (one copy: the fused gate/up kernels use it too)."""
    return silu(g) * u


@cuda.jit
def silu_mul_flat(gate, up, out):
    """out[i] = silu(gate[i]) * up[i], silu(g) = g / (1 + exp(-g))."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = silu_times(gate[i], up[i])


@cuda.jit
def add_flat(a, b, out):
    """out[i] = a[i] + b[i] (out may be a or b)."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


# ---- host wrappers (stream: a CUDA stream; rt: a course_lib.gpu.runtime.Runtime, used instead when given) ----

def _blocks(n: int, threads: int) -> int:
    return max(1, -(-n // threads))


def embedding(table, ids, out=None, stream=0, rt=None):
    """table [V, d] float32 or bf16 (uint16), ids [T] int32 (each in [0, V), unchecked) -> out [T, d] float32."""
    T, d = ids.shape[0], table.shape[1]
    out = empty((T, d), np.float32, stream, rt) if out is None else out
    launch(pick(_EMBEDDING, table), _blocks(T * d, THREADS), THREADS, stream, rt, table, ids, out)
    return out


def rms_norm(x, w, eps, out=None, stream=0, rt=None):
    """x [T, d] float32, w [d] float32 or bf16 (uint16), eps -> out [T, d] float32 (may be x)."""
    out = empty(x.shape, np.float32, stream, rt) if out is None else out
    launch(pick(_RMS_NORM, w), x.shape[0], NORM_THREADS, stream, rt, x, w, np.float32(eps), out)
    return out


def rope(x, cos, sin, positions, stream=0, rt=None):
    """x [T, heads, hd] float32, rotated in place; cos, sin [n_positions, hd/2] float32 tables indexed by
    positions [T] int32 (Hugging Face pairing: i with i + hd/2). Returns x."""
    n = x.shape[0] * x.shape[1] * (x.shape[2] // 2)
    launch(rope_pairs, _blocks(n, THREADS), THREADS, stream, rt, x, cos, sin, positions)
    return x


def silu_mul(gate, up, out=None, stream=0, rt=None):
    """gate, up [T, d_ff] float32 (any equal shapes, C-contiguous) -> out = silu(gate) * up, same shape."""
    out = empty(gate.shape, np.float32, stream, rt) if out is None else out
    flat = (reshaped(gate, -1), reshaped(up, -1), reshaped(out, -1))
    launch(silu_mul_flat, _blocks(out.size, THREADS), THREADS, stream, rt, *flat)
    return out


def add(a, b, out=None, stream=0, rt=None):
    """a, b [T, d] float32 (any equal shapes, C-contiguous) -> out = a + b (the residual add; out may be a)."""
    out = empty(a.shape, np.float32, stream, rt) if out is None else out
    launch(add_flat, _blocks(out.size, THREADS), THREADS, stream, rt, reshaped(a, -1), reshaped(b, -1),
           reshaped(out, -1))
    return out
