"""Attention over a paged KV cache (course_lib.kv_cache): writing new rows, and flash-decoding attention.

The cache of a layer is a key table and a value table [rows, Hkv, hd] (float32, or bf16 bits in uint16); a
sequence's logical key j lives at row page_table[j // page_size] * page_size + j % page_size.

`write_rows`: one thread per element, table[slots[t], h, d] = new[t, h, d] (rounded to bf16, ties to even, for a
uint16 table: `f32_to_bf16_bits`, the device twin of safetensors_io.f32_to_bf16).

`flash_attention` (flash decoding: split the keys, then merge), two kernels:
1. `flash_decode_chunks`, grid (chunks, Hkv, T), THREADS threads: a block takes one chunk of the keys of query t
   for KV head kvh and ALL the G = H / Hkv query heads that share it, so each key and value is read once for
   the group. Tile by tile (kt = min(TILE_KEYS, TILE_FLOATS // hd) keys): the tile's rows are looked up in the
   page table; every thread loads its LOADS elements of the keys and of the values into registers (unrolled:
   all loads in flight at once; consecutive threads read consecutive floats of a row: coalesced), and the next
   tile's loads are issued before this tile's arithmetic, which they overlap. In shared memory the key rows are
   padded to hd + split floats, so the threads of a warp, on different keys, read different banks. The G x kt
   scores: `split` threads per score (when the block has threads to spare), each a strided part of the dot
   product in four running sums, added by shuffles. Online softmax: `seg` threads per head take the tile's
   maximum m_tile, turn the scores into p = exp(score - m) with m = max(m, m_tile), and update the running sum
   l = l exp(m_old - m) + sum p. Then thread (g, d) updates its accumulator acc = acc exp(m_old - m) +
   sum_j p_j v[j, d] (shared memory, one owner each). The block writes its unnormalized o [hd], m and l per
   head to scratch [T, H, chunks, hd] and [T, H, chunks].
2. `merge_chunks`, grid (H, T): out[t, h] = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M = max_c m_c, in a
   fixed order (no atomics: the same bits from run to run).

Chunks: a query that sees n keys gets chunks of `chunk_len(n, ...)` keys (a multiple of page_size, at least
MIN_CHUNK), so that the chunks of the longest queries times Hkv give about BLOCKS_PER_SM blocks per SM. The length
depends only on n, Hkv, page_size and the GPU (never on T), and so does the merge, which counts the query's own
chunks from positions[t]: a query gives the same bits alone (decode) and inside a long prefill. The grid's x is
the largest count of the pass (from max_len, known on the host); blocks past their query's count return at once.
When every query of the pass has one chunk, kernel 1 normalizes and writes out itself (no merge launch): the same
bits as the merge, which then computes (1 o) / (1 l).

Measured on the H200 (decode, T = 1, pages of 16, GPU time per call, KV bytes read / time): at 4096 keys
SmolLM2-135M shapes (H 9, Hkv 3, hd 64) 42 us (149 GB/s f32), Llama-3.2-1B shapes (32, 8, 64) 75 us (223 GB/s);
at 16384 keys 237 and 277 GB/s. Far from the ~3.5 TB/s the memory allows: the kernel is bound by instruction
latency (numba's 64-bit signed index arithmetic, 128 registers: two blocks per SM), not by memory.
"""

import math

import numpy as np
from numba import float32, int32, uint16, uint32
from numba.cuda.misc.special import literal_unroll

from course_lib.kernels import SIMULATOR, cuda, empty, f32_weight, for_weight_dtypes, launch, pick, sized, sm_count
from course_lib.kernels.elementwise import segment_max, segment_sum

MAX_HEAD_DIM = 256
MAX_GROUP = 8  # query heads per KV head (H / Hkv)
THREADS = sized(256, 32)  # threads of a flash_decode_chunks block; a multiple of 32
TILE_FLOATS = sized(2048, 256)  # floats of keys (and of values) per tile in shared memory; >= MAX_HEAD_DIM
TILE_KEYS = sized(32, 16)  # keys per tile at most
K_FLOATS = TILE_FLOATS + 8 * TILE_KEYS  # shared keys of a tile, rows padded to hd + split (<= 8)
GROUP_FLOATS = MAX_GROUP * MAX_HEAD_DIM  # shared queries, and accumulators, of a group
P_FLOATS = MAX_GROUP * TILE_KEYS  # shared scores of a tile
LOADS = TILE_FLOATS // THREADS  # elements of a tile each thread loads (keys, and as many values)
LOAD_STEPS = tuple(range(LOADS))  # (literal_unroll: the loops over them are unrolled, k_reg and v_reg registers)
BLOCKS_PER_SM_MIN = 2  # launch bounds of flash_decode_chunks: registers for this many resident blocks per SM
_CHUNK_BOUNDS = {} if SIMULATOR else {"launch_bounds": (THREADS, BLOCKS_PER_SM_MIN)}
MIN_CHUNK = sized(64, 16)  # no chunk shorter (then rounded up to a multiple of page_size)
BLOCKS_PER_SM = sized(4, 2)  # the chunk count aims at this many blocks per SM
SIM_SMS = 2  # "SMs" of the simulator here (small: few blocks)
MAX_CHUNKS = 1024  # chunks per query at most
MERGE_THREADS = sized(256, 32)
MERGE_UNROLL = 8  # partial outputs each merge thread loads at once
WRITE_THREADS = sized(256, 64)


# ---- how the keys are split into chunks (the same integer arithmetic on the host and on the device) ----

def chunk_len(n_keys, target, min_chunk, page_size):
    """Keys per chunk for a query that sees n_keys keys: n_keys / target rounded up to a multiple of page_size,
    at least min_chunk (a multiple of page_size). Then ceil(n_keys / chunk_len) <= target chunks."""
    unit = target * page_size
    return max(min_chunk, (n_keys + unit - 1) // unit * page_size)


_chunk_len = cuda.jit(device=True)(chunk_len)


def chunk_target(n_kv_heads: int, sms: int | None = None) -> int:
    """Chunks per query that give BLOCKS_PER_SM blocks per SM with n_kv_heads blocks per chunk."""
    sms = sm_count(SIM_SMS) if sms is None else sms
    return max(1, min(MAX_CHUNKS, -(-BLOCKS_PER_SM * sms // n_kv_heads)))


def min_chunk(page_size: int) -> int:
    """The shortest chunk: MIN_CHUNK rounded up to a multiple of page_size."""
    return -(-MIN_CHUNK // page_size) * page_size


def chunks_for(n_keys: int, n_kv_heads: int, page_size: int, sms: int | None = None) -> tuple[int, int]:
    """(chunk length, number of chunks) of a query that sees n_keys keys (n_keys = position + 1)."""
    length = chunk_len(n_keys, chunk_target(n_kv_heads, sms), min_chunk(page_size), page_size)
    return length, -(-n_keys // length)


def tile_keys(head_dim: int) -> int:
    """Keys per shared-memory tile of flash_decode_chunks."""
    return min(TILE_KEYS, TILE_FLOATS // head_dim)


# ---- writing rows ----

@cuda.jit(device=True)
def f32_to_bf16_bits(x):
    """float32 -> the bits of the nearest bf16 (ties to even; any NaN -> 0x7FC0), as safetensors_io.f32_to_bf16:
    add 0x7FFF plus the lowest kept bit, keep the top 16 bits (no overflow: a finite or infinite input stays
    below 2^32)."""
    bits = uint32(cuda.libdevice.float_as_int(x))
    if (bits & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16(0x7FC0)
    return uint16((bits + uint32(0x7FFF) + ((bits >> uint32(16)) & uint32(1))) >> uint32(16))


def _make_write_rows(from_f32):
    @cuda.jit
    def write_rows_flat(new, table, slots):
        """table[slots[t], h, d] = new[t, h, d] (stored by from_f32); a slot < 0 is skipped. new [T, Hkv, hd],
        table [rows, Hkv, hd], slots [T] int32; one thread per element of new."""
        i = cuda.grid(1)
        heads, hd = new.shape[1], new.shape[2]
        if i < new.shape[0] * heads * hd:
            t, r = i // (heads * hd), i % (heads * hd)
            h, d = r // hd, r % hd
            s = slots[t]
            if s >= 0:
                table[s, h, d] = from_f32(new[t, h, d])

    return write_rows_flat


_WRITE_ROWS = {np.dtype(np.float32): _make_write_rows(f32_weight),
               np.dtype(np.uint16): _make_write_rows(f32_to_bf16_bits)}


def write_rows(new, table, slots, stream=0, rt=None):
    """new [T, Hkv, hd] float32 -> table[slots[t]] for each t (table [rows, Hkv, hd] float32, or uint16 bf16 bits:
    rounded to nearest even). slots [T] int32 on the device, each < rows (unchecked) or < 0 to skip. Returns
    table."""
    if new.shape[1:] != table.shape[1:] or slots.shape != new.shape[:1]:
        raise ValueError(f"write_rows: new {new.shape}, table {table.shape}, slots {slots.shape}")
    kernel = pick(_WRITE_ROWS, table)
    n = new.shape[0] * new.shape[1] * new.shape[2]
    launch(kernel, max(1, -(-n // WRITE_THREADS)), WRITE_THREADS, stream, rt, new, table, slots)
    return table


# ---- flash decoding ----

@cuda.jit(device=True)
def partial_dot(a, a0, b, b0, first, step, n):
    """sum of a[a0 + d] * b[b0 + d] over d = first, first + step, ... < n, in four interleaved running sums
    (four independent chains of multiply-adds in flight instead of one)."""
    s0 = float32(0)
    s1 = float32(0)
    s2 = float32(0)
    s3 = float32(0)
    d = first
    while d + 3 * step < n:
        s0 += a[a0 + d] * b[b0 + d]
        s1 += a[a0 + d + step] * b[b0 + d + step]
        s2 += a[a0 + d + 2 * step] * b[b0 + d + 2 * step]
        s3 += a[a0 + d + 3 * step] * b[b0 + d + 3 * step]
        d += 4 * step
    while d < n:
        s0 += a[a0 + d] * b[b0 + d]
        d += step
    return (s0 + s1) + (s2 + s3)


@cuda.jit(device=True)
def weighted_sum(p, p0, v, d, hd, n):
    """sum_j p[p0 + j] * v[j hd + d] over j < n, in four interleaved running sums."""
    s0 = float32(0)
    s1 = float32(0)
    s2 = float32(0)
    s3 = float32(0)
    j = 0
    while j + 3 < n:
        s0 += p[p0 + j] * v[j * hd + d]
        s1 += p[p0 + j + 1] * v[(j + 1) * hd + d]
        s2 += p[p0 + j + 2] * v[(j + 2) * hd + d]
        s3 += p[p0 + j + 3] * v[(j + 3) * hd + d]
        j += 4
    while j < n:
        s0 += p[p0 + j] * v[j * hd + d]
        j += 1
    return (s0 + s1) + (s2 + s3)


def _make_chunks(to_f32):
    @cuda.jit(device=True)
    def load_tile(k, v, rows, col0, n_elems, hd, k_reg, v_reg):
        """Thread tid loads the elements i = tid + e THREADS < n_elems of the tile (key j = i // hd, component
        d = i % hd, both advanced without division) into k_reg[e], v_reg[e]: unrolled, so the loads are all issued
        before any is used, and the registers are registers."""
        tid = cuda.threadIdx.x
        j = tid // hd
        d = tid - j * hd
        step_j = THREADS // hd
        step_d = THREADS - step_j * hd
        for e in literal_unroll(LOAD_STEPS):
            if tid + e * THREADS < n_elems:
                row = rows[j]
                k_reg[e] = to_f32(k[row, col0 + d])
                v_reg[e] = to_f32(v[row, col0 + d])
            j += step_j
            d += step_d
            if d >= hd:
                d -= hd
                j += 1

    @cuda.jit(**_CHUNK_BOUNDS)
    def flash_decode_chunks(q, k, v, page_table, positions, page_size, target, min_chunk, scale, normalize,
                            out, o_part, m_part, l_part):
        """Chunk c of the keys 0..positions[t] of query t, KV head kvh, for its G query heads h0 .. h0 + G - 1.

        q [T, H, hd] float32; k, v [rows, Hkv * hd] (the tables' 2-D views, stored as to_f32 reads); page_table
        [P] int32; positions [T] int32. Writes o_part [T, H, C, hd] (sum_j p_j v_j, unnormalized), m_part, l_part
        [T, H, C] (running max and sum of p = exp(score - m)); with normalize, out [T, H, hd] = o / l instead.
        Grid (C, Hkv, T), block THREADS; a block whose chunk starts past its query's keys returns at once. The
        loads of tile i + 1 are issued before the softmax and the value sums of tile i (they arrive meanwhile).
        """
        k_s = cuda.shared.array(K_FLOATS, dtype=float32)  # keys of the tile [kt, hd + split]
        v_s = cuda.shared.array(TILE_FLOATS, dtype=float32)  # values of the tile [kt, hd]
        q_s = cuda.shared.array(GROUP_FLOATS, dtype=float32)  # queries of the group [G, hd]
        acc_s = cuda.shared.array(GROUP_FLOATS, dtype=float32)  # sum_j p_j v_j [G, hd], one owner thread each
        p_s = cuda.shared.array(P_FLOATS, dtype=float32)  # scores, then p [G, kt]
        rows = cuda.shared.array(TILE_KEYS, dtype=int32)  # table row of each key of the next tile to load
        m_s = cuda.shared.array(MAX_GROUP, dtype=float32)
        l_s = cuda.shared.array(MAX_GROUP, dtype=float32)
        alpha_s = cuda.shared.array(MAX_GROUP, dtype=float32)
        k_reg = cuda.local.array(LOADS, dtype=float32)
        v_reg = cuda.local.array(LOADS, dtype=float32)
        c, kvh, t, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, cuda.threadIdx.x
        n = positions[t] + 1
        length = _chunk_len(n, target, min_chunk, page_size)
        lo = c * length
        if lo >= n:
            return
        hi = min(lo + length, n)
        hd = q.shape[2]
        group = q.shape[1] * hd // k.shape[1]
        h0 = kvh * group
        col0 = kvh * hd
        kt = min(TILE_KEYS, TILE_FLOATS // hd)
        split = 1  # threads per score (each sums every split-th product): a power of two <= 8
        while split < 8 and group * kt * split * 2 <= THREADS:
            split *= 2
        part = tid % split
        ks = hd + split  # padded key row: the threads of a warp read different banks
        seg = 32  # threads per head in the softmax: a power of two <= 32, group * seg <= THREADS, seg < 2 kt
        while group * seg > THREADS or seg >= 2 * kt:
            seg //= 2
        sg, sl = tid // seg, tid % seg
        for i in range(tid, group * hd, THREADS):
            q_s[i] = q[t, h0 + i // hd, i % hd]
            acc_s[i] = float32(0)
        if tid < group:
            m_s[tid] = float32(-math.inf)
            l_s[tid] = float32(0)
        if tid < min(kt, hi - lo):
            rows[tid] = page_table[(lo + tid) // page_size] * page_size + (lo + tid) % page_size
        cuda.syncthreads()
        load_tile(k, v, rows, col0, min(kt, hi - lo) * hd, hd, k_reg, v_reg)
        step_j = THREADS // hd  # i -> i + THREADS moves (i // hd, i % hd) by (step_j, step_d), carry included
        step_d = THREADS - step_j * hd

        for k0 in range(lo, hi, kt):
            nt = min(kt, hi - k0)
            j, d = tid // hd, tid % hd
            for e in literal_unroll(LOAD_STEPS):  # the tile (loaded into registers) to shared memory
                if tid + e * THREADS < nt * hd:
                    k_s[j * ks + d] = k_reg[e]
                    v_s[j * hd + d] = v_reg[e]
                j += step_j
                d += step_d
                if d >= hd:
                    d -= hd
                    j += 1
            cuda.syncthreads()
            k1 = k0 + kt  # the next tile: its rows
            if tid < min(kt, hi - k1):
                rows[tid] = page_table[(k1 + tid) // page_size] * page_size + (k1 + tid) % page_size

            for i0 in range(0, group * kt, THREADS // split):  # score of (head g, key j), i = g kt + j
                i = i0 + tid // split
                g = i // kt
                j = i - g * kt
                dot = float32(0)
                if g < group and j < nt:
                    dot = partial_dot(q_s, g * hd, k_s, j * ks, part, split, hd)
                dot = segment_sum(dot, split)
                if part == 0 and g < group and j < nt:
                    p_s[i] = dot * scale
            cuda.syncthreads()
            if k1 < hi:  # the next tile's loads, in flight during the rest of this tile
                load_tile(k, v, rows, col0, min(kt, hi - k1) * hd, hd, k_reg, v_reg)

            # online softmax: head sg by the threads sg seg .. sg seg + seg - 1 (all heads at once)
            tile_max = float32(-math.inf)
            if sg < group:
                for j in range(sl, nt, seg):
                    tile_max = max(tile_max, p_s[sg * kt + j])
            tile_max = segment_max(tile_max, seg)
            p_sum = float32(0)
            m_old = float32(-math.inf)
            m_new = float32(-math.inf)
            if sg < group:
                m_old = m_s[sg]
                m_new = max(m_old, tile_max)
                for j in range(sl, nt, seg):
                    p = float32(math.exp(p_s[sg * kt + j] - m_new))
                    p_s[sg * kt + j] = p
                    p_sum += p
            p_sum = segment_sum(p_sum, seg)
            if sg < group and sl == 0:
                alpha = float32(math.exp(m_old - m_new))
                alpha_s[sg] = alpha
                l_s[sg] = l_s[sg] * alpha + p_sum
                m_s[sg] = m_new
            cuda.syncthreads()

            for i in range(tid, group * hd, THREADS):  # acc of (head g, component d), i = g hd + d
                g = i // hd
                d = i - g * hd
                acc_s[i] = acc_s[i] * alpha_s[g] + weighted_sum(p_s, g * kt, v_s, d, hd, nt)
            cuda.syncthreads()

        for i in range(tid, group * hd, THREADS):
            g = i // hd
            d = i - g * hd
            if normalize:
                out[t, h0 + g, d] = acc_s[i] / l_s[g]
            else:
                o_part[t, h0 + g, c, d] = acc_s[i]
        if not normalize and tid < group:
            m_part[t, h0 + tid, c] = m_s[tid]
            l_part[t, h0 + tid, c] = l_s[tid]

    return flash_decode_chunks

_CHUNKS = for_weight_dtypes(_make_chunks)


@cuda.jit
def merge_chunks(o_part, m_part, l_part, positions, page_size, target, min_chunk, out):
    """out[t, h] = sum_c w_c o_part[t, h, c] / sum_c w_c l_part[t, h, c], w_c = exp(m_part[t, h, c] - M), M the
    largest m, over the query's own chunks c < ceil(n / chunk_len(n)), n = positions[t] + 1.

    o_part [T, H, C, hd], m_part, l_part [T, H, C], out [T, H, hd], float32. Grid (H, T), block MERGE_THREADS.
    Every warp computes M and the denominator itself (lanes over chunks, then shuffles: no barrier); thread
    (cg, dl) sums w_c o_c[d0 + dl] over the chunks c = cg, cg + groups, ... (MERGE_UNROLL loads at a time), and
    the groups' sums meet in shared memory, added in group order. A fixed order throughout.
    """
    sums = cuda.shared.array(MERGE_THREADS, dtype=float32)
    o_vals = cuda.local.array(MERGE_UNROLL, dtype=float32)
    m_vals = cuda.local.array(MERGE_UNROLL, dtype=float32)
    h, t, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    lane = tid % 32
    n = positions[t] + 1
    length = _chunk_len(n, target, min_chunk, page_size)
    n_chunks = (n + length - 1) // length
    hd = out.shape[2]

    m_max = float32(-math.inf)
    for c in range(lane, n_chunks, 32):
        m_max = max(m_max, m_part[t, h, c])
    m_max = segment_max(m_max, 32)
    den = float32(0)
    for c in range(lane, n_chunks, 32):
        den += float32(math.exp(m_part[t, h, c] - m_max)) * l_part[t, h, c]
    den = segment_sum(den, 32)

    span = min(hd, MERGE_THREADS)
    groups = MERGE_THREADS // span
    cg = tid // span
    dl = tid - cg * span
    for d0 in range(0, hd, span):
        d = d0 + dl
        part = float32(0)
        if cg < groups and d < hd:
            for c0 in range(cg, n_chunks, groups * MERGE_UNROLL):
                for u in range(MERGE_UNROLL):
                    c = c0 + u * groups
                    if c < n_chunks:
                        o_vals[u] = o_part[t, h, c, d]
                        m_vals[u] = m_part[t, h, c]
                for u in range(MERGE_UNROLL):
                    c = c0 + u * groups
                    if c < n_chunks:
                        part += float32(math.exp(m_vals[u] - m_max)) * o_vals[u]
        sums[tid] = part
        cuda.syncthreads()
        if tid < span and d0 + tid < hd:
            total = float32(0)
            for g in range(groups):
                total += sums[g * span + tid]
            out[t, h, d0 + tid] = total / den
        cuda.syncthreads()


def flash_attention(q, k_table, v_table, page_table, positions, page_size, max_len=None, out=None, stream=0,
                    rt=None):
    """Causal GQA attention of one sequence through its page table.

    q [T, H, hd] float32; k_table, v_table [rows, Hkv, hd] float32 or uint16 (bf16 bits), same dtype; page_table
    [P] int32 (the sequence's pages, logical order); positions [T] int32: query t sees logical keys
    0..positions[t], key j at row page_table[j // page_size] * page_size + j % page_size (each positions[t] <
    P * page_size, unchecked). max_len: an upper bound of max(positions) + 1 on the host (it sizes the grid; a
    larger one costs idle blocks, never changes the result); None reads positions back from the device (a sync).
    H a multiple of Hkv, H / Hkv <= MAX_GROUP, hd <= MAX_HEAD_DIM. -> out [T, H, hd] float32.
    """
    T, H, hd = q.shape
    Hkv = k_table.shape[1]
    if (H % Hkv or H // Hkv > MAX_GROUP or hd > MAX_HEAD_DIM or k_table.shape[2] != hd or v_table.shape != k_table.shape
            or v_table.dtype != k_table.dtype or positions.shape != (T,)):
        raise ValueError(f"flash_attention: q {q.shape}, k_table {k_table.shape} {k_table.dtype}, v_table "
                         f"{v_table.shape} {v_table.dtype}, positions {positions.shape} (H / Hkv <= {MAX_GROUP}, "
                         f"hd <= {MAX_HEAD_DIM})")
    out = empty((T, H, hd), np.float32, stream, rt) if out is None else out
    if T == 0:
        return out
    if max_len is None:
        max_len = int(positions.copy_to_host().max()) + 1
    if max_len > page_table.shape[0] * page_size:
        raise ValueError(f"flash_attention: max_len {max_len} > {page_table.shape[0]} pages x {page_size}")
    target, shortest = chunk_target(Hkv), min_chunk(page_size)
    n_chunks = max(1, min(target, -(-max_len // shortest)))  # the most chunks any query of the pass has
    scale = np.float32(1.0 / np.sqrt(hd))
    kernel = pick(_CHUNKS, k_table)
    common = (page_table, positions, page_size, target, shortest, scale)
    k2, v2 = k_table.reshape(k_table.shape[0], Hkv * hd), v_table.reshape(v_table.shape[0], Hkv * hd)
    if n_chunks == 1:  # one chunk per query: normalize in place, no merge (o_part, m_part, l_part unused)
        launch(kernel, (1, Hkv, T), THREADS, stream, rt, q, k2, v2, *common, 1, out,
               out.reshape(T, H, 1, hd), out, out)
        return out
    o_part = empty((T, H, n_chunks, hd), np.float32, stream, rt)
    m_part = empty((T, H, n_chunks), np.float32, stream, rt)
    l_part = empty((T, H, n_chunks), np.float32, stream, rt)
    launch(kernel, (n_chunks, Hkv, T), THREADS, stream, rt, q, k2, v2, *common, 0, out, o_part, m_part,
           l_part)
    launch(merge_chunks, (H, T), MERGE_THREADS, stream, rt, o_part, m_part, l_part, positions, page_size, target,
           shortest, out)
    return out
