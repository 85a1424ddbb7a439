"""Decode projections in one pass: a warp per pair of outputs reads both weight rows whole (notebook 05).

The split-K kernels (`narrow`, `fused`) cut K into slices so that a matrix of a few hundred columns still fills the
GPU; the price is a second phase: every block writes partial sums, counts itself, and the last block of each column
group reads them all back from the L2 cache and adds them. For SmolLM2's matrices (0.7 to 1.8 MB of bf16, a few
microseconds of reading at full bandwidth) those two phases, a memory latency each and a block-wide election
between them, are most of the kernel's time.

Here the weights are stored the other way round, W [N, K] (a row per output, as Hugging Face stores a Linear), and
the warp that owns a pair of outputs reads their two rows whole: lane l takes the 8-element groups l, l + 32, ... of
both rows (16-byte loads, a warp reads 512 contiguous bytes per instruction) and the matching groups of the
activation row; the 32 lanes' sums meet by shuffles. No partial sums in memory, no counters, no second phase.

Launched programmatically (kernels/overlap.py), a warp loads its first STEPS_AHEAD steps of weights into registers
*before* waiting for its inputs: the weights do not depend on the kernel before, so they travel while it ends.

Why pairs: every epilogue of the decode step needs two outputs at once, so each pair lives in one warp:
- `qkv_rope`: the RoPE pair (i, i + hd / 2) of a head (the rows of [Wq | Wk | Wv] reordered at load time,
  `paired_qkv`), rotated, then q stored or k and v written into their row of the paged cache;
- `gate_up_swiglu`: gate row j and up row j side by side (`paired_gate_up`), out[j] = silu(gate) * up;
- `project` with accumulate=True (kernel `project_rows_add`): two neighbouring outputs added into the residual
  stream (O and down projections).
With a norm, the warp computes the row's sum of squares from the same loads and divides the dot product by the row's
RMS at the end: y = (x * gamma) . w / rms(x). A row's sums do not depend on how many rows the launch has (a block per
chunk of ROWS rows, grid y), so a token gets the same bits alone, inside a prompt or inside a batch.

Each kernel is a thin wrapper around two device functions of (pair index, buffers): `pair_sums_for(...)`, the dot
products, and an epilogue (`store_pair_for`, `rope_store_for`, `swiglu_store`), called by lane 0. The megakernel
calls the same bodies, with its own wait (counters) where a launched kernel waits for the kernel before. The QKV
projection's wait also fetches its epilogue's operands (`rope_fetch_for`: the bias, the cache slot, the cos and sin
at the row's position), and a projection added into the residual stream the stream's values (`residual_fetch_for`):
they arrive while the products run, not after them.
"""

import functools
import math

import numpy as np
from numba import float32, int32, uint32

from course_lib.kernels import cuda, f32_weight, launch, sized
from course_lib.kernels.elementwise import rotated_first, rotated_second, segment_sum, silu_times
from course_lib.kernels.narrow import no_bias
from course_lib.kernels.overlap import launched_inputs, waits_for_inputs
from course_lib.kernels.paged_attention import f32_to_bf16_bits
from course_lib.kernels.vector import aligned16, f32x8, load16, weight_of_word, words

VEC = 8  # elements of a group: one 16-byte load of bf16 weights, two of float32
WARPS = sized(4, 2)  # warps (pairs of outputs) per block: small blocks spread a few hundred warps over every SM
THREADS = 32 * WARPS
ROWS = 4  # activation rows a block multiplies at most (grid y: a block per chunk of ROWS rows)
STEPS_AHEAD = 8  # steps of weights in flight per lane (2 rows x 8 weights: 16 bytes of bf16, 32 of float32), the
# first before the wait


# ---- weights rearranged once, at load time (host, NumPy): [K, N] -> rows of outputs [N, K] ----

def output_rows(w: np.ndarray) -> np.ndarray:
    """[K, N] (x @ w) -> [N, K] contiguous: a row per output; pairs (2p, 2p + 1) are neighbours."""
    return np.ascontiguousarray(w.T)


def _rope_pair_order(n: int, head_dim: int) -> np.ndarray:
    """The output order of `paired_qkv`: for each head, i and i + hd / 2 side by side, i = 0 .. hd / 2 - 1."""
    half = head_dim // 2
    heads, i = np.divmod(np.arange(n // 2), half)
    return np.stack([heads * head_dim + i, heads * head_dim + i + half], axis=1).reshape(n)


def paired_qkv(w_qkv: np.ndarray, head_dim: int) -> np.ndarray:
    """[K, N] = [Wq | Wk | Wv] (or a bias [N]) -> rows [N, K] (or [N]) in RoPE-pair order: rows 2p and 2p + 1 are
    outputs i and i + hd / 2 of head p // (hd / 2), i = p % (hd / 2). N a multiple of head_dim, head_dim even."""
    n = w_qkv.shape[-1]
    if n % head_dim or head_dim % 2:
        raise ValueError(f"paired_qkv: {n} outputs are not whole heads of {head_dim} (an even number)")
    order = _rope_pair_order(n, head_dim)
    return np.ascontiguousarray(w_qkv[order] if w_qkv.ndim == 1 else w_qkv.T[order])


def paired_gate_up(w_gate: np.ndarray, w_up: np.ndarray) -> np.ndarray:
    """[K, F] and [K, F] -> rows [2F, K]: row 2j is gate output j, row 2j + 1 up output j."""
    if w_gate.shape != w_up.shape:
        raise ValueError(f"paired_gate_up: gate {w_gate.shape}, up {w_up.shape} (expected the same shapes)")
    return np.ascontiguousarray(np.stack([w_gate.T, w_up.T], axis=1).reshape(2 * w_gate.shape[1], -1))


# ---- the body: a warp's two dot products ----

@functools.cache
def pair_sums_for(rows, steps, wide, normed, wait=launched_inputs):
    """The device function pair_sums(p, pairs, per_row, a_words, lo, count, gamma_words, eps, w_words, acc, ready):
    acc[r, side] = h[lo + r] . W[2p + side] for r < count <= rows and side 0, 1, in every lane of the warp. h = a
    (a [R, K] float32 seen as flat uint32 words), or, normed, h[r] = a[r] gamma / rms(a[r]), gamma [K] float32 (as
    words) and rms(a) = sqrt(mean(a^2) + eps). W [2 pairs, K] is float32 (wide) or bf16 bits, as flat words;
    K = 8 per_row, steps = ceil(per_row / 32) a compile-time constant. Every thread of the block calls it: it waits
    for the step's inputs, wait(ready), after issuing its first weight loads (a launched kernel: launched_inputs; the
    megakernel: its counters); a warp with p >= pairs loads and adds nothing."""
    per_load = 2 if wide else 1  # 16-byte loads per group of 8 weights
    chunks = -(-steps // STEPS_AHEAD)

    @cuda.jit(device=True)
    def load_weights(raw, c, p, per_row, w_words):
        """Issue the loads of chunk c (STEPS_AHEAD steps of 32 groups) of rows 2p and 2p + 1: this lane's groups."""
        for u in range(STEPS_AHEAD):
            j = cuda.threadIdx.x % 32 + 32 * (c * STEPS_AHEAD + u)
            if c * STEPS_AHEAD + u < steps and j < per_row:
                for side in range(2):
                    at = per_load * ((2 * p + side) * per_row + j)
                    for half in range(per_load):
                        w0, w1, w2, w3 = load16(w_words, at + half)
                        raw[u, side, 4 * half] = w0
                        raw[u, side, 4 * half + 1] = w1
                        raw[u, side, 4 * half + 2] = w2
                        raw[u, side, 4 * half + 3] = w3

    @cuda.jit(device=True)
    def pair_sums(p, pairs, per_row, a_words, lo, count, gamma_words, eps, w_words, acc, ready):
        raw = cuda.local.array((STEPS_AHEAD, 2, 8), dtype=uint32)
        sum_sq = cuda.local.array(rows, dtype=float32)
        mine = p < pairs
        for r in range(rows):
            sum_sq[r] = float32(0)
            acc[r, 0] = float32(0)
            acc[r, 1] = float32(0)
        if mine:
            load_weights(raw, 0, p, per_row, w_words)
        wait(ready)  # every thread: the weights above are in flight, the activations are next
        for c in range(chunks):
            if c > 0 and mine:
                load_weights(raw, c, p, per_row, w_words)
            for u in range(STEPS_AHEAD):
                j = cuda.threadIdx.x % 32 + 32 * (c * STEPS_AHEAD + u)
                if mine and c * STEPS_AHEAD + u < steps and j < per_row:
                    if normed:
                        g = f32x8(gamma_words, j)
                    for r in range(rows):
                        if r < count:
                            x = f32x8(a_words, (lo + r) * per_row + j)
                            for e in range(VEC):
                                h = x[e]
                                if normed:
                                    sum_sq[r] += h * h
                                    h = h * g[e]
                                acc[r, 0] += h * weight_of_word(raw[u, 0, e if wide else e // 2], e, wide)
                                acc[r, 1] += h * weight_of_word(raw[u, 1, e if wide else e // 2], e, wide)
        for r in range(rows):  # every lane takes part in the shuffles
            acc[r, 0] = segment_sum(acc[r, 0], 32)
            acc[r, 1] = segment_sum(acc[r, 1], 32)
            if normed:
                rms = float32(math.sqrt(segment_sum(sum_sq[r], 32) / float32(VEC * per_row) + eps))
                acc[r, 0] = acc[r, 0] / rms
                acc[r, 1] = acc[r, 1] / rms

    return pair_sums


# ---- epilogues: what lane 0 of the warp of pair p does with acc[r, side] (rows lo .. lo + count - 1) ----

@functools.cache
def residual_fetch_for(wait):
    """The wait of pair_sums for a projection added into the residual stream: wait(inner), then the outputs' current
    values loaded into `pre` while the dot products run, ready = (inner, (p, pairs, lo, count, out, pre)):
    pre[r, side] = out[lo + r, 2p + side] for r < count and p < pairs (store_pair_for(True) adds them)."""

    @cuda.jit(device=True)
    def residual_fetch(ready):
        inner, (p, pairs, lo, count, out, pre) = ready
        wait(inner)
        if p < pairs:
            for r in range(pre.shape[0]):
                if r < count:
                    for side in range(2):
                        pre[r, side] = out[lo + r, 2 * p + side]

    return residual_fetch


@functools.cache
def store_pair_for(accumulate):
    """store_pair(p, lo, count, acc, pre, out): out[lo + r, 2p + side] = acc[r, side], out [T, N]; when
    accumulate, pre[r, side] + acc[r, side] (pre: out's values before, fetched by residual_fetch_for: the residual
    stream)."""

    @cuda.jit(device=True)
    def store_pair(p, lo, count, acc, pre, out):
        for r in range(acc.shape[0]):
            if r < count:
                for side in range(2):
                    if accumulate:
                        out[lo + r, 2 * p + side] = pre[r, side] + acc[r, side]
                    else:
                        out[lo + r, 2 * p + side] = acc[r, side]

    return store_pair


@functools.cache
def rope_fetch_for(wait):
    """The wait of pair_sums for the QKV projection: wait(inner), then pair p's RoPE operands loaded into `pre`
    while the dot products run, ready = (inner, (p, pairs, lo, count, bias, cos, sin, positions, slots, pre,
    pre_slots)): pre[r] = (bias of output i, bias of output i + hd / 2, cos, sin) of row lo + r at positions[lo + r]
    and pre_slots[r] = slots[lo + r], for r < count and p < pairs. Without a bias (length 0) it is -0, which adds
    nothing to any float, -0 included. Positions and slots are the step's inputs (written by the kernel before, or
    the step before): read after the wait, they cost a memory latency while the products run instead of two (the
    position, then its cos and sin) after them."""

    @cuda.jit(device=True)
    def rope_fetch(ready):
        inner, (p, pairs, lo, count, bias, cos, sin, positions, slots, pre, pre_slots) = ready
        wait(inner)
        if p < pairs:
            i = p % cos.shape[1]
            for r in range(pre.shape[0]):
                if r < count:
                    at = positions[lo + r]
                    pre[r, 0] = bias[2 * p] if bias.shape[0] > 0 else float32(-0.0)
                    pre[r, 1] = bias[2 * p + 1] if bias.shape[0] > 0 else float32(-0.0)
                    pre[r, 2], pre[r, 3] = cos[at, i], sin[at, i]
                    pre_slots[r] = slots[lo + r]

    return rope_fetch


@functools.cache
def rope_store_for(kv_bf16):
    """rope_store(p, lo, count, acc, pre, pre_slots, k_table, v_table, q): pair p of paired_qkv's rows (outputs i and
    i + hd / 2 of head p // (hd / 2)) + bias, rotated by RoPE on a q or k head, q stored to q [T, H hd], k and v to
    row pre_slots[r] of k_table, v_table [rows, Hkv, hd] (bf16 bits when kv_bf16; a slot < 0 is skipped), with the
    bias, cos and sin of each row in pre (rope_fetch_for)."""
    store_kv = f32_to_bf16_bits if kv_bf16 else f32_weight

    @cuda.jit(device=True)
    def rope_store(p, lo, count, acc, pre, pre_slots, k_table, v_table, q):
        hd = k_table.shape[2]
        half = hd // 2
        i = p % half
        n = (p // half) * hd + i  # the pair's outputs are n and n + half of [q | k | v]
        n_q, n_kv = q.shape[1], k_table.shape[1] * hd
        for r in range(acc.shape[0]):
            if r < count:
                t = lo + r
                y0, y1 = acc[r, 0] + pre[r, 0], acc[r, 1] + pre[r, 1]
                if n < n_q + n_kv:  # a q or k head
                    c, s = pre[r, 2], pre[r, 3]
                    y0, y1 = rotated_first(y0, y1, c, s), rotated_second(y0, y1, c, s)
                if n < n_q:
                    q[t, n] = y0
                    q[t, n + half] = y1
                elif pre_slots[r] >= 0:
                    j = (n - n_q) % n_kv
                    table = k_table if n < n_q + n_kv else v_table
                    table[pre_slots[r], j // hd, j % hd] = store_kv(y0)
                    table[pre_slots[r], j // hd, j % hd + half] = store_kv(y1)

    return rope_store


@cuda.jit(device=True)
def swiglu_store(p, lo, count, acc, out):
    """out[lo + r, p] = silu(gate) * up, gate and up the pair p of paired_gate_up's rows."""
    for r in range(acc.shape[0]):
        if r < count:
            out[lo + r, p] = silu_times(acc[r, 0], acc[r, 1])


@cuda.jit(device=True)
def pair_of_warp(T):
    """(p, lo, count) of this warp: pair p = blockIdx.x WARPS + warp, the rows lo .. lo + count - 1 of the launch's T
    (chunk blockIdx.y of ROWS rows)."""
    lo = cuda.blockIdx.y * ROWS
    return cuda.blockIdx.x * WARPS + cuda.threadIdx.x // 32, lo, min(ROWS, T - lo)


# ---- kernels: pair_sums, then the epilogue in lane 0 of each warp ----

@functools.cache
def project_kernel(rows, steps, wide, normed, accumulate):
    wait = residual_fetch_for(launched_inputs) if accumulate else launched_inputs  # (which ignores `ready`)
    pair_sums, store = pair_sums_for(rows, steps, wide, normed, wait), store_pair_for(accumulate)

    def project_rows(pairs, per_row, a_words, T, gamma_words, eps, w_words, out):
        """out[t, n] (+)= h[t] . W[n] (pair_sums), out [T, N]: added into out when accumulate (the residual stream,
        its values fetched while the sums run). Grid (ceil(N / 2 / WARPS), ceil(T / ROWS)), THREADS."""
        acc = cuda.local.array((rows, 2), dtype=float32)
        pre = cuda.local.array((rows, 2), dtype=float32)
        p, lo, count = pair_of_warp(T)
        pair_sums(p, pairs, per_row, a_words, lo, count, gamma_words, eps, w_words, acc,
                  (0, (p, pairs, lo, count, out, pre)))
        if p < pairs and cuda.threadIdx.x % 32 == 0:
            store(p, lo, count, acc, pre, out)

    project_rows.__name__ = project_rows.__qualname__ = "project_rows" + ("_add" if accumulate else "")
    return waits_for_inputs(cuda.jit(project_rows))


@functools.cache
def qkv_rope_kernel(rows, steps, wide, normed, kv_bf16):
    pair_sums = pair_sums_for(rows, steps, wide, normed, rope_fetch_for(launched_inputs))
    rope_store = rope_store_for(kv_bf16)

    def qkv_rope_rows(pairs, per_row, a_words, T, gamma_words, eps, w_words, bias, cos, sin, k_table, v_table,
                      positions, slots, q):
        """rope_store of pair_sums (see there), its operands fetched while the sums run. Grid as project_rows."""
        acc = cuda.local.array((rows, 2), dtype=float32)
        pre = cuda.local.array((rows, 4), dtype=float32)
        pre_slots = cuda.local.array(rows, dtype=int32)
        p, lo, count = pair_of_warp(T)
        pair_sums(p, pairs, per_row, a_words, lo, count, gamma_words, eps, w_words, acc,
                  (0, (p, pairs, lo, count, bias, cos, sin, positions, slots, pre, pre_slots)))
        if p < pairs and cuda.threadIdx.x % 32 == 0:
            rope_store(p, lo, count, acc, pre, pre_slots, k_table, v_table, q)

    return waits_for_inputs(cuda.jit(qkv_rope_rows))


@functools.cache
def gate_up_kernel(rows, steps, wide, normed):
    pair_sums = pair_sums_for(rows, steps, wide, normed)

    def gate_up_swiglu_rows(pairs, per_row, a_words, T, gamma_words, eps, w_words, out):
        """swiglu_store of pair_sums: out [T, F]. Grid as project_rows."""
        acc = cuda.local.array((rows, 2), dtype=float32)
        p, lo, count = pair_of_warp(T)
        pair_sums(p, pairs, per_row, a_words, lo, count, gamma_words, eps, w_words, acc, 0)
        if p < pairs and cuda.threadIdx.x % 32 == 0:
            swiglu_store(p, lo, count, acc, out)

    return waits_for_inputs(cuda.jit(gate_up_swiglu_rows))


# ---- host wrappers (stream: a CUDA stream; rt: a course_lib.gpu.runtime.Runtime, used instead when given) ----

@functools.cache
def _no_norm():
    """Stand-in for gamma when there is no norm (never read)."""
    return cuda.to_device(np.zeros(VEC, np.float32))


def _launch(kernel_of, what, x, w_rows, norm, args, stream, rt):
    """kernel_of(rows, steps, wide, normed)[grid, THREADS](pairs, per_row, words(x), T, gamma, eps, words(w_rows),
    *args), after checking the shapes: x [T, K] float32, w_rows [N, K] float32 or bf16 bits, K % 8 == 0, N even,
    both 16-byte aligned; norm = (gamma [K] float32, eps) or None."""
    (T, K), (N, K2) = x.shape, w_rows.shape
    kinds = (np.dtype(np.float32), np.dtype(np.uint16))
    if (K != K2 or K % VEC or N % 2 or T < 1 or np.dtype(x.dtype) != kinds[0] or np.dtype(w_rows.dtype) not in kinds
            or not (aligned16(x) and aligned16(w_rows))):
        raise ValueError(f"{what}: x {x.shape} {x.dtype}, weight rows {w_rows.shape} {w_rows.dtype} (expected x [T, K] "
                         f"float32 and rows [N, K] float32 or bf16, K a multiple of {VEC}, N even, both contiguous and "
                         "16-byte aligned)")
    gamma, eps = (_no_norm(), 0.0) if norm is None else norm
    if norm is not None and (gamma.shape != (K,) or np.dtype(gamma.dtype) != kinds[0]):
        raise ValueError(f"{what}: the norm's weights are {gamma.shape} {gamma.dtype}, expected ({K},) float32")
    per_row = K // VEC
    kernel = kernel_of(min(T, ROWS), -(-per_row // 32), np.dtype(w_rows.dtype) == kinds[0], norm is not None)
    launch(kernel, (-(-N // 2 // WARPS), -(-T // ROWS)), THREADS, stream, rt, np.int32(N // 2), np.int32(per_row),
           words(x), np.int32(T), words(gamma), np.float32(eps), words(w_rows), *args)


def project(x, w_rows, out, norm=None, accumulate=False, stream=0, rt=None):
    """out [T, N] = (or += when accumulate) RMSNorm(x) gamma @ w_rows.T, x [T, K] float32, w_rows [N, K]
    (output_rows(w) of a [K, N] weight); norm = (gamma [K] float32, eps), or None for x as it is. Returns out."""
    if out.shape != (x.shape[0], w_rows.shape[0]):
        raise ValueError(f"project: out {out.shape}, expected {(x.shape[0], w_rows.shape[0])}")
    _launch(lambda *c: project_kernel(*c, accumulate), "project", x, w_rows, norm, (out,), stream, rt)
    return out


def qkv_rope(x, w_rows, bias, norm, cos, sin, positions, slots, q, k_table, v_table, stream=0, rt=None):
    """kernels.fused.qkv_rope with w_rows [N, K] = paired_qkv([Wq | Wk | Wv], hd) (and the bias [N] float32
    likewise, or None): q [T, H hd] written, k and v into rows slots[t] of k_table, v_table [rows, Hkv, hd] (float32,
    or bf16 bits in uint16). Returns q."""
    T, N = x.shape[0], w_rows.shape[0]
    hd = k_table.shape[2]
    if (q.shape != (T, N - 2 * k_table.shape[1] * hd) or v_table.shape != k_table.shape or v_table.dtype !=
            k_table.dtype or positions.shape != (T,) or slots.shape != (T,) or hd % 2 or
            cos.shape[1:] != (hd // 2,) or sin.shape != cos.shape or
            (bias is not None and (bias.shape != (N,) or np.dtype(bias.dtype) != np.float32))):
        raise ValueError(f"qkv_rope: x {x.shape}, rows {w_rows.shape}, q {q.shape}, k_table {k_table.shape}, "
                         f"v_table {v_table.shape}, positions {positions.shape}, slots {slots.shape}, cos "
                         f"{cos.shape} and sin {sin.shape} (positions x hd / 2), bias "
                         f"{None if bias is None else (bias.shape, bias.dtype)} (float32)")
    kv_bf16 = np.dtype(k_table.dtype) == np.uint16
    bias = no_bias() if bias is None else bias
    _launch(lambda *c: qkv_rope_kernel(*c, kv_bf16), "qkv_rope", x, w_rows, norm,
            (bias, cos, sin, k_table, v_table, positions, slots, q), stream, rt)
    return q


def gate_up_swiglu(x, w_rows, norm, out, stream=0, rt=None):
    """out [T, F] = silu(gate) * up of RMSNorm(x) gamma, w_rows [2F, K] = paired_gate_up(w_gate, w_up). Returns
    out."""
    if out.shape != (x.shape[0], w_rows.shape[0] // 2):
        raise ValueError(f"gate_up_swiglu: out {out.shape}, expected {(x.shape[0], w_rows.shape[0] // 2)}")
    _launch(gate_up_kernel, "gate_up_swiglu", x, w_rows, norm, (out,), stream, rt)
    return out

