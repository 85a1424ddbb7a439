"""Matrix products for decoding: a few rows of activations (R <= 16) against big weights.

The tiled matmul (matmul.py) spends 64-row tiles on one row and launches only N / 64 blocks. Here every weight
is read once, by reads the memory system likes, and the grid is sized to fill the GPU.

Split-K narrow matmul, out[R, N] = a[R, K] @ b[K, N] (+ bias[N]), in two kernels:
- `matmul_split_k`: a block of WARPS warps (8; 2 in the simulator) owns a group of 32 adjacent columns and one
  slice of K (grid: column groups x S slices, S from `split_k`). Lane l owns column col0 + l, so a warp reads
  one row of the group as 32 adjacent floats (one 128-byte transaction). Warp w takes the rows k0 + w,
  k0 + w + WARPS, ... of the slice, UNROLL (4) rows at a time: four weight loads in flight, then the FMAs into
  R running sums (R is a compile-time constant: one kernel per R, the sums stay in registers). The warps' sums
  meet in shared memory and are added in warp order into partial[s, r, col].
- `matmul_split_k_pairs`: the same for bf16 weights with N even, read through a uint32 view of the uint16
  weights: lane l owns columns 2 (p0 + l) and 2 (p0 + l) + 1 (one 4-byte load brings both), a group is 64
  columns, and a warp still reads 128 bytes per row. bf16 with N odd uses `matmul_split_k` with uint16 reads.
- `reduce_slices` (`reduce_slices_bias`): out[r, n] = partial[0, r, n] + ... + partial[S - 1, r, n] (+ bias[n]),
  in slice order. No atomics anywhere, so the result is the same bit for bit from run to run. The bias is added
  here, for free (no separate bias kernel).

Transposed matmul, out[R, N] = a[R, K] @ b[N, K].T without copying b (tied-embedding logits: b is the [vocab, d]
embedding table), in one kernel, `matmul_transposed_warps`: one warp per row n of b (8 warps per block, 2 in the
simulator; a grid-stride loop over rows when the grid is capped). Lane l reads k = l, l + 32, ... (coalesced;
bf16 with K even: `matmul_transposed_warps_pairs` reads uint32 pairs, k = 2 l and 2 l + 1, then 2 (l + 32), ...),
UNROLL loads in flight, into R sums; each sum is added across the warp by shuffles (warp_sum) and lane 0 writes
out[r, n].

Kernels are built on first use by factories, one per (R, weight kind), and kept in a dict; weight kinds are
"f32", "bf16" (uint16, one column per lane) and "bf16x2" (uint16 read as uint32 pairs).
"""

import functools

import numpy as np
from numba import float32, uint32

from course_lib.kernels import SIMULATOR, WEIGHT_READERS, cuda, empty, launch, pick, sized
from course_lib.kernels import matmul as mm
from course_lib.kernels.elementwise import warp_sum

MAX_ROWS = 16  # largest R: more rows go to the tiled matmul (see `linear`)
WARPS = sized(8, 2)  # warps per block (the simulator keeps full 32-lane warps, but fewer of them)
THREADS = 32 * WARPS
UNROLL = 4  # weight loads in flight per thread
MIN_SLICE = 64  # no K-slice shorter than this
BLOCKS_PER_SM = 4  # split_k's target: this many blocks per SM
SIM_SMS = 2  # "SMs" of the simulator, for split_k (small: few blocks, as the simulator is slow)
REDUCE_THREADS = sized(256, 64)
MAX_GRID = sized(1 << 20, 2)  # grid cap of the grid-stride kernels (never reached on a GPU)


# ---- how K is split ----

def split_k(K: int, N: int, cols_per_block: int, sms: int) -> int:
    """The number S of K-slices of the split-K matmul (N columns in groups of cols_per_block, on `sms` SMs).

    The grid is (column groups) x S blocks, G = ceil(N / cols_per_block) groups: S is the integer that brings
    G x S closest to BLOCKS_PER_SM x sms (a few blocks per SM), but at most K // MIN_SLICE, so that no slice
    is shorter than MIN_SLICE (slice s covers k in [s K // S, (s + 1) K // S): its length is K // S or one
    more), and at least 1 (then the one slice may be short: K < 2 MIN_SLICE).
    """
    groups = -(-N // cols_per_block)
    slices = round(BLOCKS_PER_SM * sms / groups)
    return max(1, min(slices, K // MIN_SLICE))


@functools.cache
def sm_count() -> int:
    """SMs of the current GPU (SIM_SMS in the simulator)."""
    return SIM_SMS if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


# ---- device functions ----

@cuda.jit(device=True)
def bf16_low(w):
    """The float32 value of the bf16 in the low half of w (uint32: the first of two adjacent uint16)."""
    return cuda.libdevice.int_as_float(w << uint32(16))


@cuda.jit(device=True)
def bf16_high(w):
    """The float32 value of the bf16 in the high half of w (the second of the two uint16)."""
    return cuda.libdevice.int_as_float(w & uint32(0xFFFF0000))


@cuda.jit(device=True)
def store_partial(sums, partial, s, col0):
    """partial[s, r, col0 + c] = sums[0, r, c] + sums[1, r, c] + ... (warps in order), for columns < N.
    sums: shared [WARPS, R, width], written by all warps before the call (after a syncthreads)."""
    rows, width = sums.shape[1], sums.shape[2]
    for e in range(cuda.threadIdx.x, rows * width, cuda.blockDim.x):
        r, c = e // width, e % width
        if col0 + c < partial.shape[2]:
            v = sums[0, r, c]
            for w in range(1, WARPS):
                v += sums[w, r, c]
            partial[s, r, col0 + c] = v


@cuda.jit(device=True)
def sum_slices(partial, r, n):
    """partial[0, r, n] + partial[1, r, n] + ..., in slice order."""
    v = float32(0)
    for s in range(partial.shape[0]):
        v += partial[s, r, n]
    return v


# ---- kernel factories: one kernel per (rows, weight kind) ----

def _make_split_k(rows, to_f32):
    @cuda.jit
    def matmul_split_k(a, b, partial):
        """partial[s, r, n] = sum of a[r, k] b[k, n] over slice s of K; grid (ceil(N / 32), S), block THREADS."""
        sums = cuda.shared.array((WARPS, rows, 32), dtype=float32)
        acc = cuda.local.array(rows, dtype=float32)
        K, N, S = b.shape[0], b.shape[1], partial.shape[0]
        lane, warp, s = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32, cuda.blockIdx.y
        col = cuda.blockIdx.x * 32 + lane
        k, k_end = s * K // S + warp, (s + 1) * K // S
        for r in range(rows):
            acc[r] = float32(0)
        if col < N:
            while k + (UNROLL - 1) * WARPS < k_end:  # rows k, k + WARPS, k + 2 WARPS, k + 3 WARPS
                w0 = to_f32(b[k, col])
                w1 = to_f32(b[k + WARPS, col])
                w2 = to_f32(b[k + 2 * WARPS, col])
                w3 = to_f32(b[k + 3 * WARPS, col])
                for r in range(rows):
                    acc[r] += a[r, k] * w0
                    acc[r] += a[r, k + WARPS] * w1
                    acc[r] += a[r, k + 2 * WARPS] * w2
                    acc[r] += a[r, k + 3 * WARPS] * w3
                k += UNROLL * WARPS
            while k < k_end:
                w0 = to_f32(b[k, col])
                for r in range(rows):
                    acc[r] += a[r, k] * w0
                k += WARPS
        for r in range(rows):
            sums[warp, r, lane] = acc[r]
        cuda.syncthreads()
        store_partial(sums, partial, s, cuda.blockIdx.x * 32)

    return matmul_split_k


def _make_split_k_pairs(rows):
    @cuda.jit
    def matmul_split_k_pairs(a, b2, partial):
        """As matmul_split_k for bf16 weights b [K, N] (N even) seen as b2 = uint32 [K, N / 2]: lane l of group
        g owns columns 2 p and 2 p + 1, p = 32 g + l; grid (ceil(N / 64), S), block THREADS."""
        sums = cuda.shared.array((WARPS, rows, 64), dtype=float32)
        lo = cuda.local.array(rows, dtype=float32)  # sums of column 2 p
        hi = cuda.local.array(rows, dtype=float32)  # sums of column 2 p + 1
        K, P, S = b2.shape[0], b2.shape[1], partial.shape[0]
        lane, warp, s = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32, cuda.blockIdx.y
        p = cuda.blockIdx.x * 32 + lane
        k, k_end = s * K // S + warp, (s + 1) * K // S
        for r in range(rows):
            lo[r] = float32(0)
            hi[r] = float32(0)
        if p < P:
            while k + (UNROLL - 1) * WARPS < k_end:
                w0 = b2[k, p]
                w1 = b2[k + WARPS, p]
                w2 = b2[k + 2 * WARPS, p]
                w3 = b2[k + 3 * WARPS, p]
                l0, l1, l2, l3 = bf16_low(w0), bf16_low(w1), bf16_low(w2), bf16_low(w3)
                h0, h1, h2, h3 = bf16_high(w0), bf16_high(w1), bf16_high(w2), bf16_high(w3)
                for r in range(rows):
                    x0, x1, x2, x3 = a[r, k], a[r, k + WARPS], a[r, k + 2 * WARPS], a[r, k + 3 * WARPS]
                    lo[r] += x0 * l0
                    hi[r] += x0 * h0
                    lo[r] += x1 * l1
                    hi[r] += x1 * h1
                    lo[r] += x2 * l2
                    hi[r] += x2 * h2
                    lo[r] += x3 * l3
                    hi[r] += x3 * h3
                k += UNROLL * WARPS
            while k < k_end:
                w0 = b2[k, p]
                l0, h0 = bf16_low(w0), bf16_high(w0)
                for r in range(rows):
                    lo[r] += a[r, k] * l0
                    hi[r] += a[r, k] * h0
                k += WARPS
        for r in range(rows):
            sums[warp, r, 2 * lane] = lo[r]
            sums[warp, r, 2 * lane + 1] = hi[r]
        cuda.syncthreads()
        store_partial(sums, partial, s, cuda.blockIdx.x * 64)

    return matmul_split_k_pairs


def _make_transposed(rows, to_f32):
    @cuda.jit
    def matmul_transposed_warps(a, b, out):
        """out[r, n] = a[r, :] . b[n, :] (b [N, K]): one warp per row n, lanes along K; block THREADS."""
        acc = cuda.local.array(rows, dtype=float32)
        N, K = b.shape[0], b.shape[1]
        lane = cuda.threadIdx.x % 32
        for n in range(cuda.grid(1) // 32, N, cuda.gridsize(1) // 32):  # the same n for the whole warp
            for r in range(rows):
                acc[r] = float32(0)
            k = lane
            while k + (UNROLL - 1) * 32 < K:
                w0 = to_f32(b[n, k])
                w1 = to_f32(b[n, k + 32])
                w2 = to_f32(b[n, k + 64])
                w3 = to_f32(b[n, k + 96])
                for r in range(rows):
                    acc[r] += a[r, k] * w0
                    acc[r] += a[r, k + 32] * w1
                    acc[r] += a[r, k + 64] * w2
                    acc[r] += a[r, k + 96] * w3
                k += UNROLL * 32
            while k < K:
                w0 = to_f32(b[n, k])
                for r in range(rows):
                    acc[r] += a[r, k] * w0
                k += 32
            for r in range(rows):
                v = warp_sum(acc[r])
                if lane == 0:
                    out[r, n] = v

    return matmul_transposed_warps


def _make_transposed_pairs(rows):
    @cuda.jit
    def matmul_transposed_warps_pairs(a, b2, out):
        """As matmul_transposed_warps for bf16 b [N, K] (K even) seen as b2 = uint32 [N, K / 2]: lane l reads
        the pairs p = l, l + 32, ..., that is k = 2 p and 2 p + 1."""
        acc = cuda.local.array(rows, dtype=float32)
        N, P = b2.shape[0], b2.shape[1]
        lane = cuda.threadIdx.x % 32
        for n in range(cuda.grid(1) // 32, N, cuda.gridsize(1) // 32):
            for r in range(rows):
                acc[r] = float32(0)
            p = lane
            while p + (UNROLL - 1) * 32 < P:
                w0 = b2[n, p]
                w1 = b2[n, p + 32]
                w2 = b2[n, p + 64]
                w3 = b2[n, p + 96]
                l0, l1, l2, l3 = bf16_low(w0), bf16_low(w1), bf16_low(w2), bf16_low(w3)
                h0, h1, h2, h3 = bf16_high(w0), bf16_high(w1), bf16_high(w2), bf16_high(w3)
                k = 2 * p  # pair p + 32 j holds k + 64 j and k + 64 j + 1
                for r in range(rows):
                    acc[r] += a[r, k] * l0
                    acc[r] += a[r, k + 1] * h0
                    acc[r] += a[r, k + 64] * l1
                    acc[r] += a[r, k + 65] * h1
                    acc[r] += a[r, k + 128] * l2
                    acc[r] += a[r, k + 129] * h2
                    acc[r] += a[r, k + 192] * l3
                    acc[r] += a[r, k + 193] * h3
                p += UNROLL * 32
            while p < P:
                w0 = b2[n, p]
                l0, h0 = bf16_low(w0), bf16_high(w0)
                for r in range(rows):
                    acc[r] += a[r, 2 * p] * l0
                    acc[r] += a[r, 2 * p + 1] * h0
                p += 32
            for r in range(rows):
                v = warp_sum(acc[r])
                if lane == 0:
                    out[r, n] = v

    return matmul_transposed_warps_pairs


@cuda.jit
def reduce_slices(partial, out):
    """out[r, n] = sum over s of partial[s, r, n], in order; grid-stride over the R x N outputs."""
    N = out.shape[1]
    for i in range(cuda.grid(1), out.shape[0] * N, cuda.gridsize(1)):
        out[i // N, i % N] = sum_slices(partial, i // N, i % N)


def _make_reduce_bias(to_f32):
    @cuda.jit
    def reduce_slices_bias(partial, bias, out):
        """out[r, n] = sum over s of partial[s, r, n], in order, + bias[n]."""
        N = out.shape[1]
        for i in range(cuda.grid(1), out.shape[0] * N, cuda.gridsize(1)):
            out[i // N, i % N] = sum_slices(partial, i // N, i % N) + to_f32(bias[i % N])

    return reduce_slices_bias


_READERS = {"f32": WEIGHT_READERS[np.dtype(np.float32)], "bf16": WEIGHT_READERS[np.dtype(np.uint16)]}
_FACTORIES = {  # (kernel family, weight kind) -> factory(rows)
    ("split_k", "f32"): lambda rows: _make_split_k(rows, _READERS["f32"]),
    ("split_k", "bf16"): lambda rows: _make_split_k(rows, _READERS["bf16"]),
    ("split_k", "bf16x2"): _make_split_k_pairs,
    ("transposed", "f32"): lambda rows: _make_transposed(rows, _READERS["f32"]),
    ("transposed", "bf16"): lambda rows: _make_transposed(rows, _READERS["bf16"]),
    ("transposed", "bf16x2"): _make_transposed_pairs,
}
_KERNELS = {}  # (family, kind, rows) -> kernel, built on first use
_REDUCE_BIAS = {dtype: _make_reduce_bias(to_f32) for dtype, to_f32 in WEIGHT_READERS.items()}


def kernel_for(family: str, kind: str, rows: int):
    """The kernel of `family` ("split_k" or "transposed") for weight kind "f32", "bf16" or "bf16x2" and R = rows
    (built and cached on first use)."""
    key = (family, kind, rows)
    if key not in _KERNELS:
        _KERNELS[key] = _FACTORIES[family, kind](rows)
    return _KERNELS[key]


def weight_kind(w, pairs: bool) -> str:
    """"f32" for float32 weights; for bf16 (uint16) "bf16x2" when `pairs` (w is C-contiguous and its last axis,
    the one read along, has even length: a uint32 view of w exists), else "bf16"."""
    pick(WEIGHT_READERS, w)  # TypeError for other dtypes
    if np.dtype(w.dtype) == np.float32:
        return "f32"
    return "bf16x2" if pairs else "bf16"


def _grid_stride_blocks(n: int, per_block: int) -> int:
    return max(1, min(MAX_GRID, -(-n // per_block)))


# ---- host wrappers: stream, a CUDA stream; rt, a course_lib.runtime.Runtime used instead when given ----

def matmul_narrow(a, b, bias=None, out=None, stream=0, rt=None):
    """a [R, K] float32 @ b [K, N] float32 or bf16 (uint16) (+ bias [N] float32 or bf16) -> out [R, N] float32,
    for 1 <= R <= MAX_ROWS: split-K kernel into a scratch [S, R, N], then the slice sum (and the bias)."""
    (R, K), (K2, N) = a.shape, b.shape
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"matmul_narrow: a has {R} rows, expected 1 to {MAX_ROWS} (use linear)")
    if K != K2 or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"matmul_narrow: a is {a.shape}, b is {b.shape}, bias {None if bias is None else bias.shape}")
    if out is not None and out.shape != (R, N):
        raise ValueError(f"matmul_narrow: out is {out.shape}, expected {(R, N)}")
    kind = weight_kind(b, pairs=N % 2 == 0 and b.is_c_contiguous())
    if kind == "bf16x2":
        b, cols = b.view(np.uint32), 64
    else:
        cols = 32
    reduce = reduce_slices if bias is None else pick(_REDUCE_BIAS, bias)
    out = empty((R, N), np.float32, stream, rt) if out is None else out
    slices = split_k(K, N, cols, sm_count())
    partial = empty((slices, R, N), np.float32, stream, rt)
    launch(kernel_for("split_k", kind, R), (-(-N // cols), slices), THREADS, stream, rt, a, b, partial)
    sums = (partial, out) if bias is None else (partial, bias, out)
    launch(reduce, _grid_stride_blocks(R * N, REDUCE_THREADS), REDUCE_THREADS, stream, rt, *sums)
    return out


def linear(a, b, bias=None, out=None, stream=0, rt=None):
    """a [M, K] float32 @ b [K, N] (+ bias [N]) -> out [M, N] float32: matmul_narrow for M <= MAX_ROWS, else
    the tiled matmul then add_bias."""
    if a.shape[0] <= MAX_ROWS:
        return matmul_narrow(a, b, bias, out, stream, rt)
    out = mm.matmul(a, b, out, stream, rt)
    return out if bias is None else mm.add_bias(out, bias, stream, rt)


def matmul_transposed(a, b, out=None, stream=0, rt=None):
    """a [R, K] float32 @ b [N, K].T, b float32 or bf16 (uint16), read in place -> out [R, N] float32,
    for 1 <= R <= MAX_ROWS (the tied-embedding logits: b is the embedding table)."""
    (R, K), (N, K2) = a.shape, b.shape
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"matmul_transposed: a has {R} rows, expected 1 to {MAX_ROWS}")
    if K != K2:
        raise ValueError(f"matmul_transposed: a is {a.shape}, b is {b.shape} (expected [N, {K}])")
    if out is not None and out.shape != (R, N):
        raise ValueError(f"matmul_transposed: out is {out.shape}, expected {(R, N)}")
    kind = weight_kind(b, pairs=K % 2 == 0 and b.is_c_contiguous())
    if kind == "bf16x2":
        b = b.view(np.uint32)
    out = empty((R, N), np.float32, stream, rt) if out is None else out
    launch(kernel_for("transposed", kind, R), _grid_stride_blocks(N, WARPS), THREADS, stream, rt, a, b, out)
    return out
