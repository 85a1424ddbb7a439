"""Projections fused with their neighbours (notebook 05): one split-K kernel does the work of three to six.

Every kernel here is the split-K block of `narrow` (`split_k_block_for`: RMSNorm of the rows computed by the block
itself, a slice of K, the partial sums, the election of each column group's last block) followed by another
epilogue in that last block, where the whole K-sum of its columns is known. (A launch of several rows has them
normalized by rms_norm first, `narrow.NORMED_ROWS`: the norm inside would spill registers.)

- `qkv_rope`: x [T, d] -> RMSNorm -> @ [Wq | Wk | Wv] (+ bias) -> RoPE on the q and k heads -> q to its buffer,
  k and v into their rows of the paged cache. It replaces a norm, three matmuls, two RoPE kernels and two cache
  writes. The group's last block first adds the slices of all its columns into shared memory (a RoPE pair, i and
  i + hd / 2, lies in one head, and a group holds whole heads), then rotates and stores.
- `gate_up_swiglu`: x -> RMSNorm -> @ W_gu -> silu(gate) * up, where W_gu holds the gate and up columns
  interleaved eight by eight at load time (`interleave_gate_up`): the epilogue finds gate column j and up column j
  side by side, in the same group, and writes only the product. It replaces a norm, two matmuls and SwiGLU's
  elementwise kernel, and the [T, 2 d_ff] intermediate never reaches memory.

A batch's rows (more than narrow.KERNEL_ROWS) go through the tile kernels instead: the slices' sums of tiles of rows
and columns (`narrow.tile_sums_kernel`), then the same epilogue arithmetic in a launch of its own
(`qkv_rope_tiles_kernel`, `gate_up_tiles_kernel`: a block per tile of columns and narrow.EPILOGUE_ROWS rows, four
outputs and their partners a thread, the slices read 16 bytes at a time: `_rope_tile_store_for`,
`_swiglu_tile_store_for`). A tile's columns are whole heads for RoPE.

For a prefill's many rows, SwiGLU in the tiled matmul (the body of `matmul.tile_product`), the paper's two
strategies: `swiglu_two_passes` (a block computes its gate tile, takes its SiLU in registers, then computes the up
tile over the same rows and multiplies) and `swiglu_interleaved` (one tiled product over W_gu, whose 64 columns per
block hold 32 gate columns and their up columns; the pairs meet in shared memory).

The arithmetic of each output element is the unfused kernels' own, in the same order (`row_rms`, `sum_slices`,
`rotated_first` / `rotated_second`, `silu_times`), and gate_up_swiglu splits K as the gate and up matmuls do: its
outputs have the unfused kernels' bits. So do qkv_rope's when the three matmuls it replaces split K alike (SmolLM2:
every split is capped by K; a model whose q and k, v projections split K differently gets other roundings).
"""

import functools

import numpy as np
from numba import float32, int32

from course_lib.kernels import cuda, empty, f32_weight, for_weight_dtypes, launch, pick
from course_lib.kernels import matmul as mm
from course_lib.kernels import narrow as nw
from course_lib.kernels.elementwise import rotated_first, rotated_second, silu, silu_times
from course_lib.kernels.overlap import inputs_ready, waits_for_inputs
from course_lib.kernels.paged_attention import f32_to_bf16_bits
from course_lib.kernels.vector import store_quad

PAIR = nw.VEC  # gate and up alternate in runs of PAIR columns in W_gu (one 16-byte load of a lane)
QUAD = nw.QUAD  # float32 in a 16-byte access
LAUNCH_ROWS = nw.LAUNCH_ROWS  # rows of a tile launch at most (a shared array's size: a constant of this module)
TWO_QUADS = 2 * QUAD  # the columns narrow.quads_total sums at once (a compile-time constant: a local array's size)
_KV_STORES = {np.dtype(np.float32): f32_weight, np.dtype(np.uint16): f32_to_bf16_bits}  # cache dtype -> its store


# ---- weights rearranged once, at load time (host, NumPy) ----

def interleave_gate_up(w_gate: np.ndarray, w_up: np.ndarray) -> np.ndarray:
    """[K, F] and [K, F] -> W_gu [K, 2F]: columns 2 PAIR i .. 2 PAIR i + PAIR - 1 are gate's PAIR i .. PAIR i +
    PAIR - 1, the next PAIR are up's same columns (F a multiple of PAIR). Works for a bias [F] too."""
    if w_gate.shape != w_up.shape or w_gate.shape[-1] % PAIR:
        raise ValueError(f"interleave_gate_up: gate {w_gate.shape}, up {w_up.shape} (same shapes, the last a "
                         f"multiple of {PAIR})")
    *lead, F = w_gate.shape
    runs = (*lead, F // PAIR, 1, PAIR)
    return np.concatenate([w_gate.reshape(runs), w_up.reshape(runs)], axis=-2).reshape(*lead, 2 * F)


# ---- epilogues (device functions of the group index g and the buffers) ----

@cuda.jit(device=True)
def gate_column(j):
    """The column of W_gu (interleave_gate_up) that holds gate column j; up column j is PAIR further."""
    return (j // PAIR) * 2 * PAIR + j % PAIR


@functools.cache
def _rope_store_for(group, head_dim, bias_f32, store_kv):
    half = head_dim // 2
    tile_rows = nw.KERNEL_ROWS  # a compile-time constant for the shared array's shape
    column_total = nw.column_total_for(bias_f32)

    @cuda.jit(device=True)
    def rope_rows(g, r0, count, tile, partial, bias, cos, sin, k_table, v_table, positions, slots, q):
        """rope_store for the rows r0 .. r0 + count - 1 (count <= KERNEL_ROWS), through the shared tile."""
        N = partial.shape[2]
        n_q, n_kv = q.shape[1], k_table.shape[1] * k_table.shape[2]
        for e in range(cuda.threadIdx.x, count * group, cuda.blockDim.x):
            t, c = e // group, e % group
            if g * group + c < N:
                tile[t, c] = column_total(partial, bias, r0 + t, g * group + c)
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, count * group, cuda.blockDim.x):
            t, c = e // group, e % group
            r, n = r0 + t, g * group + c
            if n < N:
                y = tile[t, c]
                if n < n_q + n_kv:  # a q or k head: rotate the pair (i, i + half) of its head
                    i, p = n % head_dim, positions[r]
                    if i < half:
                        y = rotated_first(y, tile[t, c + half], cos[p, i], sin[p, i])
                    else:
                        y = rotated_second(tile[t, c - half], y, cos[p, i - half], sin[p, i - half])
                if n < n_q:
                    q[r, n] = y
                elif slots[r] >= 0:
                    j = (n - n_q) % n_kv
                    table = k_table if n < n_q + n_kv else v_table
                    table[slots[r], j // head_dim, j % head_dim] = store_kv(y)

    @cuda.jit(device=True)
    def rope_store(g, partial, bias, cos, sin, k_table, v_table, positions, slots, q):
        """Columns of group g of [q | k | v] (partial [S, R, N], N = (H + 2 Hkv) hd): summed over the slices
        (+ bias), then the q and k heads rotated by RoPE at positions[r], q written to q [R, H hd], k and v to
        row slots[r] of k_table, v_table [rows, Hkv, hd] (stored by store_kv; a slot < 0 is skipped). The rows
        go through a shared tile KERNEL_ROWS at a time (a RoPE pair, i and i + hd / 2, lies in one head, and a
        group holds whole heads)."""
        tile = cuda.shared.array((tile_rows, group), dtype=float32)
        rows = q.shape[0]  # the launch's rows (partial may have more)
        for r0 in range(0, rows, tile_rows):
            if r0 > 0:
                cuda.syncthreads()  # every thread is done with the previous rows' tile
            rope_rows(g, r0, min(rows, r0 + tile_rows) - r0, tile, partial, bias, cos, sin, k_table, v_table,
                      positions, slots, q)

    return rope_store


@functools.cache
def _swiglu_store_for(group, bias_f32):
    outs = group // 2  # output columns of a group
    column_total = nw.column_total_for(bias_f32)

    @cuda.jit(device=True)
    def swiglu_store(g, partial, bias, out):
        """out[r, j] = silu(gate) * up for the output columns j of group g: gate column j is column
        (j // PAIR) 2 PAIR + j % PAIR of W_gu, up the one PAIR further (partial [S, R, 2F], out [R, F])."""
        rows, F = out.shape[0], out.shape[1]  # the launch's rows (partial may have more)
        for e in range(cuda.threadIdx.x, rows * outs, cuda.blockDim.x):
            r, j = e // outs, g * outs + e % outs
            if j < F:
                n = gate_column(j)
                out[r, j] = silu_times(column_total(partial, bias, r, n), column_total(partial, bias, r, n + PAIR))

    return swiglu_store


@functools.cache
def _rope_tile_store_for(group, head_dim, bias_f32, store_kv):
    half, quads_total = head_dim // 2, nw.quads_total_for(bias_f32)
    pairs = group // TWO_QUADS  # a group's quads of first halves (each with the quad of its partners)

    @cuda.jit(device=True)
    def rope_tile_store(g, partial, bias, cos, sin, k_table, v_table, positions, slots, q):
        """rope_store's outputs for the `group` columns of tile g (whole heads, hd / 2 a multiple of 4) and the
        rows of q (at most LAUNCH_ROWS), four RoPE pairs of a row per thread: columns n .. n + 3 of a head's first
        half and their partners hd / 2 further (quads_total), rotated as rope_store rotates, stored (q in 16-byte
        stores). The rows' positions and slots are staged in shared memory first, and each thread asks for its cos
        and sin before the slices: one latency of memory for the block, then one round of loads per thread's pairs."""
        t = cuda.local.array(TWO_QUADS, dtype=float32)
        cs = cuda.local.array(QUAD, dtype=float32)
        sn = cuda.local.array(QUAD, dtype=float32)
        at_row = cuda.shared.array((2, LAUNCH_ROWS), dtype=int32)  # positions[r], slots[r]
        rows, N = q.shape[0], partial.shape[2]
        n_q, n_kv = q.shape[1], k_table.shape[1] * head_dim
        for r in range(cuda.threadIdx.x, rows, cuda.blockDim.x):
            at_row[0, r], at_row[1, r] = positions[r], slots[r]
        cuda.syncthreads()
        for e in range(cuda.threadIdx.x, rows * pairs, cuda.blockDim.x):
            r, c = e // pairs, e % pairs
            i0 = QUAD * (c % (half // QUAD))  # the pairs' first index i in their head
            n = g * group + (c // (half // QUAD)) * head_dim + i0
            if n < N:
                rotated = n < n_q + n_kv  # a q or k head
                if rotated:
                    for j in range(QUAD):
                        cs[j], sn[j] = cos[at_row[0, r], i0 + j], sin[at_row[0, r], i0 + j]
                quads_total(partial, bias, r, n, half, t)
                if rotated:
                    for j in range(QUAD):
                        y0, y1 = t[j], t[QUAD + j]
                        t[j], t[QUAD + j] = rotated_first(y0, y1, cs[j], sn[j]), rotated_second(y0, y1, cs[j], sn[j])
                if n < n_q:
                    store_quad(q, (r, n), t[0], t[1], t[2], t[3])
                    store_quad(q, (r, n + half), t[4], t[5], t[6], t[7])
                elif at_row[1, r] >= 0:
                    slot, at = at_row[1, r], (n - n_q) % n_kv
                    table = k_table if rotated else v_table
                    for j in range(QUAD):
                        table[slot, at // head_dim, at % head_dim + j] = store_kv(t[j])
                        table[slot, at // head_dim, at % head_dim + half + j] = store_kv(t[QUAD + j])

    return rope_tile_store


@functools.cache
def _swiglu_tile_store_for(group, bias_f32):
    quads_total = nw.quads_total_for(bias_f32)
    runs = PAIR // QUAD  # quads of a run of PAIR gate columns
    quads = group // TWO_QUADS  # a group's quads of gate columns

    @cuda.jit(device=True)
    def swiglu_tile_store(g, partial, bias, out):
        """swiglu_store's outputs for the `group` columns of tile g and the rows of out [R, F], four a thread:
        gate columns n .. n + 3 of W_gu and their up columns PAIR further (quads_total), one 16-byte store."""
        t = cuda.local.array(TWO_QUADS, dtype=float32)
        rows, F = out.shape[0], out.shape[1]
        for e in range(cuda.threadIdx.x, rows * quads, cuda.blockDim.x):
            r, c = e // quads, e % quads
            j = g * (group // 2) + PAIR * (c // runs) + QUAD * (c % runs)  # output column: gate_column(j) is n
            if j < F:
                quads_total(partial, bias, r, gate_column(j), PAIR, t)
                store_quad(out, (r, j), silu_times(t[0], t[4]), silu_times(t[1], t[5]), silu_times(t[2], t[6]),
                           silu_times(t[3], t[7]))

    return swiglu_tile_store


# ---- kernels: split_k_block then an epilogue, one kernel per (rows, weight kind, ...) ----

@functools.cache
def qkv_rope_kernel(rows, kind, bias, normed, kv_dtype, head_dim, chunked=False):
    width, load, prefetch = nw.SPLIT_K_LOADS[kind]
    block = nw.split_k_block_for(rows, width, load, normed)
    epilogue = _rope_store_for(32 * width, head_dim, nw.BIAS_READERS[bias], _KV_STORES[np.dtype(kv_dtype)])

    def qkv_rope_split_k(a, gamma, eps, b, bias, partial, done, cos, sin, k_table, v_table, positions, slots, q):
        """[q | k | v] = RMSNorm(a) @ b (+ bias), RoPE, q stored, k and v written to the cache (rope_store).
        Grid (ceil(N / group), S, chunks of rows when chunked: narrow.rows_of_block), THREADS."""
        g, s = cuda.blockIdx.x, cuda.blockIdx.y
        prefetch(g, s, a, b, partial)
        inputs_ready()
        if chunked:
            lo, hi, counters = nw.rows_of_block(a.shape[0], rows, done)
            if block(g, s, a[lo:hi], gamma, eps, b, partial[:, lo:hi], counters):
                epilogue(g, partial[:, lo:hi], bias, cos, sin, k_table, v_table, positions[lo:hi], slots[lo:hi],
                         q[lo:hi])
        elif block(g, s, a, gamma, eps, b, partial, done):
            epilogue(g, partial, bias, cos, sin, k_table, v_table, positions, slots, q)

    qkv_rope_split_k.__name__ = qkv_rope_split_k.__qualname__ = "qkv_rope_split_k" + ("_vec" if width > 1 else "")
    return waits_for_inputs(cuda.jit(**nw.SPLIT_K_BOUNDS)(qkv_rope_split_k))


@functools.cache
def qkv_rope_tiles_kernel(group, bias, kv_dtype, head_dim):
    """qkv_rope's epilogue for a batch's rows, a launch of its own after narrow.tile_sums_kernel's (tiles of `group`
    columns, whole heads): rope_tile_store on the rows of narrow.epilogue_rows."""
    epilogue = _rope_tile_store_for(group, head_dim, nw.BIAS_READERS[bias], _KV_STORES[np.dtype(kv_dtype)])

    def qkv_rope_tiles(partial, bias, cos, sin, k_table, v_table, positions, slots, q):
        """[q | k | v] = the K-sums of partial [S, R, N] (+ bias), RoPE, q stored, k and v written to the cache.
        Grid (ceil(N / group), 1, ceil(R / EPILOGUE_ROWS)), EPILOGUE_THREADS."""
        inputs_ready()
        g, lo, hi = nw.epilogue_rows(q.shape[0])
        epilogue(g, partial[:, lo:hi], bias, cos, sin, k_table, v_table, positions[lo:hi], slots[lo:hi], q[lo:hi])

    return waits_for_inputs(cuda.jit(qkv_rope_tiles))


@functools.cache
def gate_up_kernel(rows, kind, bias, normed, chunked=False):
    width, load, prefetch = nw.SPLIT_K_LOADS[kind]
    block = nw.split_k_block_for(rows, width, load, normed)
    epilogue = _swiglu_store_for(32 * width, nw.BIAS_READERS[bias])

    def gate_up_swiglu_split_k(a, gamma, eps, b, bias, partial, done, out):
        """out = silu(gate) * up of RMSNorm(a) @ W_gu (+ bias) (swiglu_store). Grid (ceil(2F / group), S, chunks
        of rows when chunked: narrow.rows_of_block), THREADS."""
        g, s = cuda.blockIdx.x, cuda.blockIdx.y
        prefetch(g, s, a, b, partial)
        inputs_ready()
        if chunked:
            lo, hi, counters = nw.rows_of_block(a.shape[0], rows, done)
            if block(g, s, a[lo:hi], gamma, eps, b, partial[:, lo:hi], counters):
                epilogue(g, partial[:, lo:hi], bias, out[lo:hi])
        elif block(g, s, a, gamma, eps, b, partial, done):
            epilogue(g, partial, bias, out)

    gate_up_swiglu_split_k.__name__ = gate_up_swiglu_split_k.__qualname__ = (
        "gate_up_swiglu_split_k" + ("_vec" if width > 1 else ""))
    return waits_for_inputs(cuda.jit(**nw.SPLIT_K_BOUNDS)(gate_up_swiglu_split_k))


@functools.cache
def gate_up_tiles_kernel(group, bias):
    """gate_up_swiglu's epilogue for a batch's rows, a launch of its own after narrow.tile_sums_kernel's (tiles of
    `group` columns): swiglu_tile_store on the rows of narrow.epilogue_rows."""
    epilogue = _swiglu_tile_store_for(group, nw.BIAS_READERS[bias])

    def gate_up_swiglu_tiles(partial, bias, out):
        """out = silu(gate) * up of the K-sums of partial [S, R, 2F] (+ bias). Grid (ceil(2F / group), 1, ceil(R /
        EPILOGUE_ROWS)), EPILOGUE_THREADS."""
        inputs_ready()
        g, lo, hi = nw.epilogue_rows(out.shape[0])
        epilogue(g, partial[:, lo:hi], bias, out[lo:hi])

    return waits_for_inputs(cuda.jit(gate_up_swiglu_tiles))


# ---- host wrappers (stream: a CUDA stream; rt: a course_lib.gpu.runtime.Runtime, used instead when given) ----

def _width(N: int, b, unit: int) -> int:
    """Columns per lane: VEC (groups of 256 columns) when the layout allows it and `unit` divides 256, else 1
    (groups of 32), which `unit` must divide."""
    if N % nw.VEC == 0 and nw.aligned16(b) and (32 * nw.VEC) % unit == 0:
        return nw.VEC
    if 32 % unit:
        raise ValueError(f"fused split-K: a group of 32 or 256 columns cannot hold whole units of {unit} columns")
    return 1


def qkv_rope(x, w_qkv, bias, norm, cos, sin, positions, slots, q, k_table, v_table, stream=0, rt=None):
    """x [T, d] float32 (the residual stream) -> q [T, H hd] float32 (written), and k, v written to rows slots[t]
    of k_table, v_table [rows, Hkv, hd] (float32, or bf16 bits in uint16; slot < 0: skipped): [q | k | v] =
    RMSNorm(x) gamma @ w_qkv [d, (H + 2 Hkv) hd] (+ bias [(H + 2 Hkv) hd]), q and k rotated by RoPE (cos, sin
    [positions, hd / 2], positions [T] int32). norm = (gamma [d] float32, eps), or None when x is already
    normalized. Returns q."""
    T, N = x.shape[0], w_qkv.shape[1]
    hd = k_table.shape[2]
    if (w_qkv.shape[0] != x.shape[1] or q.shape != (T, N - 2 * k_table.shape[1] * hd) or v_table.shape !=
            k_table.shape or positions.shape != (T,) or slots.shape != (T,) or hd % 2):
        raise ValueError(f"qkv_rope: x {x.shape}, w_qkv {w_qkv.shape}, q {q.shape}, k_table {k_table.shape}, "
                         f"v_table {v_table.shape}, positions {positions.shape}, slots {slots.shape}")
    width, kv_dtype = _width(N, w_qkv, hd), np.dtype(k_table.dtype)
    nw.split_k_launches(lambda rows, kind, bias_kind, normed, chunked, group: (
                            qkv_rope_kernel(rows, kind, bias_kind, normed, kv_dtype, hd, chunked) if group is None
                            else qkv_rope_tiles_kernel(group, bias_kind, kv_dtype, hd)),
                        x, w_qkv, bias, norm, (cos, sin, k_table, v_table), (positions, slots, q), stream, rt, width,
                        unit=hd if hd % (2 * QUAD) == 0 else None)
    return q


def gate_up_swiglu(x, w_gu, norm, out, bias=None, stream=0, rt=None):
    """x [T, d] float32 -> out [T, F] = silu(gate) * up, [gate | up] = RMSNorm(x) gamma @ (w_gate | w_up) (+ bias),
    with w_gu [d, 2F] = interleave_gate_up(w_gate, w_up) (and the bias likewise). norm = (gamma [d] float32, eps),
    or None when x is already normalized. Returns out."""
    T, N = x.shape[0], w_gu.shape[1]
    if w_gu.shape[0] != x.shape[1] or out.shape != (T, N // 2) or N % (2 * PAIR):
        raise ValueError(f"gate_up_swiglu: x {x.shape}, w_gu {w_gu.shape}, out {out.shape}")
    width = _width(N, w_gu, 2 * PAIR)
    nw.split_k_launches(lambda rows, kind, bias_kind, normed, chunked, group: (
                            gate_up_kernel(rows, kind, bias_kind, normed, chunked) if group is None
                            else gate_up_tiles_kernel(group, bias_kind)),
                        x, w_gu, bias, norm, (), (out,), stream, rt, width, slices_of=N // 2, unit=2 * PAIR)
    return out


# ---- SwiGLU in the tiled matmul (a prefill's many rows): the paper's two strategies ----

MICRO, SIDE, TILE_M, TILE_N = mm.MICRO, mm.SIDE, mm.TILE_M, mm.TILE_N  # the tiled matmul's geometry (constants
# of this module: Numba takes a module's own globals as compile-time constants, not another module's attributes)


def _make_swiglu_two_passes(to_f32):
    tile_product = mm.tile_product_for(to_f32)

    @cuda.jit
    def swiglu_tiled_two_passes(a, w_gate, w_up, out):
        """out [M, F] = silu(a @ w_gate) * (a @ w_up), a block per 64 x 64 tile of out (the tiled matmul's,
        `matmul.tile_product`): first the gate tile, its SiLU taken in registers, then the up tile over the same
        rows of a (read again, from the L2 cache), and the product. Neither [M, F] intermediate reaches memory.
        Grid (ceil(F / 64), ceil(M / 64)), block (16, 16)."""
        gate = cuda.local.array((MICRO, MICRO), dtype=float32)
        up = cuda.local.array((MICRO, MICRO), dtype=float32)
        row0, col0 = cuda.blockIdx.y * TILE_M, cuda.blockIdx.x * TILE_N
        tile_product(a, w_gate, row0, col0, gate)
        for i in range(MICRO):
            for j in range(MICRO):
                gate[i, j] = silu(gate[i, j])  # (issued before the up tile's loads, which do not wait for it)
        tile_product(a, w_up, row0, col0, up)
        for i in range(MICRO):
            for j in range(MICRO):
                gate[i, j] *= up[i, j]  # silu_times(g, u), the same operations
        mm.store_tile(gate, out, row0, col0)

    return swiglu_tiled_two_passes


def _make_swiglu_interleaved(to_f32):
    tile_product = mm.tile_product_for(to_f32)
    outs = TILE_N // 2  # output columns of a tile: its gate columns

    @cuda.jit
    def swiglu_tiled_interleaved(a, w_gu, out):
        """out [M, F] = silu(gate) * up from one tiled product a @ W_gu (W_gu = interleave_gate_up(w_gate, w_up),
        [K, 2F]): a block's 64 columns of W_gu are 32 gate columns and their up columns, so the tile, staged in
        shared memory, holds every pair its 64 x 32 outputs need. Grid (ceil(2F / 64), ceil(M / 64)), block
        (16, 16)."""
        acc = cuda.local.array((MICRO, MICRO), dtype=float32)
        tile = cuda.shared.array((TILE_M, TILE_N), dtype=float32)
        M, F = out.shape[0], out.shape[1]
        tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
        row0, col0 = cuda.blockIdx.y * TILE_M, cuda.blockIdx.x * TILE_N
        tile_product(a, w_gu, row0, col0, acc)
        mm.store_tile(acc, tile, 0, 0)
        cuda.syncthreads()
        for e in range(ty * SIDE + tx, TILE_M * outs, SIDE * SIDE):
            r, f = e // outs, e % outs
            n = gate_column(f)
            if row0 + r < M and col0 // 2 + f < F:
                out[row0 + r, col0 // 2 + f] = silu_times(tile[r, n], tile[r, n + PAIR])

    return swiglu_tiled_interleaved


_TWO_PASSES = for_weight_dtypes(_make_swiglu_two_passes)
_INTERLEAVED = for_weight_dtypes(_make_swiglu_interleaved)


def swiglu_two_passes(a, w_gate, w_up, out=None, stream=0, rt=None):
    """a [M, K] float32, w_gate and w_up [K, F] float32 or bf16 (uint16) -> out [M, F] = silu(a @ w_gate) *
    (a @ w_up), in one tiled kernel (gate then up in each block): the bits of matmul, matmul, silu_mul."""
    (M, K), F = a.shape, w_gate.shape[1]
    if w_gate.shape != (K, F) or w_up.shape != (K, F) or w_up.dtype != w_gate.dtype:
        raise ValueError(f"swiglu_two_passes: a {a.shape}, w_gate {w_gate.shape}, w_up {w_up.shape} {w_up.dtype}")
    out = empty((M, F), np.float32, stream, rt) if out is None else out
    launch(pick(_TWO_PASSES, w_gate), (-(-F // TILE_N), -(-M // TILE_M)), (SIDE, SIDE), stream, rt, a,
           w_gate, w_up, out)
    return out


def swiglu_interleaved(a, w_gu, out=None, stream=0, rt=None):
    """a [M, K] float32, w_gu [K, 2F] = interleave_gate_up(w_gate, w_up) float32 or bf16 (uint16) -> out [M, F] =
    silu(a @ w_gate) * (a @ w_up), in one tiled kernel over the interleaved columns: the bits of matmul, matmul,
    silu_mul."""
    (M, K), N = a.shape, w_gu.shape[1]
    if w_gu.shape[0] != K or N % (2 * PAIR):
        raise ValueError(f"swiglu_interleaved: a {a.shape}, w_gu {w_gu.shape} (2F a multiple of {2 * PAIR})")
    out = empty((M, N // 2), np.float32, stream, rt) if out is None else out
    launch(pick(_INTERLEAVED, w_gu), (-(-N // TILE_N), -(-M // TILE_M)), (SIDE, SIDE), stream, rt, a,
           w_gu, out)
    return out
