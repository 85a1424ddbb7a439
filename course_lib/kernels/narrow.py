"""Matrix products for decoding: a few rows of activations (a token's, or a batch's: up to 64) against big weights.

The tiled matmul (matmul.py) spends 64-row tiles on one row and launches only N / 64 blocks. Here every weight
is read once, by reads the memory system likes, and the grid is sized to fill the GPU.

Split-K narrow matmul, out[R, N] = a[R, K] @ b[K, N] (+ bias[N]), in one kernel (per KERNEL_ROWS rows):
- `matmul_split_k_vec`: a block of WARPS warps (16, one block per SM; 2 in the simulator) owns a group of 256
  adjacent columns and one slice of K (grid: column groups x S slices, S from `split_k`). Lane l owns 8 adjacent
  columns, read with 16-byte loads (`vector.load16`: one load for 8 bf16 weights, two for 8 float32), so a warp
  reads 512 contiguous bytes of a bf16 weight row per instruction. Warp w takes the rows k0 + w, k0 + w + WARPS,
  ... of the slice, UNROLL (8) rows at a time: eight loads in flight, then the FMAs into 8 R running sums (R is a
  compile-time constant: one kernel per R, the sums stay in registers). The warps' sums meet in shared memory,
  one row r at a time, and are added in warp order into a scratch partial[s, r, col].
  It needs N % 8 == 0 and 16-byte aligned weights; otherwise `matmul_split_k` does the same with one column per
  lane and one 4-byte (f32) or 2-byte (bf16) load per weight, 32 columns per group.
- The slices meet without a second kernel: each block, once its partial sums are written, counts itself in
  done[g] (an atomic add on one counter per column group); the last block of group g to arrive computes
  out[r, n] = partial[0, r, n] + ... + partial[S - 1, r, n] (+ bias[n]) in slice order, and resets the counter.
  The atomic only elects a block: the sums are always added in the same order, so the result is the same bit
  for bit from run to run, whichever block comes last. The bias is added there, for free (no bias kernel).
A block sums at most KERNEL_ROWS rows (R x 8 running sums per thread: 16 rows would need more registers than 16
warps can have). A launch of more rows (a batch's, up to LAUNCH_ROWS) sums the slices in tiles of rows x columns
(`tile_chunk_for`, the tile kernels): the split-K block's order of additions is a specification
(warp w sums the slice's rows k0 + w, k0 + w + WARPS, ... by FMAs from zero, the warps' sums are added in warp
order), and a thread holding an output can follow it, walking the slice residue after residue with two registers
per output (the residue's running sum, the total of the residues before it). Each weight staged in shared memory
then serves the tile's 8 to 64 rows instead of 4. The tile kernel writes the slices' sums only
(`tile_sums_kernel`), and the epilogue (slices added in order, bias or residual, and the fused epilogues of
kernels/fused) is a second launch: a block per tile of columns and EPILOGUE_ROWS rows, reading the slices 16 bytes at
a time (`quads_total_for`), or for the residual stream followed by a norm a block per row, which adds and
normalizes (`add_norm_epilogue`: a block holds the whole row). (The epilogue in the last of a tile's S blocks to
finish, elected by a counter, cost one launch less but was slower: one SM then reads a whole tile's slices while
the others idle.) Without 16-byte
loads, a launch of many rows has a block per chunk of KERNEL_ROWS rows (`rows_of_block`) calling the split-K block
on its rows, each chunk with its own completion counters. A row's result therefore does not depend on R (the
slices depend only on K and N, and each row's additions are made in the same order whatever the geometry): one
token alone, inside a prompt or inside a batch gets the same bits.

Transposed matmul, out[R, N] = a[R, K] @ b[N, K].T without copying b (tied-embedding logits: b is the [vocab, d]
embedding table), in one kernel, `matmul_transposed_vec`: a team of 8 lanes per row n of b (a warp takes 4 rows
at once; T_BLOCKS_PER_SM blocks per SM at most, a grid-stride loop over the rows). Lane j of a team reads the
8-element groups j, j + 8, ... of the row (16-byte loads of b and of a, UNROLL in flight), into R sums; each sum
is added across the team by three shuffles and the team's first lane writes out[r, n]. Without K % 8 == 0 and
aligned arrays, `matmul_transposed_warps` reads one element per lane, one warp per row. Both can normalize a row
of a themselves (the final norm inside the logits of a decode step): each block writes the normalized row into
shared memory once and reads it from there.

A batch's logits (`matmul_transposed_rows`) cannot follow the transposed kernel's order in tiles (a team of 8 lanes
per logit, added by shuffles): there each logit is summed along K in order by one thread, for any number of rows, so
the batched generator uses that kernel for every batch size and a sequence's logits do not depend on its batch.

Kernels are built on first use by factories, one per (R, weight kind), and kept in a dict; weight kinds are
"f32", "bf16" (one element per load) and "f32x8", "bf16x8" (eight per lane, 16-byte loads).
"""

import functools

import numpy as np
from numba import float32, int32, uint32

from course_lib.kernels import (
    SIMULATOR,
    WEIGHT_READERS,
    bf16_weight,
    cached_view,
    completion_counters,
    cuda,
    empty,
    f32_weight,
    last_to_arrive,
    launch,
    pick,
    sized,
    sm_count,
)
from course_lib.kernels import matmul as mm
from course_lib.kernels.elementwise import NORM_THREADS, block_sum, rms_norm, rms_of, row_rms, segment_sum
from course_lib.kernels.overlap import inputs_ready, prefetch_l2, waits_for_inputs
from course_lib.kernels.vector import (
    aligned16,
    bf16x8,
    f32x8,
    load16,
    load_quad,
    shared_load16,
    store_quad,
    weight_of_word,
    words,
)

MAX_ROWS = 16  # linear's choice: more rows go to the tiled matmul; the transposed kernels' largest R
WARPS = sized(16, 2)  # split-K warps per block (the simulator keeps full 32-lane warps, but fewer of them)
KERNEL_ROWS = 4  # rows a split-K block sums: more would not fit the registers of 16 warps (65,536 per SM); a launch
# of more rows sums its slices in tiles (tile_chunk_for), or without 16-byte loads a block per KERNEL_ROWS rows
LAUNCH_ROWS = 64  # rows of a launch at most (a multiple of KERNEL_ROWS): a batch of 64 sequences in one launch per
# projection, and the partial sums of a long prefill bounded ([S, 64, N])
THREADS = 32 * WARPS
# at most 65,536 / THREADS = 128 registers per thread, or a block of 16 warps cannot launch (the fused epilogues
# need more otherwise): a launch bound tells the compiler
SPLIT_K_BOUNDS = {} if SIMULATOR else {"launch_bounds": (THREADS,)}
T_WARPS = sized(8, 2)  # warps per block of the transposed kernels
T_THREADS = 32 * T_WARPS
UNROLL = 8  # loads in flight per thread
VEC = 8  # elements per lane and 16-byte load group
TEAM = 8  # lanes per row of b in the vector transposed kernel
MIN_SLICE = 64  # no K-slice shorter than this
BLOCKS_PER_SM = sized(1, 2)  # split_k's target: one block of 16 warps per SM leaves half the slices to add of
# two blocks of 8 (the simulator's 4 SMs need 2 to split small K)
TILE_THREADS = sized(256, 8)  # threads of a block of the tile kernels (the slices' sums of a batch's rows)
TILES = ((16, 2), (16, 4), (8, 2), (8, 1), (32, 2), (16, 1), (32, 1)) if not SIMULATOR else ((4, 4), (2, 2), (8, 1))
# its tiles (TX, TM): TX thread columns of VEC columns, TILE_THREADS / TX thread rows of TM rows; the first whose
# rows the launch fills and which gives it a block per two SMs ((16, 2) was the fastest or within 7% of it on each
# of SmolLM2's projections at 64 rows, data/batch_tiles_unrolled_h200.json; a quad a thread, (16, 4, 1), slower on
# each, data/batch_tiles_lanes_h100.json)


def tile_quads(tile) -> int:
    """The quads of columns a thread of a tile holds: QUADS (its thread column's VEC columns) for (TX, TM), 1 for
    (TX, TM, 1), whose thread columns' two quads are held by two threads (tile_thread)."""
    return tile[2] if len(tile) > 2 else QUADS


def tile_bounds(tile) -> dict:
    """The launch bounds of a tile kernel: two blocks per SM when a thread holds at most 16 sums (the compiler then
    keeps a thread within 128 registers, spilling a few bytes of its set-up; more would spill its sums)."""
    sums = tile[1] * QUAD * tile_quads(tile)
    return {} if SIMULATOR else {"launch_bounds": (TILE_THREADS, 2 if sums <= 16 else 1)}


TILE_PIECE = sized(32, 64)  # rows of K a tile block stages in shared memory at a time, whole residues (the
# simulator's 2 warps make residues of half a slice)
ROWS_TILES = ((16, 4, 1), (32, 2), (32, 1)) if not SIMULATOR else ((2, 4, 1), (4, 2), (8, 1))
# the tiles of matmul_transposed_rows, the largest first: the first whose rows the batch fills (SmolLM2's logits: the
# fastest of eight tiles at 8, 16, 32 and 64 rows, data/batch_tiles_fused_h200.json, then (16, 4, 1), a quad of rows
# of b a thread, faster than (16, 4) and (16, 2) at 32 and 64 rows, data/batch_tiles_lanes_h100.json)
EPILOGUE_ROWS = sized(8, 2)  # rows of a block of a tile epilogue's launch (a tile's columns x these rows: the
# slices of a tile read by many SMs, not by its last block alone)
EPILOGUE_THREADS = sized(128, 32)  # its threads: one output quad (and its partner) a thread at 8 rows of 128 columns
EPILOGUE_SLICES = sized(9, 2)  # slices a tile epilogue's thread reads at once (quads_total: 18 16-byte loads in
# flight, 72 registers): SmolLM2's projections have 9 slices, one round of loads (the simulator's 2: several rounds)
TILE_SLICE = WARPS * TILE_PIECE  # the longest slice of K a tile block takes: a residue fits in a piece
NORMED_ROWS = 1  # the most rows a split-K block normalizes itself: with the norm inside, the kernel of 2 rows or more
# needs more than the 128 registers a thread of 16 warps may have, and spills (ptxas, sm_90: 52 bytes a thread at 2
# rows, over 400 at 4); a launch of more rows has rms_norm write them normalized first (the same bits)
MAX_NORMED_K = 8192  # the longest row a transposed kernel normalizes itself (in shared memory: 32 KB a block)
T_BLOCKS_PER_SM = 4  # the transposed kernels' grid: at most this many blocks per SM, a grid-stride loop over the
# rows beyond (a block for every 32 rows ran as about 1.5 waves)


# ---- how K is split ----

@functools.cache
def split_k(K: int, N: int, cols_per_block: int, sms: int, warps: int = WARPS, per_sm: int = BLOCKS_PER_SM) -> int:
    """The number S of K-slices of the split-K matmul (N columns in groups of cols_per_block, on `sms` SMs).

    The grid is (column groups) x S blocks, G = ceil(N / cols_per_block) groups: S is the integer that brings
    G x S closest to per_sm x sms (about per_sm blocks per SM), but at most K // MIN_SLICE, so that no slice
    is shorter than MIN_SLICE (slice s covers k in [s K // S, (s + 1) K // S): its length is K // S or one
    more), and at least 1 (then the one slice may be short: K < 2 MIN_SLICE). When K is a multiple of a
    block's step (warps x UNROLL rows), S is the divisor of K / step nearest that integer, so that every slice is
    whole steps: no rows are left over for the loop that reads one row at a time, a memory latency per row.
    """
    groups = -(-N // cols_per_block)
    want = max(1, min(round(per_sm * sms / groups), K // MIN_SLICE))
    steps, left = divmod(K, warps * UNROLL)
    if left:
        return want
    most = max(1, min(steps, K // MIN_SLICE))
    return min((d for d in range(1, most + 1) if steps % d == 0), key=lambda d: abs(d - want))


# ---- device functions ----

@cuda.jit(device=True)
def store_row(sums, partial, s, r, col0):
    """partial[s, r, col0 + c] = sums[0, c] + sums[1, c] + ... (warps in order), for columns < N.
    sums: shared [WARPS, width], written by all warps before the call (after a syncthreads)."""
    width = sums.shape[1]
    for c in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        if col0 + c < partial.shape[2]:
            v = sums[0, c]
            for w in range(1, WARPS):
                v += sums[w, c]
            partial[s, r, col0 + c] = v


@cuda.jit(device=True)
def sum_slices(partial, r, n):
    """partial[0, r, n] + partial[1, r, n] + ..., in slice order, the loads UNROLL at a time: they come from the
    L2 cache, and one load waiting for the previous add would cost S L2 latencies in a row (~5 us for S = 33)."""
    buf = cuda.local.array(UNROLL, dtype=float32)
    S = partial.shape[0]
    v = float32(0)
    for s0 in range(0, S, UNROLL):
        for u in range(UNROLL):
            if s0 + u < S:
                buf[u] = partial[s0 + u, r, n]
        for u in range(UNROLL):
            if s0 + u < S:
                v += buf[u]
    return v


# ---- the split-K block and its epilogues: device functions of (virtual block index, buffers) ----

@functools.cache
def split_k_block_for(rows, width, load, normed):
    """The device function split_k_block(g, s, a, gamma, eps, b, partial, done) -> bool for R = rows, `width`
    columns per lane (1, or VEC with 16-byte loads): load(b, k, v, per_row) gives the `width` float32 weights of
    row k, columns width v .. width v + width - 1. normed: the rows of a are RMS-normalized on the fly, h[r, k] =
    a[r, k] / rms(a[r]) * gamma[k], with the same bits as rms_norm (`elementwise.row_rms`), so no normalized copy
    is written or read. The split-K kernels of this module and of `fused` are thin wrappers around it (a launch of
    many rows calls it once per chunk of rows: `rows_of_block`); the tile kernels, which take a batch's rows beyond
    KERNEL_ROWS with 16-byte loads, have loops of their own (`split_k_tile_sums`)."""
    group = 32 * width  # columns of a block

    @cuda.jit(device=True)
    def split_k_sums(g, s, a, gamma, eps, b, partial):
        """Sums slice s of K for the columns of group g of a [rows, K] @ b [K, N] into partial[s] [rows, N]. Every
        thread of the block calls."""
        sums = cuda.shared.array((WARPS, group), dtype=float32)
        scratch = cuda.shared.array(32, dtype=float32)
        scale = cuda.local.array(rows, dtype=float32)
        acc = cuda.local.array((rows, width), dtype=float32)
        buf = cuda.local.array((UNROLL, width), dtype=float32)
        K, N, S = a.shape[1], partial.shape[2], partial.shape[0]
        tid = cuda.threadIdx.x
        lane, warp = tid % 32, tid // 32
        v, per_row = g * 32 + lane, N // width
        k, k_end = s * K // S + warp, (s + 1) * K // S
        if normed:
            for r in range(rows):
                scale[r] = row_rms(a, r, eps, scratch)
        for r in range(rows):
            for c in range(width):
                acc[r, c] = float32(0)
        if v < per_row:
            while k + (UNROLL - 1) * WARPS < k_end:  # rows k, k + WARPS, ..., k + (UNROLL - 1) WARPS
                for u in range(UNROLL):  # all the loads first: UNROLL in flight
                    w = load(b, k + u * WARPS, v, per_row)
                    for c in range(width):
                        buf[u, c] = w[c]
                for r in range(rows):
                    for u in range(UNROLL):
                        x = a[r, k + u * WARPS]
                        if normed:
                            x = x / scale[r] * gamma[k + u * WARPS]
                        for c in range(width):
                            acc[r, c] += x * buf[u, c]
                k += UNROLL * WARPS
            while k < k_end:
                w = load(b, k, v, per_row)
                for r in range(rows):
                    x = a[r, k]
                    if normed:
                        x = x / scale[r] * gamma[k]
                    for c in range(width):
                        acc[r, c] += x * w[c]
                k += WARPS
        for r in range(rows):  # the block's sums, one row at a time, warps in order
            for c in range(width):
                sums[warp, lane * width + c] = acc[r, c]
            cuda.syncthreads()
            store_row(sums, partial, s, r, g * group)
            cuda.syncthreads()

    @cuda.jit(device=True)
    def split_k_block(g, s, a, gamma, eps, b, partial, done):
        """Block (g, s) of the split-K product a [R, K] @ b [K, N]: sums slice s of K for the columns of group g
        into partial[s] [R, N], then counts itself in done[g]. Returns True in the group's last block to finish
        (every slice of the group is then in partial), False elsewhere. Every thread of the block calls."""
        split_k_sums(g, s, a, gamma, eps, b, partial)
        return last_to_arrive(done, g, partial.shape[0])

    return split_k_block


QUAD = 4  # float32 in 16 bytes: a tile's columns are staged in shared memory in quads, read by 16-byte loads
QUADS = VEC // QUAD  # the quads of a thread's VEC columns


@cuda.jit(device=True)
def tile_thread(tid, tx, tm, tq):
    """(v, r0) of thread tid in a tile of tx thread columns (VEC columns each) and tm rows per thread, tq quads a
    thread (tile_quads): the thread's first quad of columns, v (0 <= v < QUADS tx), and the first of its tm rows.

    The tile's columns are staged in quads, ws[t, h, u, :] holding columns 4 tx h + 4 u .. + 3 of the tile (half h
    of thread column u), so that a thread reads its quads as 16-byte shared loads, v + h tx for h < tq, and the
    lanes of a warp read adjacent quads (with tq = 1, the quads of half 0 of the tile and those of half 1 each have
    their own threads). Lanes 2 i and 2 i + 1 take the same quads and two neighbouring thread rows; lanes 2 i and
    2 i + 2 the same rows.
    Why: the shared memory returns 128 bytes a cycle, so a warp's 16-byte load takes four cycles, but two when
    lanes n and n ^ 1 (or n and n ^ 2) read the same address: here lanes n and n ^ 1 share every weight load and
    lanes n and n ^ 2 every 16-byte load of activations (tm = 4). An odd number of thread rows (the simulator's
    tiles of one) keeps the threads in order along the columns."""
    columns = tx * QUADS // tq  # threads across the tile's columns
    if (TILE_THREADS // columns) % 2:
        c, row = tid % columns, tid // columns
    else:
        q = tid // 2
        c, row = q % columns, 2 * (q // columns) + tid % 2
    return (c // tx) * tq * tx + c % tx, row * tm


@functools.cache
def tile_step_for(tm, tq):
    """The device function tile_step(ws, xs, t, v, r0, wv, acc) of the tile kernels: row t of K staged in shared
    memory, acc[r, c] += xs[t, r0 + r] * (quad v + (c // 4) tx of ws[t])[c % 4] for this thread's tm rows and tq
    quads of columns (tile_thread; wv: a local [4 tq] for the weights), each sum one FMA further along K. The
    weights come in tq 16-byte shared loads (`shared_load16`: Numba alone reads an array one element at a time, and
    ten 4-byte loads for 16 FMAs left the shared memory, not the FMA units, setting the pace); with tm = 4 (xs's
    rows then whole quads, r0 a multiple of QUAD) the activations in one more, with fewer rows a thread in tm scalar
    loads."""
    width = QUAD * tq

    @cuda.jit(device=True)
    def tile_step(ws, xs, t, v, r0, wv, acc):
        tx = ws.shape[2]
        for h in range(tq):  # the 16-byte step t QUADS tx + v + h tx of ws
            w0, w1, w2, w3 = shared_load16(ws, (t * QUADS + h) * tx + v)
            wv[QUAD * h], wv[QUAD * h + 1], wv[QUAD * h + 2], wv[QUAD * h + 3] = w0, w1, w2, w3
        if tm == QUAD:  # xs[t, r0 .. r0 + 3]: pitch and r0 multiples of QUAD
            xv = cuda.local.array(QUAD, dtype=float32)
            xv[0], xv[1], xv[2], xv[3] = shared_load16(xs, (t * xs.shape[1] + r0) // QUAD)
            for r in range(tm):
                for c in range(width):
                    acc[r, c] += xv[r] * wv[c]
        else:
            for r in range(tm):
                x = xs[t, r0 + r]
                for c in range(width):
                    acc[r, c] += x * wv[c]

    return tile_step


@functools.cache
def residue_steps_for(tm, tq, steps):
    """The device function residue_steps(ws, xs, t, v, r0, wv, acc): tile_step for the rows t .. t + steps - 1 of
    K, written out one after the other at compile time (the compiler does not unroll the loop of a residue, and
    unrolled, the shared loads of a row are issued while the FMAs of the one before run)."""
    step = tile_step_for(tm, tq)
    if steps == 1:
        return step
    rest = residue_steps_for(tm, tq, steps - 1)

    @cuda.jit(device=True)
    def residue_steps(ws, xs, t, v, r0, wv, acc):
        step(ws, xs, t, v, r0, wv, acc)
        rest(ws, xs, t + 1, v, r0, wv, acc)

    return residue_steps


@functools.cache
def fold_for(tm, tq):
    """The device function fold(acc, total, first): a residue's sums acc [tm, 4 tq] added into total as store_row adds
    the warps' sums (total = acc for the slice's first residue), acc zeroed for the next."""
    width = QUAD * tq

    @cuda.jit(device=True)
    def fold(acc, total, first):
        for r in range(tm):
            for c in range(width):
                total[r, c] = acc[r, c] if first else total[r, c] + acc[r, c]
                acc[r, c] = float32(0)

    return fold


@functools.cache
def residues_for(tm, tq, residue, count):
    """The device function residues(ws, xs, t, v, r0, wv, acc, total, first): `count` residues of `residue` rows of
    K from row t of the staged piece, each summed (residue_steps) and folded into total (first: the first of them is
    the slice's first), written out at compile time: every shared address is then a constant offset."""
    steps, fold = residue_steps_for(tm, tq, residue), fold_for(tm, tq)
    if count == 1:
        @cuda.jit(device=True)
        def residue_alone(ws, xs, t, v, r0, wv, acc, total, first):
            steps(ws, xs, t, v, r0, wv, acc)
            fold(acc, total, first)

        return residue_alone
    rest = residues_for(tm, tq, residue, count - 1)

    @cuda.jit(device=True)
    def residues(ws, xs, t, v, r0, wv, acc, total, first):
        steps(ws, xs, t, v, r0, wv, acc)
        fold(acc, total, first)
        rest(ws, xs, t + residue, v, r0, wv, acc, total, False)

    return residues


def uniform_residue(K: int, S: int) -> int:
    """The residue length (rows of K a split-K warp sums in a slice) when it is the same in every slice of K in S
    and a piece holds a whole number of residues, and a slice a whole number of pieces (then the tile kernel writes
    a piece's steps out), else 0."""
    residue = K // S // WARPS if K % (S * WARPS) == 0 else 0
    return residue if residue and TILE_PIECE % residue == 0 and WARPS % (TILE_PIECE // residue) == 0 else 0


@functools.cache
def tile_sums_for(tile, wide, residue=0):
    """The device function tile_sums(g, s, a, b, partial): slice s of K of a tile of a batch's rows, a [R, K] @
    b [K, N] for the VEC tx columns of tile g and the rows of a (a chunk of at most tile_rows(tile) rows),
    into partial[s] [R, N], with the bits of split_k_sums (b: the uint32 words of float32 weights when wide, of bf16
    ones else, read 16 bytes a load; no norm). The slice's residues must each fit in a piece (see below).
    residue: uniform_residue(K, S), the rows of every residue when they are all the same and a piece holds a whole
    number of them (a compile-time constant: the piece's steps are written out, `residues_for`), or 0: the residues
    computed per slice, walked by loops.

    split_k_sums fixes the order of the additions of an output: warp w sums the slice's rows k0 + w, k0 + w +
    WARPS, ... (its residue w) by FMAs from zero, then the warps' sums are added in warp order. Any geometry that
    makes the same operations in the same order gets the same bits: here a block owns a tile of outputs, a thread
    tm rows x tq quads of columns of it (tile_thread), and walks the slice residue after residue with two registers per
    output: `acc`, the running sum of the residue, and `total`, the residues before it added in order. The slice
    order (residue 0's rows, then residue 1's, ...) is written once per block in shared memory (`order`); the
    weights and activations of whole residues, at most TILE_PIECE rows, are staged at a time, the next piece's
    loads in flight while the FMAs of this one run. Every weight staged serves the tile's rows, every activation its
    columns: tq 16-byte loads from shared memory for the weights, and the tm activations (one more 16-byte load
    when tm = 4), for tm x 4 tq FMAs, and no test per row of K. The activations are fetched with a warp's lanes along
    the slice order (the rows k0 + w + WARPS j of a row of a lie within a few lines; lanes along the rows of a read
    32 lines an instruction), and the sums leave in 16-byte stores, whole sectors a warp (a lane's four adjacent
    columns stored one by one left each sector written four times). The next piece's weights wait in registers as
    the words loaded (`weight_of_word` widens them as they are stored into ws): half the registers for bf16, and no
    instruction that needs them until this piece's FMAs are issued."""
    (tx, tm), tq = tile[:2], tile_quads(tile)
    width = QUAD * tq  # a thread's columns
    units = 2 if wide else 1  # 16-byte loads per VEC weights
    raw = QUAD * units  # their uint32 words
    rows = tile_rows(tile)
    pitch = rows + QUAD if tm >= QUAD else rows + 1  # xs's row: whole quads when a thread reads 4 rows at once
    w_loads = TILE_PIECE * tx // TILE_THREADS  # the 16-byte loads of weights a thread stages per piece
    x_loads = TILE_PIECE * rows // TILE_THREADS  # the activations
    step, fold = tile_step_for(tm, tq), fold_for(tm, tq)
    piece = residues_for(tm, tq, residue, TILE_PIECE // residue) if residue else None

    @cuda.jit(device=True)
    def fetch(p0, n, order, a, b, v0, per_row, wbuf, xbuf):
        """This thread's loads of the n rows of slice order from position p0, into registers: weights
        (tid + i TILE_THREADS = t tx + q: row order[p0 + t], group v0 + q), activations (= r TILE_PIECE + t: lanes
        along the slice order; xs's pitch of rows + 1 keeps their stores along K free of bank conflicts when tm < 4);
        zeros past the piece, the columns or the rows."""
        tid = cuda.threadIdx.x
        for i in range(w_loads):
            t, q = (tid + i * TILE_THREADS) // tx, (tid + i * TILE_THREADS) % tx
            if t < n and v0 + q < per_row:
                for h in range(units):  # 16-byte step units (k per_row + v) + h of b
                    w0, w1, w2, w3 = load16(b, units * (order[p0 + t] * per_row + v0 + q) + h)
                    wbuf[i, QUAD * h], wbuf[i, QUAD * h + 1], wbuf[i, QUAD * h + 2], wbuf[i, QUAD * h + 3] = \
                        w0, w1, w2, w3
            else:
                for c in range(raw):
                    wbuf[i, c] = uint32(0)
        for i in range(x_loads):
            t, r = (tid + i * TILE_THREADS) % TILE_PIECE, (tid + i * TILE_THREADS) // TILE_PIECE
            xbuf[i] = a[r, order[p0 + t]] if t < n and r < a.shape[0] else float32(0)

    @cuda.jit(device=True)
    def tile_sums(g, s, a, b, partial):
        order = cuda.shared.array(TILE_SLICE, dtype=int32)  # order[t]: the row of K at position t of slice order
        ws = cuda.shared.array((TILE_PIECE, QUADS, tx, QUAD), dtype=float32)  # ws[t] (tile_thread): row
        # order[t] of the tile's columns
        xs = cuda.shared.array((TILE_PIECE, pitch), dtype=float32)  # xs[t, r] = a[r, order[t]]
        acc = cuda.local.array((tm, width), dtype=float32)
        total = cuda.local.array((tm, width), dtype=float32)
        wv = cuda.local.array(width, dtype=float32)
        wbuf = cuda.local.array((w_loads, raw), dtype=uint32)  # the words of a row's VEC weights
        xbuf = cuda.local.array(x_loads, dtype=float32)
        R, K, N, S = a.shape[0], a.shape[1], partial.shape[2], partial.shape[0]
        tid = cuda.threadIdx.x
        quad0, r0 = tile_thread(tid, tx, tm, tq)  # this thread's first quad of the tile's columns, its first row
        per_row, v0 = N // VEC, g * tx
        k0 = s * K // S
        L = (s + 1) * K // S - k0
        m = residue if residue else L // WARPS  # residue w has m rows, one more when w < rem; it starts at
        rem = 0 if residue else L % WARPS  # w m + min(w, rem)
        per_piece = TILE_PIECE // (m + (1 if rem > 0 else 0))  # the residues of a piece
        if tid < WARPS:
            for j in range(m + (1 if tid < rem else 0)):
                order[tid * m + min(tid, rem) + j] = k0 + tid + WARPS * j
        for r in range(tm):
            for c in range(width):
                acc[r, c] = float32(0)
        cuda.syncthreads()
        w1 = min(WARPS, per_piece)
        fetch(0, w1 * m + min(w1, rem), order, a, b, v0, per_row, wbuf, xbuf)
        for w0 in range(0, WARPS, per_piece):
            w1 = min(WARPS, w0 + per_piece)
            p0 = w0 * m + min(w0, rem)
            cuda.syncthreads()  # the previous piece is used up
            for i in range(w_loads):
                t, q = (tid + i * TILE_THREADS) // tx, (tid + i * TILE_THREADS) % tx
                for c in range(VEC):  # column VEC q + c of the tile, in quad 2 q + c // 4
                    quad = QUADS * q + c // QUAD
                    ws[t, quad // tx, quad % tx, c % QUAD] = weight_of_word(wbuf[i, c if wide else c // 2], c, wide)
            for i in range(x_loads):
                xs[(tid + i * TILE_THREADS) % TILE_PIECE, (tid + i * TILE_THREADS) // TILE_PIECE] = xbuf[i]
            cuda.syncthreads()
            if w1 < WARPS:  # the next piece's loads, in flight during this piece's FMAs
                w2 = min(WARPS, w1 + per_piece)
                p1 = w1 * m + min(w1, rem)
                fetch(p1, w2 * m + min(w2, rem) - p1, order, a, b, v0, per_row, wbuf, xbuf)
            if residue:  # the piece's residues written out (warps without rows would add zeros: there are none)
                piece(ws, xs, 0, quad0, r0, wv, acc, total, w0 == 0)
            else:
                for w in range(w0, w1):
                    t0 = w * m + min(w, rem) - p0
                    for j in range(m + (1 if w < rem else 0)):
                        step(ws, xs, t0 + j, quad0, r0, wv, acc)
                    fold(acc, total, w == 0)  # the warps without rows add their zeros
        for r in range(tm):  # 16-byte stores: a warp's lanes write whole sectors (N is a multiple of VEC)
            if r0 + r < R:
                for h in range(tq):
                    n = VEC * v0 + QUAD * (quad0 + h * tx)
                    if n < N:
                        store_quad(partial, (s, r0 + r, n), total[r, QUAD * h], total[r, QUAD * h + 1],
                                   total[r, QUAD * h + 2], total[r, QUAD * h + 3])

    return tile_sums


@cuda.jit(device=True)
def rows_of_block(R, chunk, done):
    """(lo, hi, counters) in a launch with a block per chunk of rows: the rows lo .. hi - 1 of the launch's R rows
    that this block sums, chunk blockIdx.z of `chunk` rows (grid z: ceil(R / chunk)), and the chunk's own
    completion counters, one per column group, in `done` [groups x chunks]. A kernel of one chunk (a decode step's
    row) takes its arrays whole instead: a view of some rows of partial is strided, and costs every index of it more
    arithmetic and the kernel more registers."""
    lo = cuda.blockIdx.z * chunk
    return lo, min(R, lo + chunk), done[cuda.blockIdx.z * cuda.gridDim.x:]


@cuda.jit(device=True)
def no_prefetch(g, s, a, b, partial):
    """The weights read one element per lane (kinds "f32", "bf16"): not prefetched."""


@functools.cache
def prefetch_slice_for(units):
    """The device function prefetch_slice(g, s, a, b, partial) for weights seen as uint32 words (16-byte loads),
    `units` 16-byte units per lane and row (1 for bf16x8, 2 for f32x8): asks the L2 cache for this thread's rows of
    slice s of K, the columns of group g, the weights split_k_sums will read, without waiting for them. A kernel
    launched programmatically calls it before wait_for_inputs (kernels/overlap.py): the weights travel while the
    previous kernel ends."""

    @cuda.jit(device=True)
    def prefetch_slice(g, s, a, b, partial):
        K, S = a.shape[1], partial.shape[0]
        per_row = partial.shape[2] // VEC
        v = g * 32 + cuda.threadIdx.x % 32
        if v < per_row:
            for k in range(s * K // S + cuda.threadIdx.x // 32, (s + 1) * K // S, WARPS):
                prefetch_l2(b, units * (k * per_row + v))

    return prefetch_slice


@functools.cache
def column_total_for(bias_f32):
    """The device function column_total(partial, bias, r, n): the K-sum of column n of row r, the S slices of
    partial added in slice order (sum_slices), + bias[n] read by bias_f32 (a bias of length 0 is none). The split-K
    kernels' epilogues start from it (store_group here, those of kernels/fused); the tile launches' epilogues add the
    slices in the same order 16 bytes at a time (quads_total), add_norm_epilogue in the same order too: the same
    bits."""

    @cuda.jit(device=True)
    def column_total(partial, bias, r, n):
        total = sum_slices(partial, r, n)
        if bias.shape[0] > 0:
            total += bias_f32(bias[n])
        return total

    return column_total


@functools.cache
def store_group_for(group, bias_f32, accumulate):
    """The plain epilogue store_group(g, partial, bias, out): out[r, n] = the S slices of partial added in slice
    order (+ bias[n], read by bias_f32; a bias of length 0 is none), for the columns n of group g; with
    accumulate, out[r, n] += that instead (the residual stream: x + o rounded once, as an add kernel after the
    matmul would)."""
    column_total = column_total_for(bias_f32)

    @cuda.jit(device=True)
    def store_group(g, partial, bias, out):
        rows, N = out.shape[0], out.shape[1]  # the launch's rows (partial may have more: a launch of fewer rows)
        for e in range(cuda.threadIdx.x, rows * group, cuda.blockDim.x):
            r, n = e // group, g * group + e % group
            if n < N:
                total = column_total(partial, bias, r, n)
                if accumulate:
                    total = out[r, n] + total
                out[r, n] = total

    return store_group


# ---- kernel factories: one kernel per (rows, weight kind) ----

def _make_split_k(rows, width, load, prefetch, bias_f32, accumulate, normed, chunked):
    """The split-K kernel: its weights asked of the L2 cache (prefetch), its inputs waited for (kernels/overlap.py),
    split_k_block then, in each group's last block, store_group (see the top); chunked: a block per chunk of rows
    (rows_of_block)."""
    block = split_k_block_for(rows, width, load, normed)
    store = store_group_for(32 * width, bias_f32, accumulate)

    def matmul_split_k(a, gamma, eps, b, bias, partial, done, out):
        """out = h [R, K] @ b [K, N] + bias [N] (no bias: bias has length 0), or out += that when the kernel
        accumulates; h = a, or RMSNorm(a) * gamma [K] (eps) when normed; through partial [S, R, N] and done
        (split_k_block), done [groups x chunks]. Grid (ceil(N / group), S, chunks of rows_of_block), THREADS."""
        g, s = cuda.blockIdx.x, cuda.blockIdx.y
        prefetch(g, s, a, b, partial)
        inputs_ready()
        if chunked:
            lo, hi, counters = rows_of_block(a.shape[0], rows, done)
            if block(g, s, a[lo:hi], gamma, eps, b, partial[:, lo:hi], counters):
                store(g, partial[:, lo:hi], bias, out[lo:hi])
        elif block(g, s, a, gamma, eps, b, partial, done):
            store(g, partial, bias, out)

    name = ("matmul_split_k" + ("_norm" if normed else "") + ("_vec" if width == VEC else "")
            + ("_add" if accumulate else ""))
    matmul_split_k.__name__ = matmul_split_k.__qualname__ = name  # the name profiles and tests see
    return waits_for_inputs(cuda.jit(**SPLIT_K_BOUNDS)(matmul_split_k))


@functools.cache
def tile_chunk_for(tile, kind, residue=0):
    """The device function tile_chunk(a, b, partial) -> (g, lo, hi) of the tile kernels, block (g, s, z) of a grid
    (ceil(N / (VEC tx)), S, ceil(R / rows)) for a tile of TILES, weight kind "f32x8" or "bf16x8" and `residue`
    (tile_sums_for): it asks the L2 cache for slice s's weights (the blocks of chunk 0: the other chunks
    find them there), waits for its inputs, and sums slice s of K of a [R, K] @ b [K, N] for the tile of columns g
    and the rows lo .. hi - 1 of chunk z into partial[s] [R, N]."""
    tx = tile[0]
    units = 2 if kind == "f32x8" else 1  # 16-byte units per VEC weights
    sums = tile_sums_for(tile, kind == "f32x8", residue)
    rows = tile_rows(tile)

    @cuda.jit(device=True)
    def tile_chunk(a, b, partial):
        g, s, lo = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z * rows
        K, S, per_row = a.shape[1], partial.shape[0], partial.shape[2] // VEC
        if cuda.blockIdx.z == 0:  # the slice's weights asked of the L2 cache (the other chunks read them there)
            k0, k1 = s * K // S, (s + 1) * K // S
            for e in range(cuda.threadIdx.x, (k1 - k0) * tx, TILE_THREADS):
                k, v = k0 + e // tx, g * tx + e % tx
                if v < per_row:
                    prefetch_l2(b, units * (k * per_row + v))
        inputs_ready()
        hi = min(a.shape[0], lo + rows)
        sums(g, s, a[lo:hi], b, partial[:, lo:hi])
        return g, lo, hi

    return tile_chunk


@functools.cache
def tile_sums_kernel(tile, kind, residue=0):
    """The kernel of tile_chunk_for: the slices' sums of a batch's rows into partial, a block per (tile of columns,
    slice, chunk of rows); the epilogue is the next launch (split_k_launches)."""
    chunk = tile_chunk_for(tile, kind, residue)

    def split_k_tile_sums(a, b, partial):
        """partial[s, r, n] = the sum over slice s of K of a [R, K] @ b [K, N], added as split_k_sums adds. Grid
        (ceil(N / (VEC tx)), S, ceil(R / rows)), TILE_THREADS."""
        chunk(a, b, partial)

    split_k_tile_sums.__name__ = split_k_tile_sums.__qualname__ = "split_k_tile_sums_vec"
    return waits_for_inputs(cuda.jit(**tile_bounds(tile))(split_k_tile_sums))


@functools.cache
def quads_total_for(bias_f32):
    """The device function quads_total(partial, bias, r, n, far, t): t [8] = the K-sums of row r's columns n .. n + 3
    and n + far .. n + far + 3 (n, far multiples of 4; partial [S, R, N], N a multiple of 4), each the S slices added
    in slice order (+ bias[n], read by bias_f32; a bias of length 0 is none), the bits of column_total: 16-byte
    loads, EPILOGUE_SLICES slices of both quads in flight (from the L2 cache: each round of loads is one of its
    latencies in a row)."""

    @cuda.jit(device=True)
    def quads_total(partial, bias, r, n, far, t):
        buf = cuda.local.array((EPILOGUE_SLICES, 8), dtype=float32)
        S = partial.shape[0]
        for c in range(8):
            t[c] = float32(0)
        for s0 in range(0, S, EPILOGUE_SLICES):
            for u in range(EPILOGUE_SLICES):
                if s0 + u < S:
                    buf[u, 0], buf[u, 1], buf[u, 2], buf[u, 3] = load_quad(partial, (s0 + u, r, n))
                    buf[u, 4], buf[u, 5], buf[u, 6], buf[u, 7] = load_quad(partial, (s0 + u, r, n + far))
            for u in range(EPILOGUE_SLICES):
                if s0 + u < S:
                    for c in range(8):
                        t[c] += buf[u, c]
        if bias.shape[0] > 0:
            for c in range(QUAD):
                t[c] += bias_f32(bias[n + c])
                t[QUAD + c] += bias_f32(bias[n + far + c])

    return quads_total


@functools.cache
def tile_store_for(group, bias_f32, accumulate):
    """The plain epilogue of the tile launches, tile_store(g, partial, bias, out): store_group's sums for the
    `group` columns of tile g and the rows of out [R, N] (N a multiple of 8), eight columns a thread at a time
    (quads_total, then 16-byte stores)."""
    quads_total = quads_total_for(bias_f32)

    @cuda.jit(device=True)
    def tile_store(g, partial, bias, out):
        t = cuda.local.array(8, dtype=float32)
        rows, N, octets = out.shape[0], out.shape[1], group // 8
        for e in range(cuda.threadIdx.x, rows * octets, cuda.blockDim.x):
            r, n = e // octets, g * group + 8 * (e % octets)
            if n < N:
                quads_total(partial, bias, r, n, QUAD, t)
                if accumulate:  # x + o rounded once, as store_group
                    for h in range(2):
                        x0, x1, x2, x3 = load_quad(out, (r, n + QUAD * h))
                        t[QUAD * h], t[QUAD * h + 1] = x0 + t[QUAD * h], x1 + t[QUAD * h + 1]
                        t[QUAD * h + 2], t[QUAD * h + 3] = x2 + t[QUAD * h + 2], x3 + t[QUAD * h + 3]
                store_quad(out, (r, n), t[0], t[1], t[2], t[3])
                store_quad(out, (r, n + QUAD), t[4], t[5], t[6], t[7])

    return tile_store


@cuda.jit(device=True)
def epilogue_rows(R):
    """(g, lo, hi) of block (g, 0, z) of a tile epilogue's launch over R rows: its tile of columns g and the rows
    lo .. hi - 1 (EPILOGUE_ROWS of them, fewer in the last block)."""
    lo = cuda.blockIdx.z * EPILOGUE_ROWS
    return cuda.blockIdx.x, lo, min(R, lo + EPILOGUE_ROWS)


@functools.cache
def tile_store_kernel(group, bias, accumulate):
    """The plain epilogue of the tile launches as a launch of its own (tile_store: + bias, or added into out when
    `accumulate`), after tile_sums_kernel's."""
    store = tile_store_for(group, BIAS_READERS[bias], accumulate)

    def matmul_tiles_store(partial, bias, out):
        """out (+)= the K-sums of partial [S, R, N] (+ bias [N]). Grid (ceil(N / group), 1, ceil(R /
        EPILOGUE_ROWS)), EPILOGUE_THREADS."""
        inputs_ready()
        g, lo, hi = epilogue_rows(out.shape[0])
        store(g, partial[:, lo:hi], bias, out[lo:hi])

    matmul_tiles_store.__name__ = matmul_tiles_store.__qualname__ = "matmul_tiles_store" + ("_add" if accumulate
                                                                                            else "")
    return waits_for_inputs(cuda.jit(matmul_tiles_store))


@functools.cache
def add_norm_kernel(per_thread: int):
    """add_norm_epilogue for rows of at most NORM_THREADS x per_thread columns (a thread's columns in registers)."""
    rounds = max(1, 4 * UNROLL // per_thread)  # slices a round: a thread's loads in flight, about 4 UNROLL

    def add_norm_epilogue(partial, x, gamma, eps, h):
        """The epilogue of a batch's residual projection fused with the norm of the next one, a block of NORM_THREADS
        per row r (grid R): x[r, n] += the S slices of partial [S, R, N] added in slice order (the bits of
        store_group's accumulate), then h[r] = x[r] / rms(x[r]) * gamma [N] float32 (the bits of rms_norm). Thread t
        holds the columns t, t + NORM_THREADS, ... of row_rms's order, so the row stays in registers from the add to
        the norm: one round of loads, one block reduction, the stores. x and gamma are read before the wait for the
        kernel before (the slices' sums): x must not be written by it. The block holds the whole row, so the norm
        needs no other launch (a tile kernel's last block would have to normalize its chunk's rows alone: measured,
        slower than this launch)."""
        xs = cuda.local.array(per_thread, dtype=float32)
        gs = cuda.local.array(per_thread, dtype=float32)
        total = cuda.local.array(per_thread, dtype=float32)
        buf = cuda.local.array((per_thread, rounds), dtype=float32)
        scratch = cuda.shared.array(32, dtype=float32)
        r, tid = cuda.blockIdx.x, cuda.threadIdx.x
        N, S = x.shape[1], partial.shape[0]
        for i in range(per_thread):
            total[i] = float32(0)
            if tid + NORM_THREADS * i < N:
                xs[i], gs[i] = x[r, tid + NORM_THREADS * i], gamma[tid + NORM_THREADS * i]
        inputs_ready()
        for s0 in range(0, S, rounds):  # sum_slices for each column, every load of a round issued first
            for i in range(per_thread):
                for u in range(rounds):
                    if s0 + u < S and tid + NORM_THREADS * i < N:
                        buf[i, u] = partial[s0 + u, r, tid + NORM_THREADS * i]
            for i in range(per_thread):
                for u in range(rounds):
                    if s0 + u < S and tid + NORM_THREADS * i < N:
                        total[i] += buf[i, u]
        sum_sq = float32(0)
        for i in range(per_thread):
            if tid + NORM_THREADS * i < N:
                xs[i] = xs[i] + total[i]
                x[r, tid + NORM_THREADS * i] = xs[i]
                sum_sq += xs[i] * xs[i]
        rms = rms_of(block_sum(sum_sq, scratch), N, eps)
        for i in range(per_thread):
            if tid + NORM_THREADS * i < N:
                h[r, tid + NORM_THREADS * i] = xs[i] / rms * gs[i]

    return waits_for_inputs(cuda.jit(add_norm_epilogue))


def tile_rows(tile) -> int:
    """Rows of a tile: TILE_THREADS threads, QUADS tx / tile_quads(tile) of them across its columns (tile_thread),
    the rest down its rows, tm rows a thread."""
    return TILE_THREADS * tile_quads(tile) // (QUADS * tile[0]) * tile[1]


@functools.cache
def transposed_rows_kernel(tile, kind):
    """matmul_transposed_rows's kernel for a tile of ROWS_TILES and weight kind "bf16x8" or "f32x8":
    out[r, n] = a[r, :] . b[n, :], each output summed by one thread along K in order from zero, so that its bits do
    not depend on the tile: any number of rows gets every row's bits. A block owns tile_rows(tile) rows of a and
    VEC tx rows of b (grid: ceil(N / (VEC tx)), ceil(R / rows)); a thread tm rows x tq quads of rows of b
    (tile_thread). TILE_PIECE columns of K of both are staged at a time in shared memory, the next piece's loads in
    flight while this one's FMAs run: tq + 1 16-byte loads from shared memory for tm x 4 tq FMAs (tm = 4)."""
    (tx, tm), tq = tile[:2], tile_quads(tile)
    width = QUAD * tq  # a thread's rows of b
    load8 = bf16x8 if kind == "bf16x8" else f32x8
    rows, cols = tile_rows(tile), VEC * tx
    pitch, groups = rows + QUAD, TILE_PIECE // VEC  # xs's row (whole quads: 16-byte loads; one quad longer, its
    # stores along K conflict 4-way, not 32); 16-byte groups a piece
    w_loads, x_loads = cols * groups // TILE_THREADS, TILE_PIECE * rows // TILE_THREADS
    step, piece = tile_step_for(tm, tq), residue_steps_for(tm, tq, TILE_PIECE)

    @cuda.jit(device=True)
    def fetch(k0, n0, a, words, N, wbuf, xbuf):
        """This thread's loads of the piece of K from k0 into registers: weights (tid + i TILE_THREADS = n groups +
        j: group j of the piece in row n0 + n of b), activations (= r TILE_PIECE + t: lanes along a row of a);
        zeros past K and past the rows of a and b."""
        tid = cuda.threadIdx.x
        R, K = a.shape[0], a.shape[1]
        for i in range(w_loads):
            n, j = (tid + i * TILE_THREADS) // groups, (tid + i * TILE_THREADS) % groups
            if k0 + VEC * j < K and n0 + n < N:
                w = load8(words, (n0 + n) * (K // VEC) + k0 // VEC + j)
                for c in range(VEC):
                    wbuf[i, c] = w[c]
            else:
                for c in range(VEC):
                    wbuf[i, c] = float32(0)
        for i in range(x_loads):
            t, r = (tid + i * TILE_THREADS) % TILE_PIECE, (tid + i * TILE_THREADS) // TILE_PIECE
            xbuf[i] = a[r, k0 + t] if k0 + t < K and r < R else float32(0)

    def matmul_transposed_rows(a, words, out):
        """out [R, N] = a [R, K] @ b [N, K].T, b seen as its flat uint32 words. Grid (ceil(N / (VEC tx)),
        ceil(R / rows)), TILE_THREADS."""
        ws = cuda.shared.array((TILE_PIECE, QUADS, tx, QUAD), dtype=float32)  # ws[t] (tile_thread): b[n0 + n,
        # k0 + t] of the tile's rows n of b
        xs = cuda.shared.array((TILE_PIECE, pitch), dtype=float32)  # xs[t, r] = a[r, k0 + t]
        acc = cuda.local.array((tm, width), dtype=float32)
        wv = cuda.local.array(width, dtype=float32)
        wbuf = cuda.local.array((w_loads, VEC), dtype=float32)
        xbuf = cuda.local.array(x_loads, dtype=float32)
        R, K, N = a.shape[0], a.shape[1], out.shape[1]
        tid = cuda.threadIdx.x
        quad0, r0 = tile_thread(tid, tx, tm, tq)
        n0, lo = cuda.blockIdx.x * cols, cuda.blockIdx.y * rows
        chunk = a[lo:min(R, lo + rows)]
        for r in range(tm):
            for c in range(width):
                acc[r, c] = float32(0)
        inputs_ready()
        fetch(0, n0, chunk, words, N, wbuf, xbuf)
        for k0 in range(0, K, TILE_PIECE):
            cuda.syncthreads()  # the previous piece is used up
            for i in range(w_loads):
                n, j = (tid + i * TILE_THREADS) // groups, (tid + i * TILE_THREADS) % groups
                for c in range(VEC):  # row n of b is in quad n // 4
                    ws[VEC * j + c, n // (QUAD * tx), n // QUAD % tx, n % QUAD] = wbuf[i, c]
            for i in range(x_loads):
                xs[(tid + i * TILE_THREADS) % TILE_PIECE, (tid + i * TILE_THREADS) // TILE_PIECE] = xbuf[i]
            cuda.syncthreads()
            if k0 + TILE_PIECE < K:  # the next piece's loads, in flight during this piece's FMAs
                fetch(k0 + TILE_PIECE, n0, chunk, words, N, wbuf, xbuf)
            if k0 + TILE_PIECE <= K:  # a whole piece: its steps written out
                piece(ws, xs, 0, quad0, r0, wv, acc)
            else:
                for t in range(K - k0):
                    step(ws, xs, t, quad0, r0, wv, acc)
        for r in range(tm):  # a quad of columns in one 16-byte store where it is whole (out's rows: whole quads)
            if lo + r0 + r < R:
                for h in range(tq):
                    n = n0 + QUAD * (quad0 + h * tx)
                    if n + QUAD <= N and N % QUAD == 0:
                        store_quad(out, (lo + r0 + r, n), acc[r, QUAD * h], acc[r, QUAD * h + 1],
                                   acc[r, QUAD * h + 2], acc[r, QUAD * h + 3])
                    else:
                        for j in range(QUAD):
                            if n + j < N:
                                out[lo + r0 + r, n + j] = acc[r, QUAD * h + j]

    matmul_transposed_rows.__name__ = matmul_transposed_rows.__qualname__ = "matmul_transposed_rows"
    return waits_for_inputs(cuda.jit(**tile_bounds(tile))(matmul_transposed_rows))


@cuda.jit(device=True)
def normed_row(a, gamma, eps, h, scratch):
    """h[k] = a[0, k] / rms(a[0]) * gamma[k] (rms_norm's bits, elementwise.row_rms) for k < K, in shared memory,
    for every thread of the block (all call; scratch: shared float32 [32]): the transposed kernels read the
    normalized row from there, normalized once per block rather than once per output (49,152 outputs of the
    logits, a division each)."""
    rms = row_rms(a, 0, eps, scratch)
    for k in range(cuda.threadIdx.x, a.shape[1], cuda.blockDim.x):
        h[k] = a[0, k] / rms * gamma[k]
    cuda.syncthreads()


def _make_transposed(rows, to_f32, normed):
    @waits_for_inputs
    @cuda.jit
    def matmul_transposed_warps(a, gamma, eps, b, out):
        """out[r, n] = h[r, :] . b[n, :] (b [N, K]), h = a, or (one row, K <= MAX_NORMED_K) RMSNorm(a) * gamma (eps)
        when normed: one warp per row n, lanes along K; block T_THREADS."""
        acc = cuda.local.array(rows, dtype=float32)
        buf = cuda.local.array(UNROLL, dtype=float32)
        h = cuda.shared.array(MAX_NORMED_K if normed else 1, dtype=float32)
        N, K = b.shape[0], b.shape[1]
        lane = cuda.threadIdx.x % 32
        inputs_ready()
        if normed:
            normed_row(a, gamma, eps, h, cuda.shared.array(32, dtype=float32))
        for n in range(cuda.grid(1) // 32, N, cuda.gridsize(1) // 32):  # the same n for the whole warp
            for r in range(rows):
                acc[r] = float32(0)
            k = lane
            while k + (UNROLL - 1) * 32 < K:
                for u in range(UNROLL):
                    buf[u] = to_f32(b[n, k + 32 * u])
                for r in range(rows):
                    for u in range(UNROLL):
                        acc[r] += (h[k + 32 * u] if normed else a[r, k + 32 * u]) * buf[u]
                k += UNROLL * 32
            while k < K:
                w = to_f32(b[n, k])
                for r in range(rows):
                    acc[r] += (h[k] if normed else a[r, k]) * w
                k += 32
            for r in range(rows):
                v = segment_sum(acc[r], 32)
                if lane == 0:
                    out[r, n] = v

    return matmul_transposed_warps


def _make_transposed_vec(rows, load8, normed):
    @cuda.jit(device=True)
    def group_of_row(a_words, h, r, per_row, j):
        """The 8 elements of group j of row r: of the normalized row h in shared memory when normed, else of a."""
        if normed:
            return (h[VEC * j], h[VEC * j + 1], h[VEC * j + 2], h[VEC * j + 3], h[VEC * j + 4], h[VEC * j + 5],
                    h[VEC * j + 6], h[VEC * j + 7])
        return f32x8(a_words, r * per_row + j)

    @waits_for_inputs
    @cuda.jit
    def matmul_transposed_vec(a, gamma, eps, a_words, words, out):
        """out[r, n] = h[r, :] . b[n, :] for a [R, K] float32 and b [N, K] (K % 8 == 0), h = a, or (one row, K <=
        MAX_NORMED_K) RMSNorm(a) * gamma [K] (eps) when normed; a and b also seen as flat uint32 words (a_words,
        words): a team of TEAM lanes per row n (4 rows per warp), lane j of the team reads the groups j, j + TEAM,
        ... of 8 elements; block T_THREADS, grid-stride over rows (warps move together)."""
        acc = cuda.local.array(rows, dtype=float32)
        buf = cuda.local.array((UNROLL, VEC), dtype=float32)
        h = cuda.shared.array(MAX_NORMED_K if normed else 1, dtype=float32)
        N, per_row = out.shape[1], a_words.shape[0] // (rows * VEC)  # per_row = K / 8 groups of a row
        lane, teams = cuda.threadIdx.x % 32, 32 // TEAM
        j0, warp, warps = lane % TEAM, cuda.grid(1) // 32, cuda.gridsize(1) // 32
        inputs_ready()
        if normed:
            normed_row(a, gamma, eps, h, cuda.shared.array(32, dtype=float32))
        for n0 in range(warp * teams, N, warps * teams):  # rows n0 .. n0 + 3 for this warp
            n = n0 + lane // TEAM
            for r in range(rows):
                acc[r] = float32(0)
            if n < N:
                j, row = j0, n * per_row
                while j + (UNROLL - 1) * TEAM < per_row:  # groups j, j + TEAM, ... of row n
                    for u in range(UNROLL):
                        w = load8(words, row + j + u * TEAM)
                        for c in range(VEC):
                            buf[u, c] = w[c]
                    for r in range(rows):
                        for u in range(UNROLL):
                            x = group_of_row(a_words, h, r, per_row, j + u * TEAM)
                            for c in range(VEC):
                                acc[r] += x[c] * buf[u, c]
                    j += UNROLL * TEAM
                while j < per_row:
                    w = load8(words, row + j)
                    for r in range(rows):
                        x = group_of_row(a_words, h, r, per_row, j)
                        for c in range(VEC):
                            acc[r] += x[c] * w[c]
                    j += TEAM
            for r in range(rows):  # every lane of the warp takes part in the shuffles
                v = segment_sum(acc[r], TEAM)  # the team's 8 lanes
                if j0 == 0 and n < N:
                    out[r, n] = v

    return matmul_transposed_vec


@cuda.jit(device=True)
def f32_at(b, k, v, per_row):
    """The weight b[k, v] of float32 weights, as a 1-tuple (one column per lane)."""
    return (b[k, v],)


@cuda.jit(device=True)
def bf16_at(b, k, v, per_row):
    """The weight b[k, v] of bf16 (uint16) weights, widened, as a 1-tuple."""
    return (bf16_weight(b[k, v]),)


@cuda.jit(device=True)
def f32x8_at(words, k, v, per_row):
    """The 8 float32 weights of row k, columns 8 v .. 8 v + 7 (words: the flat uint32 view, per_row = N / 8)."""
    return f32x8(words, k * per_row + v)


@cuda.jit(device=True)
def bf16x8_at(words, k, v, per_row):
    """The 8 bf16 weights of row k, columns 8 v .. 8 v + 7, widened (one 16-byte load)."""
    return bf16x8(words, k * per_row + v)


BIAS_READERS = {"f32": f32_weight, "bf16": bf16_weight}  # bias kind -> its reader (shared with kernels/fused)
SPLIT_K_LOADS = {  # weight kind -> (columns per lane, the loader of a lane's weights of a row, their prefetch)
    "f32": (1, f32_at, no_prefetch), "bf16": (1, bf16_at, no_prefetch),
    "f32x8": (VEC, f32x8_at, prefetch_slice_for(2)), "bf16x8": (VEC, bf16x8_at, prefetch_slice_for(1))}
_TRANSPOSED = {
    "f32": lambda rows, normed: _make_transposed(rows, f32_weight, normed),
    "bf16": lambda rows, normed: _make_transposed(rows, bf16_weight, normed),
    "f32x8": lambda rows, normed: _make_transposed_vec(rows, f32x8, normed),
    "bf16x8": lambda rows, normed: _make_transposed_vec(rows, bf16x8, normed),
}
_KERNELS = {}  # (family, weight kind, rows, bias kind, accumulate, normed, chunked) -> kernel


def kernel_for(family: str, kind: str, rows: int, bias: str = "f32", accumulate: bool = False, normed: bool = False,
               chunked: bool = False, group=None):
    """The kernel of `family` ("split_k" or "transposed") for weight kind "f32", "bf16", "f32x8" or "bf16x8",
    R = rows and (split_k) a bias stored as `bias` ("f32" or "bf16"), adding into its output when `accumulate`,
    normalizing its rows of a when `normed`, a block per chunk of rows when `chunked`, or (split_k, `group` not
    None) the epilogue of the tile launches whose tiles have `group` columns (tile_store_kernel, cached by the only
    arguments it depends on: not the weight kind nor the rows); built and cached on first use."""
    if family == "split_k" and group is not None:
        return tile_store_kernel(group, bias, accumulate)
    key = (family, kind, rows, bias, accumulate, normed, chunked)
    if key not in _KERNELS:
        if family == "split_k":
            _KERNELS[key] = _make_split_k(rows, *SPLIT_K_LOADS[kind], BIAS_READERS[bias], accumulate, normed, chunked)
        else:
            _KERNELS[key] = _TRANSPOSED[kind](rows, normed)
    return _KERNELS[key]


_partial = None  # the split-K kernels' partial sums: overwritten by every launch


def partial_sums(shape):
    """A float32 device array of `shape` for a launch's partial sums [S, rows, N], a view of one buffer kept for
    all split-K launches of the process (grown when too small; one stream at a time, as completion_counters), made once
    per shape: a decode step's 200-odd matmuls allocate nothing and make no new view (either costs more host time
    than the launch)."""
    global _partial
    n = int(np.prod(shape))
    if _partial is None or _partial.size < n:
        _partial = cuda.device_array(max(n, 1 << 20), np.float32)
    return cached_view(_partial, ("partial", shape), lambda p: p[:n].reshape(shape))


@functools.cache
def no_bias():
    """A float32 device array of length 0: the split-K kernel's "no bias" (and its "no norm")."""
    return cuda.to_device(np.zeros(0, np.float32))


def weight_kind(w, vector: bool) -> str:
    """"f32x8" or "bf16x8" when `vector` (16-byte loads possible), else "f32" or "bf16" (float32 or uint16)."""
    pick(WEIGHT_READERS, w)  # TypeError for other dtypes
    kind = "f32" if np.dtype(w.dtype) == np.float32 else "bf16"
    return kind + "x8" if vector else kind


def _transposed_blocks(n: int, per_block: int) -> int:
    """Blocks of a transposed launch over n rows of b, per_block rows per block and pass: at most T_BLOCKS_PER_SM per
    SM (2 in the simulator)."""
    return max(1, min(sized(T_BLOCKS_PER_SM * sm_count(), 2), -(-n // per_block)))


# ---- host wrappers: stream, a CUDA stream; rt, a course_lib.gpu.runtime.Runtime used instead when given ----

def matmul_narrow(a, b, bias=None, out=None, stream=0, rt=None, accumulate: bool = False, norm=None,
                  norm_after=None):
    """a [R, K] float32 @ b [K, N] float32 or bf16 (uint16) (+ bias [N] float32 or bf16) -> out [R, N] float32, for
    any R >= 1 (a batch's rows beyond KERNEL_ROWS in tiles; `linear` sends more than MAX_ROWS rows, a prefill's, to
    the tiled matmul instead): split-K launches (split_k_launches) through the partial sums [S, rows, N] of
    `partial_sums` (see the top). accumulate: out += the product (out required: the residual stream), in the
    reduction that writes it, without an add kernel. norm = (gamma [K] float32, eps): RMSNorm(a) * gamma @ b, the
    norm computed by the matmul's blocks for one row, by rms_norm first for more (NORMED_ROWS; the same bits either
    way). norm_after = (gamma [N] float32, eps, h [R, N]) with accumulate: also h = RMSNorm(out) * gamma, the next
    projection's input, by the epilogue of the rows summed in tiles (add_norm_epilogue: the add and the norm by one
    block per row, the row kept in registers between them), by rms_norm for the others (the same bits)."""
    (R, K), (K2, N) = a.shape, b.shape
    if R < 1:
        raise ValueError(f"matmul_narrow: a has {R} rows")
    if K != K2 or (bias is not None and bias.shape != (N,)):
        raise ValueError(f"matmul_narrow: a is {a.shape}, b is {b.shape}, bias {None if bias is None else bias.shape}")
    if out is not None and out.shape != (R, N):
        raise ValueError(f"matmul_narrow: out is {out.shape}, expected {(R, N)}")
    if accumulate and out is None:
        raise ValueError("matmul_narrow: accumulate adds the product to out: give out")
    if norm_after is not None and not (accumulate and bias is None and norm_after[2].shape == (R, N)):
        raise ValueError("matmul_narrow: norm_after normalizes the residual stream: accumulate, no bias, h [R, N]")
    out = empty((R, N), np.float32, stream, rt) if out is None else out
    gamma, eps = norm_args(None if norm_after is None else norm_after[:2], N)
    h = None if norm_after is None else norm_after[2]
    left = split_k_launches(lambda rows, kind, bias_kind, normed, chunked, group: kernel_for(
                                "split_k", kind, rows, bias_kind, accumulate, normed, chunked, group),
                            a, b, bias, norm, (), (out,), stream, rt, norm_after=(gamma, eps, h))
    for lo, hi in left if h is not None else ():  # the rows no epilogue normalized: one rms_norm per range
        rms_norm(out[lo:hi], gamma, eps, out=h[lo:hi], stream=stream, rt=rt)
    return out


def tile_of(N: int, n: int, slices: int, unit: int = VEC):
    """The tile of TILES for a launch of n rows through N columns in `slices` slices: the first whose rows
    the launch fills and that gives a block per two SMs (else the last it fills, or the smallest), among those whose
    VEC tx columns hold whole units of `unit` columns (an epilogue's: a head for RoPE); None when none does (or unit
    is None: an epilogue that cannot run in tiles)."""
    fit = [t for t in TILES if unit and (VEC * t[0]) % unit == 0]
    filled = [t for t in fit if tile_rows(t) <= n] or fit[-1:]
    return next((t for t in filled if 2 * -(-N // (VEC * t[0])) * slices * -(-n // tile_rows(t)) >= sm_count()),
                filled[-1] if filled else None)


def split_k_launches(kernel_of, a, b, bias, norm, fixed, sliced, stream, rt, width=None, slices_of=None,
                     norm_after=None, unit=VEC):
    """The launches of a split-K kernel on a [R, K] and b [K, N] (one after another on the stream: they share one
    scratch): kernel_of(rows, weight kind, bias kind, normed, chunked, None)[grid, threads](a[part], gamma, eps,
    weights, bias, partial, done, *fixed, *(x[part] for x in sliced)).
    - R <= KERNEL_ROWS: one launch of R rows.
    - More, with 16-byte loads (a batch's rows): launches of up to LAUNCH_ROWS rows, each two launches: the slices'
      sums of tiles of rows and columns (tile_sums_kernel, TILE_THREADS: each weight read once per tile of rows; the
      tile from tile_of, its columns whole units of `unit`), then the epilogue, a block per tile of columns and
      EPILOGUE_ROWS rows: kernel_of(rows, weight kind, bias kind, False, False, group)[grid, EPILOGUE_THREADS](
      partial, bias, *fixed, *(x[part] for x in sliced)), group the tile's columns; with norm_after,
      add_norm_epilogue instead, a block per row.
    - More, one element per load (or slices longer than TILE_SLICE, no tile of whole units, or an output the tile
      epilogues cannot store 16 bytes at a time: not C-contiguous, unaligned): launches of up to
      LAUNCH_ROWS rows, a multiple of KERNEL_ROWS, a block per chunk of KERNEL_ROWS rows (grid (groups, S, chunks),
      chunked), then one launch of the rows left.
    Every row gets the bits it gets alone. A norm is computed by the kernel for at most NORMED_ROWS rows, else by
    rms_norm first (into the buffer "normed_rows"; the same bits). width: 1 or VEC columns per lane, or None for
    VEC when N % VEC == 0 and b is 16-byte aligned. slices_of: the column count whose split_k sets the slices (N by
    default; a fused kernel takes the slices of a matmul it replaces, and so its sums). norm_after = (gamma, eps, h)
    with h not None: the rows summed in tiles get add_norm_epilogue instead of kernel_of's epilogue (a residual
    projection: sliced is (x,)).
    See matmul_narrow for bias and norm. -> the (lo, hi) row ranges that were not normalized (all of them without
    norm_after), adjacent ranges joined."""
    (R, K), N = a.shape, b.shape[1]
    if width is None:
        width = VEC if N % VEC == 0 and aligned16(b) else 1
    kind = weight_kind(b, vector=width == VEC)
    bias_kind = "f32" if bias is None else weight_kind(bias, vector=False)
    groups, slices = -(-N // (32 * width)), split_k(K, slices_of or N, 32 * width, sm_count())
    tiles = (width == VEC and -(-K // slices) <= TILE_SLICE  # a residue in a piece
             and tile_of(N, LAUNCH_ROWS, slices, unit) is not None
             and all(aligned16(x) and x.shape[1] % QUAD == 0 for x in sliced  # the epilogues' 16-byte stores
                     if x.ndim == 2 and np.dtype(x.dtype) == np.float32))
    residue = uniform_residue(K, slices)
    parts, lo = [], 0  # launches of at most LAUNCH_ROWS rows (a multiple of KERNEL_ROWS without tiles), then the rest
    while R - lo > KERNEL_ROWS:
        n = min(R - lo, LAUNCH_ROWS)
        parts.append((lo, lo + (n if tiles else n - n % KERNEL_ROWS)))
        lo = parts[-1][1]
    if lo < R:
        parts.append((lo, R))
    plan = [(lo, hi, tile_of(N, hi - lo, slices, unit) if tiles and hi - lo > KERNEL_ROWS else None)
            for lo, hi in parts]
    most = max(hi - lo for lo, hi in parts)
    chunks = -(-most // KERNEL_ROWS)
    shape = (slices, most, N)
    partial, done = ((partial_sums(shape), completion_counters(groups * chunks)) if rt is None
                     else rt.split_k_scratch(shape, groups * chunks))
    weights, bias = words(b) if width == VEC else b, no_bias() if bias is None else bias
    if norm is not None and R > NORMED_ROWS:  # rms_norm first: the same bits, and no spilled registers
        a = rms_norm(a, *norm_args(norm, K), out=empty(a.shape, np.float32, stream, rt, name="normed_rows"),
                     stream=stream, rt=rt)
        norm = None
    gamma, eps = norm_args(norm, K)
    left = []
    for lo, hi, tile in plan:
        a_rows, rest = (a, sliced) if (lo, hi) == (0, R) else (a[lo:hi], tuple(x[lo:hi] for x in sliced))
        n, args = hi - lo, (a_rows, gamma, eps, weights, bias, partial, done, *fixed, *rest)
        normalizes = tile is not None and norm_after is not None and norm_after[2] is not None
        if not normalizes and left and left[-1][1] == lo:  # adjacent ranges joined
            left[-1] = (left[-1][0], hi)
        elif not normalizes:
            left.append((lo, hi))
        if n <= KERNEL_ROWS:
            launch(kernel_of(n, kind, bias_kind, norm is not None, False, None), (groups, slices, 1), THREADS,
                   stream, rt, *args)
        elif tile is not None:  # the slices' sums in tiles, then the epilogue: two launches
            gx = -(-N // (VEC * tile[0]))
            launch(tile_sums_kernel(tile, kind, residue), (gx, slices, -(-n // tile_rows(tile))), TILE_THREADS,
                   stream, rt, a_rows, weights, partial[:, :n])
            if normalizes:  # the residual added and the next norm in one launch, a block per row
                after_gamma, after_eps, h = norm_after
                launch(add_norm_kernel(-(-N // NORM_THREADS)), n, NORM_THREADS, stream, rt, partial[:, :n], rest[0],
                       after_gamma, after_eps, h[lo:hi])
            else:
                launch(kernel_of(n, kind, bias_kind, False, False, VEC * tile[0]), (gx, 1, -(-n // EPILOGUE_ROWS)),
                       EPILOGUE_THREADS, stream, rt, partial[:, :n], bias, *fixed, *rest)
        else:
            launch(kernel_of(KERNEL_ROWS, kind, bias_kind, norm is not None, True, None),
                   (groups, slices, n // KERNEL_ROWS), THREADS, stream, rt, *args)
    return left


def norm_args(norm, K: int):
    """(gamma, eps) of a split-K launch: the norm's (gamma [K] float32, float32 eps), or no_bias() and 0 for none."""
    if norm is None:
        return no_bias(), np.float32(0)
    gamma, eps = norm
    if gamma.shape != (K,) or np.dtype(gamma.dtype) != np.float32:
        raise ValueError(f"matmul_narrow: the norm's weights are {gamma.shape} {gamma.dtype}, expected ({K},) float32")
    return gamma, np.float32(eps)


def linear(a, b, bias=None, out=None, stream=0, rt=None):
    """a [M, K] float32 @ b [K, N] (+ bias [N]) -> out [M, N] float32: matmul_narrow for M <= MAX_ROWS, else
    the tiled matmul then add_bias."""
    if a.shape[0] <= MAX_ROWS:
        return matmul_narrow(a, b, bias, out, stream, rt)
    out = mm.matmul(a, b, out, stream, rt)
    return out if bias is None else mm.add_bias(out, bias, stream, rt)


def matmul_transposed(a, b, out=None, stream=0, rt=None, norm=None):
    """a [R, K] float32 @ b [N, K].T, b float32 or bf16 (uint16), read in place -> out [R, N] float32,
    for 1 <= R <= MAX_ROWS (the tied-embedding logits: b is the embedding table). norm = (gamma [K] float32, eps):
    RMSNorm(a) * gamma @ b.T for one row a of K <= MAX_NORMED_K (a decode step), the norm computed by the kernel's
    blocks (the same bits as rms_norm then this)."""
    (R, K), (N, K2) = a.shape, b.shape
    if not 1 <= R <= MAX_ROWS:
        raise ValueError(f"matmul_transposed: a has {R} rows, expected 1 to {MAX_ROWS}")
    if K != K2:
        raise ValueError(f"matmul_transposed: a is {a.shape}, b is {b.shape} (expected [N, {K}])")
    if out is not None and out.shape != (R, N):
        raise ValueError(f"matmul_transposed: out is {out.shape}, expected {(R, N)}")
    if norm is not None and (R > 1 or K > MAX_NORMED_K):
        raise ValueError(f"matmul_transposed: a norm inside the kernel takes one row of at most {MAX_NORMED_K}, "
                         f"not {R} of {K} (use rms_norm first)")
    gamma, eps = norm_args(norm, K)
    vector = K % VEC == 0 and aligned16(b) and aligned16(a)
    kind = weight_kind(b, vector=vector)
    kernel = kernel_for("transposed", kind, R, normed=norm is not None)
    out = empty((R, N), np.float32, stream, rt) if out is None else out
    if vector:
        launch(kernel, _transposed_blocks(N, T_WARPS * 32 // TEAM), T_THREADS, stream, rt, a, gamma, eps, words(a),
               words(b), out)
    else:
        launch(kernel, _transposed_blocks(N, T_WARPS), T_THREADS, stream, rt, a, gamma, eps, b, out)
    return out


def matmul_transposed_rows(a, b, out=None, stream=0, rt=None):
    """a [R, K] float32 @ b [N, K].T, b float32 or bf16 (uint16) read in place with 16-byte loads (K % 8 == 0) ->
    out [R, N] float32, for any R (a batch's logits: b is the embedding table), by transposed_rows_kernel: each
    output summed by one thread along K in order, so a row gets the same bits whatever R; the tile the largest of
    ROWS_TILES whose rows the batch fills."""
    (R, K), (N, K2) = a.shape, b.shape
    if K != K2 or K % VEC or not (aligned16(a) and aligned16(b)):
        raise ValueError(f"matmul_transposed_rows: a is {a.shape}, b is {b.shape}: expected [N, {K}], K a multiple of "
                         f"{VEC}, both C-contiguous and 16-byte aligned")
    if out is not None and out.shape != (R, N):
        raise ValueError(f"matmul_transposed_rows: out is {out.shape}, expected {(R, N)}")
    tile = next((t for t in ROWS_TILES if R >= tile_rows(t)), ROWS_TILES[-1])
    out = empty((R, N), np.float32, stream, rt) if out is None else out
    launch(transposed_rows_kernel(tile, weight_kind(b, vector=True)), (-(-N // (VEC * tile[0])),
                                                                       -(-R // tile_rows(tile))),
           TILE_THREADS, stream, rt, a, words(b), out)
    return out
