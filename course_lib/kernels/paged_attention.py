"""Attention over a paged KV cache (course_lib.gpu.kv_cache): writing new rows, and flash-decoding attention.

The cache of a layer is a key table and a value table [rows, Hkv, hd] (float32, or bf16 bits in uint16); a
sequence's logical key j lives at row page_table[j // page_size] * page_size + j % page_size.

`write_rows`: one thread per element, table[slots[t], h, d] = new[t, h, d] (rounded to bf16, ties to even, for a
uint16 table: `f32_to_bf16_bits`, the device twin of safetensors_io.f32_to_bf16).

`flash_attention` (flash decoding: split the keys, then merge), two kernels, or one:
1. `flash_decode_chunks`, grid (chunks, H / heads, T), WARPS warps: a block takes one chunk of the keys of query t
   for `heads` of the G = H / Hkv query heads that share a KV head: all G, so that each key and value is read once
   for the group (a batch's rows, BATCH_HEADS), or one (a sequence's queries, SEQUENCE_HEADS: G times the blocks,
   each key read G times, from the L2 cache after the first: faster at every context length measured). A head's
   arithmetic never depends on the other heads of its block: the same bits either way. A key row (hd elements) is
   read by a team of `team_size(hd)` lanes, each taking 8 adjacent elements per 16-byte load (bf16; two loads for
   float32): hd 64 gives 8 lanes per key, 4 keys per warp. A step: every lane issues all the key and value loads of
   `unroll` keys of its team (Chunks), then the page-table loads of the next step's rows (they arrive while this
   step computes: a lookup never delays a step's loads), then computes its part of its heads' dot products (each
   lane holds its own components of the queries), which the team adds by shuffles; each team keeps its own online
   softmax (running max m, sum l = sum exp(score - m), and the lane's components of acc = sum p v) in registers. No
   barrier in the loop over keys. At the end the teams of a warp merge by shuffles and the warps through shared
   memory (m = max, l and acc rescaled by exp(m_part - m), in a fixed order). A query with a single chunk is
   normalized and written to out; otherwise the block writes its o [hd], m and l per head to scratch [T, H, chunks,
   hd] and [T, H, chunks]. Launched programmatically, a block looks up its first step's rows and asks the L2 cache
   for their keys and values before waiting for the kernel before it, so that they come from memory while the QKV
   projection ends. A prefetch, not a load: ptxas moved the loads issued there past the wait (seen in the kernels'
   SASS), and a prefetched line is never stale, since the L2 cache is where the projection's writes of the pass's
   own keys land.
2. `merge_chunks`, grid (H, T): out[t, h] = sum_c exp(m_c - M) o_c / sum_c exp(m_c - M) l_c, M = max_c m_c, in a
   fixed order (no atomics: the same bits from run to run). A thread per component (h, d) loads o, m and l of
   MERGE_UNROLL chunks at once and merges them online (one memory latency per round, not one per quantity).
   Skipped (not launched) when no query has two chunks.
Or `flash_decode`, one launch (notebook 05): the chunk blocks of 1., then the last of a query's blocks for a group
of heads to finish (a completion counter, kernels.last_to_arrive) merges those heads at once with merge_chunks' own
device function, `merge_heads` (a thread per component: the same bits as the merge kernel). `flash_decode_rows` does
the same for the rows of several sequences (a batched decode step), each row reading its keys through its own
sequence's page table (grid (H / heads, T, chunks): every row's first chunk starts before any second one). The
kernels are thin wrappers around the device functions `chunk_block` and `merge_heads` of
(virtual block index, buffers); `chunk_block_for` builds chunk_block for a block of any number of warps and with the
caller's wait (the megakernel's attention instructions: its counters instead of griddepcontrol).

Chunks: a query that sees n keys gets chunks of `chunk_len(n, ...)` keys, a whole number of a block's steps
(`chunk_unit`), one chunk up to ONE_CHUNK_KEYS keys, and past that as many as make the chunks of the longest queries
fill the GPU once: at most BLOCKS_PER_SM blocks per SM,
counting a block per query head and chunk for one sequence (SEQUENCE_CHUNKS), per KV head and chunk for a batch. The
length depends only on n, the heads, hd and the GPU (never on T), and so does the merge, which counts the query's
own chunks from positions[t]: a query gives the same bits alone (decode) and inside a long prefill. The grid's chunk
dimension (x; z for flash_decode_rows) is the largest count of the pass (from max_len, known on the host); blocks
past their query's count return at once. A batched generator's passes all take BATCH_CHUNKS instead
(flash_attention's `chunks`): longer chunks, its many rows filling the GPU without more of them (each chunk past the
first costs a merge), and fewer keys per step.

Why these choices (the measurements behind them: notebook 04 and data/h200_kernel_notes.md): small layers are bound
by fixed costs, not by bandwidth, so each kernel keeps many loads in flight and avoids chains of memory latencies.
"""

import functools
import math
from typing import NamedTuple

import numpy as np
from numba import float32, int32, uint16, uint32

from course_lib.kernels import (
    SIMULATOR,
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
from course_lib.kernels.elementwise import FULL_MASK, segment_sum
from course_lib.kernels.overlap import inputs_ready, launched_inputs, prefetch_l2, waits_for_inputs
from course_lib.kernels.vector import aligned16, bf16x8, f32x8, words

MAX_HEAD_DIM = 256
MAX_GROUP = 8  # query heads per KV head (H / Hkv)
MAX_GROUP_DIMS = 1024  # G x hd at most: the warps' partial outputs (WARPS x G x hd floats) fill shared memory
WARPS = sized(8, 1)  # warps of a flash_decode_chunks block (the fastest of 2, 4 and 8)
THREADS = 32 * WARPS


class Chunks(NamedTuple):
    """How flash-decoding walks a query's keys: a block step reads `unroll` keys per team of lanes (2 unroll 16-byte
    groups of bf16 in flight per lane, 4 unroll of float32), and a chunk is a whole number of `steps` block steps.
    The chunk count aims at one wave of BLOCKS_PER_SM blocks per SM, counting a block per query head and chunk
    (per_query_head: one sequence, a block per query head, SEQUENCE_HEADS) or per KV head and chunk. A query's bits
    depend on all three (which team adds which key, in which order, and where the chunks split): every pass over a
    cache takes the same."""

    unroll: int
    steps: int
    per_query_head: bool


SEQUENCE_CHUNKS = Chunks(unroll=4, steps=1, per_query_head=True)  # one sequence: as many short chunks as fill the GPU
# once (counting a chunk's blocks per KV head, as before, made two or more waves of short chunks from ~4k keys, and
# was slower: notebook 04)
BATCH_CHUNKS = Chunks(unroll=2, steps=4, per_query_head=False)  # a batched step (op chunks="batch"): its many rows
# already fill the GPU, and every chunk past the first costs a merge; two keys a step hold fewer registers per lane.
# Against four keys and two steps (the same 256 keys a chunk): level while a row has one chunk, faster from two
# (notebook 07)
SEQUENCE_HEADS = 1  # query heads per block of one sequence's flash-decoding (0: all G of its KV head): a block per
# query head, G times the blocks (a short context's few blocks set its pace, not the G reads of K and V from L2)
BATCH_HEADS = 0  # the same for a batch's rows, which fill the GPU without that: a block per KV head (faster there)
BLOCKS_PER_SM = 2  # the chunk count aims at this many blocks per SM (the fastest of 2, 3 and 4 at 4k)
ONE_CHUNK_KEYS = sized(256, 0)  # a query that sees at most this many keys reads them in one chunk: at hd 64 (SmolLM2,
# Llama-3.2-1B) two steps of a block, which cost less than the counter and the merge that a second chunk brings; four
# steps (512 keys) cost more (notebook 04). At hd 128 a step holds half the keys: 256 keys are four steps there, not
# measured. A batch's chunks (BATCH_CHUNKS) already hold 256 keys at hd 64; at hd 128 they hold 128, and 129 to 256
# keys now take one chunk of eight steps instead of two of four, not measured. 0 in the simulator: the rule is off
# there, so that its few keys still make several chunks to merge
_CHUNK_BOUNDS = {} if SIMULATOR else {"launch_bounds": (THREADS, BLOCKS_PER_SM)}
SIM_SMS = 6  # "SMs" of the simulator here (few blocks, yet a sequence of the tiny model's 4 query heads gets 3 chunks)
MAX_CHUNKS = 1024  # chunks per query at most
MERGE_THREADS = sized(256, 32)  # threads of a merge_chunks block at most (a thread per component of a head)
MERGE_UNROLL = 8  # chunks each merge thread loads at once (their o, m and l): 16 made a longer kernel, slower at 1k
# keys and no faster at 4k (data/h200_kernel_notes.md)
WRITE_THREADS = sized(256, 64)


# ---- how the keys are split into chunks (the same integer arithmetic on the host and on the device) ----

def chunk_len(n_keys, target, unit):
    """Keys per chunk for a query that sees n_keys keys: n_keys / target rounded up to a multiple of `unit` (the
    keys a block reads per step), at least one unit. Then ceil(n_keys / chunk_len) <= target chunks. Up to
    ONE_CHUNK_KEYS keys, n_keys rounded up to a multiple of `unit`: one chunk."""
    if n_keys <= ONE_CHUNK_KEYS:
        return (n_keys + unit - 1) // unit * unit
    return max(1, (n_keys + target * unit - 1) // (target * unit)) * unit


_chunk_len = cuda.jit(device=True)(chunk_len)


def chunk_target(n_heads: int, n_kv_heads: int, chunks: Chunks, sms: int | None = None) -> int:
    """Chunks per query that give at most BLOCKS_PER_SM blocks per SM (at least one chunk), a chunk taking n_heads
    blocks when chunks.per_query_head, else n_kv_heads."""
    sms = sm_count(SIM_SMS) if sms is None else sms
    blocks = n_heads if chunks.per_query_head else n_kv_heads
    return max(1, min(MAX_CHUNKS, BLOCKS_PER_SM * sms // blocks))  # one wave at most


def chunks_for(n_keys: int, n_heads: int, n_kv_heads: int, head_dim: int, sms: int | None = None,
               chunks: Chunks = SEQUENCE_CHUNKS) -> tuple[int, int]:
    """(chunk length, number of chunks) of a query that sees n_keys keys (n_keys = position + 1), chunks of whole
    groups of chunks.steps block steps (chunk_unit), at most chunk_target of them."""
    length = chunk_len(n_keys, chunk_target(n_heads, n_kv_heads, chunks, sms), chunk_unit(head_dim, chunks))
    return length, -(-n_keys // length)


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

def team_size(head_dim: int) -> int:
    """Lanes per key row of head_dim elements, read in groups of 8 (16 bytes of bf16, 32 of float32): the largest
    power of two <= 32 that divides head_dim / 8 (hd 64: 8 lanes, four keys per warp; hd 128: 16)."""
    groups = head_dim // 8
    return min(32, groups & -groups)


def tile_keys(head_dim: int, unroll: int = SEQUENCE_CHUNKS.unroll) -> int:
    """Keys a flash_decode_chunks block reads per step: `unroll` keys for each team of each warp."""
    return WARPS * (32 // team_size(head_dim)) * unroll


def chunk_unit(head_dim: int, chunks: Chunks = SEQUENCE_CHUNKS) -> int:
    """Chunk lengths are multiples of this: chunks.steps steps of a block (a short context gets one chunk, no
    merge). SEQUENCE_CHUNKS for one sequence; BATCH_CHUNKS for a batch's rows, which fill the GPU without more
    chunks."""
    return chunks.steps * tile_keys(head_dim, chunks.unroll)


@functools.cache
def chunk_block_for(load8, group, head_dim, page_size, heads, unroll, warps=WARPS, wait=launched_inputs):
    """The device function chunk_block (below) for G = group query heads per KV head, `heads` of them per block (a
    divisor of G), head_dim (a multiple of 8), page_size and `unroll` keys per team and step (Chunks), a block of
    `warps` warps, compile-time constants: a lane's scores and accumulators stay in registers, and the page
    arithmetic is shifts for a power of two; load8(words, i) reads the 8 elements of group i of a table seen as uint32
    words (f32x8: two 16-byte loads; bf16x8: one). wait(ready): how the block waits for its inputs once its first
    keys are asked of the L2 cache (a launched kernel: for the kernel before it; the megakernel: its counters)."""
    team = team_size(head_dim)
    per_lane = head_dim // (8 * team)  # 8-element groups of a row per lane
    E = 8 * per_lane  # elements of a row per lane
    teams = warps * (32 // team)  # keys a block reads at once, one per team
    step = teams * unroll
    per_load = 2 if load8 is f32x8 else 1  # 16-byte words per group of 8 elements

    @cuda.jit(device=True)
    def find_rows(page_table, first, hi, rows):
        """rows[u] = the table row of key min(first + u teams, hi - 1) (the lane's team's keys of a step; a key
        past the chunk reads the chunk's last key again, which `attend` ignores), for u < unroll: the unroll
        page-table loads issued one after another, none waited for."""
        for u in range(unroll):
            j = min(first + u * teams, hi - 1)
            rows[u] = page_table[j // page_size] * page_size + j % page_size

    @cuda.jit(device=True)
    def group_at(row, n_kv, kvh, i):
        """The index, in groups of 8 elements of the table, of this lane's i-th group of KV head kvh at table row
        `row` (i < per_lane; the lanes of a team take a row's groups in turn)."""
        return (row * n_kv + kvh) * (head_dim // 8) + cuda.threadIdx.x % team + team * i

    @cuda.jit(device=True)
    def load_key(k_words, v_words, n_kv, kvh, row, k_r, v_r, u):
        """k_r[u], v_r[u] = this lane's E elements of the key and value at table row `row`: loads issued, none
        waited for."""
        for i in range(per_lane):
            kw = load8(k_words, group_at(row, n_kv, kvh, i))
            vw = load8(v_words, group_at(row, n_kv, kvh, i))
            for e in range(8):
                k_r[u, 8 * i + e] = kw[e]
                v_r[u, 8 * i + e] = vw[e]

    @cuda.jit(device=True)
    def prefetch_keys(k_words, v_words, n_kv, kvh, rows):
        """Ask the L2 cache for the lines of this lane's groups of the keys and values at rows[u], u < unroll (a
        group of 8 elements lies in one 128-byte line); nothing is read into registers."""
        for u in range(unroll):
            for i in range(per_lane):
                prefetch_l2(k_words, per_load * group_at(rows[u], n_kv, kvh, i))
                prefetch_l2(v_words, per_load * group_at(rows[u], n_kv, kvh, i))

    @cuda.jit(device=True)
    def load_keys(k_words, v_words, n_kv, kvh, rows, k_r, v_r):
        """load_key for the rows[u], u < unroll: all the loads issued, none waited for."""
        for u in range(unroll):
            load_key(k_words, v_words, n_kv, kvh, rows[u], k_r, v_r, u)

    @cuda.jit(device=True)
    def attend(q_r, first, hi, scale, k_r, v_r, s, m, l, acc):  # noqa: E741 (the l of the online softmax)
        """The online softmax over keys first + u teams < hi (k_r, v_r loaded; q_r the lane's components of the
        queries, as load_key's of a key), for each head g of the block: scores s (the team's lanes add their parts by
        shuffles), m_new = max(m, s), l and acc rescaled by exp(m - m_new), then p = exp(s - m_new) added to l and
        p v to acc. Keys past hi score -inf and change nothing."""
        for g in range(heads):
            for u in range(unroll):
                s[u, g] = float32(0)
            for i in range(per_lane):
                for e in range(8):
                    qv = q_r[g, 8 * i + e]
                    for u in range(unroll):
                        s[u, g] += qv * k_r[u, 8 * i + e]
        for u in range(unroll):
            for g in range(heads):
                dot = segment_sum(s[u, g], team)
                s[u, g] = dot * scale if first + u * teams < hi else float32(-math.inf)
        for g in range(heads):
            m_new = m[g]
            for u in range(unroll):
                m_new = max(m_new, s[u, g])
            if m_new > float32(-math.inf):  # this team has seen a key (else nothing to update)
                alpha = float32(math.exp(m[g] - m_new))
                l[g] *= alpha
                for e in range(E):
                    acc[g, e] *= alpha
                for u in range(unroll):
                    if first + u * teams < hi:
                        p = float32(math.exp(s[u, g] - m_new))
                        l[g] += p
                        for e in range(E):
                            acc[g, e] += p * v_r[u, e]
                m[g] = m_new

    @cuda.jit(device=True)
    def chunk_block(c, j, t, q, k_words, v_words, page_table, positions, target, unit, scale, out, o_part, m_part,
                    l_part, ready):
        """Chunk c of the keys 0..positions[t] of query t for the query heads h0 = j heads .. h0 + heads - 1, which
        share KV head kvh = h0 // G (j: the block's group of heads). A query head's arithmetic depends on nothing but
        its own query, keys and values: it gets the same bits in a block of one head and in a block of G.

        Launched programmatically (kernels/overlap.py), the block looks up the rows of its first step and asks the
        L2 cache for their keys and values *before* waiting for its inputs (the positions and the page table were
        written by earlier passes); after the wait it loads them, and the queries.

        q [T, H, hd] float32; k_words, v_words: the tables [rows, Hkv, hd] seen as flat uint32 words; page_table
        [P] int32; positions [T] int32. A query with one chunk is normalized and written to out [T, H, hd]
        float32 at once; otherwise the block writes o_part [T, H, C, hd] (sum_j p_j v_j, unnormalized), m_part and
        l_part [T, H, C] (max of the scores, sum of p = exp(score - m)), for the merge. Returns the query's number
        of chunks, or 0 at once when chunk c starts past its keys. A block of `warps` warps.
        """
        m_w = cuda.shared.array((warps, heads), dtype=float32)
        l_w = cuda.shared.array((warps, heads), dtype=float32)
        acc_w = cuda.shared.array((warps, heads, head_dim), dtype=float32)
        q_r = cuda.local.array((heads, E), dtype=float32)  # this lane's components of the queries
        acc = cuda.local.array((heads, E), dtype=float32)  # sum_j p_j v_j, this lane's components
        m = cuda.local.array(heads, dtype=float32)
        l = cuda.local.array(heads, dtype=float32)  # noqa: E741
        s = cuda.local.array((unroll, heads), dtype=float32)
        k_r = cuda.local.array((unroll, E), dtype=float32)  # this lane's part of unroll keys and values
        v_r = cuda.local.array((unroll, E), dtype=float32)
        rows = cuda.local.array(unroll, dtype=int32)  # their rows in the tables
        tid = cuda.threadIdx.x  # (c, j, t): the block's virtual index, given by the caller
        n = positions[t] + 1
        length = _chunk_len(n, target, unit)
        lo = c * length
        if lo >= n:
            return 0
        hi = min(lo + length, n)
        n_kv = q.shape[1] // group
        lane, warp = tid % 32, tid // 32
        member = lane % team  # this lane reads the 8-element groups member, member + team, ... of a row
        me = warp * (32 // team) + lane // team  # this lane's team in the block
        h0 = j * heads
        kvh = h0 // group
        find_rows(page_table, lo + me, hi, rows)  # the first step's keys, fetched during the kernel before
        prefetch_keys(k_words, v_words, n_kv, kvh, rows)
        wait(ready)
        load_keys(k_words, v_words, n_kv, kvh, rows, k_r, v_r)  # in flight while the queries load
        for g in range(heads):  # each lane its own components: no barrier before the loop
            for i in range(per_lane):
                for e in range(8):
                    q_r[g, 8 * i + e] = q[t, h0 + g, 8 * (member + team * i) + e]
            for e in range(E):
                acc[g, e] = float32(0)
            m[g] = float32(-math.inf)
            l[g] = float32(0)

        for k0 in range(lo, hi, step):  # the same steps for every lane (the shuffles need the whole warp)
            if k0 > lo:
                load_keys(k_words, v_words, n_kv, kvh, rows, k_r, v_r)
            find_rows(page_table, k0 + step + me, hi, rows)  # the next step's rows arrive while this one computes
            attend(q_r, k0 + me, hi, scale, k_r, v_r, s, m, l, acc)

        width = team  # the teams of a warp merge by shuffles, then the warps in shared memory: a fixed order
        while width < 32:
            for g in range(heads):
                m_o = cuda.shfl_xor_sync(FULL_MASK, m[g], width)
                l_o = cuda.shfl_xor_sync(FULL_MASK, l[g], width)
                m_new = max(m[g], m_o)
                a = float32(0) if m[g] == float32(-math.inf) else float32(math.exp(m[g] - m_new))
                b = float32(0) if m_o == float32(-math.inf) else float32(math.exp(m_o - m_new))
                for e in range(E):
                    acc[g, e] = a * acc[g, e] + b * cuda.shfl_xor_sync(FULL_MASK, acc[g, e], width)
                l[g] = a * l[g] + b * l_o
                m[g] = m_new
            width *= 2
        if lane < team:
            for g in range(heads):
                if lane == 0:
                    m_w[warp, g] = m[g]
                    l_w[warp, g] = l[g]
                for i in range(per_lane):
                    for e in range(8):
                        acc_w[warp, g, 8 * (member + team * i) + e] = acc[g, 8 * i + e]
        cuda.syncthreads()
        count = (n + length - 1) // length  # the query's chunks
        for x in range(tid, heads * head_dim, 32 * warps):
            g, d = x // head_dim, x % head_dim
            m_all = m_w[0, g]
            for w in range(1, warps):
                m_all = max(m_all, m_w[w, g])
            l_all = float32(0)
            o = float32(0)
            for w in range(warps):
                if m_w[w, g] > float32(-math.inf):
                    f = float32(math.exp(m_w[w, g] - m_all))
                    l_all += f * l_w[w, g]
                    o += f * acc_w[w, g, d]
            if count == 1:
                out[t, h0 + g, d] = o / l_all
            else:
                o_part[t, h0 + g, c, d] = o
                if d == 0:
                    m_part[t, h0 + g, c] = m_all
                    l_part[t, h0 + g, c] = l_all
        return count

    return chunk_block


def _make_chunks(load8, group, head_dim, page_size, heads, unroll):
    """flash_decode_chunks, flash_decode and flash_decode_rows around chunk_block_for's body (blocks of WARPS warps,
    waiting for the kernel before)."""
    chunk_block = chunk_block_for(load8, group, head_dim, page_size, heads, unroll)

    @waits_for_inputs
    @cuda.jit(**_CHUNK_BOUNDS)
    def flash_decode_chunks(q, k_words, v_words, page_table, positions, target, unit, scale, out, o_part, m_part,
                            l_part):
        """chunk_block (c, j, t) = blockIdx (x, y, z) (the rows of one sequence); merge_chunks merges the queries
        with several chunks. Grid (C, H / heads, T), block THREADS."""
        chunk_block(cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, q, k_words, v_words, page_table, positions,
                    target, unit, scale, out, o_part, m_part, l_part, 0)

    @cuda.jit(device=True)
    def chunk_then_merge(c, j, t, q, k_words, v_words, page_table, positions, target, unit, scale, out, o_part,
                         m_part, l_part, counters):
        """chunk_block, then the last of a query's chunk blocks for the heads j to finish (counters[t H / heads + j],
        last_to_arrive) merges those heads at once (merge_heads)."""
        count = chunk_block(c, j, t, q, k_words, v_words, page_table, positions, target, unit, scale, out, o_part,
                            m_part, l_part, 0)
        if count > 1 and last_to_arrive(counters, t * (q.shape[1] // heads) + j, count):
            merge_heads(o_part, m_part, l_part, t, j * heads, heads, count, out)

    @waits_for_inputs
    @cuda.jit(**_CHUNK_BOUNDS)
    def flash_decode(q, k_words, v_words, page_table, positions, target, unit, scale, out, o_part, m_part, l_part,
                     counters):
        """Attention in one launch: chunk_then_merge for (c, j, t) = blockIdx. Grid (C, H / heads, T), block
        THREADS."""
        chunk_then_merge(cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, q, k_words, v_words, page_table,
                         positions, target, unit, scale, out, o_part, m_part, l_part, counters)

    @waits_for_inputs
    @cuda.jit(**_CHUNK_BOUNDS)
    def flash_decode_rows(q, k_words, v_words, page_tables, seq_of_row, positions, target, unit, scale, out, o_part,
                          m_part, l_part, counters):
        """flash_decode for rows of several sequences (a batched decode step): row t reads its keys through the
        page table of its sequence, page_tables[seq_of_row[t]] ([S, P] int32). Grid (H / heads, T, C), block
        THREADS: the chunk is the slowest index, so that the blocks start in chunk order, every row's first chunk
        before any second one: a launch of more blocks than the GPU holds at once leaves its short last chunks to
        the second wave, not half of the rows' whole first chunks."""
        t = cuda.blockIdx.y
        chunk_then_merge(cuda.blockIdx.z, cuda.blockIdx.x, t, q, k_words, v_words, page_tables[seq_of_row[t]],
                         positions, target, unit, scale, out, o_part, m_part, l_part, counters)

    return flash_decode_chunks, flash_decode, flash_decode_rows


@cuda.jit(device=True)
def merge_heads(o_part, m_part, l_part, t, h0, heads, n_chunks, out):
    """out[t, h] = sum_c w_c o_part[t, h, c] / sum_c w_c l_part[t, h, c], w_c = exp(m_part[t, h, c] - M), M the
    largest m, over the chunks c < n_chunks of query t (n_chunks > 1), for the heads h0 .. h0 + heads - 1.

    o_part [T, H, C, hd], m_part, l_part [T, H, C], out [T, H, hd], float32. Each thread of the block merges
    components (h, d) of its own, tid, tid + blockDim, ..., over the chunks in order, MERGE_UNROLL at a time: their
    o, m and l loaded at once (one memory latency a round, none waiting on another), then folded into a running
    max m and the sums of exp(m_c - m) o_c and exp(m_c - m) l_c (rescaled by exp(m_old - m_new) when a round raises
    m). A component's arithmetic depends on nothing but its chunks: one head merged alone or a group of heads
    together give the same bits, and no thread waits for another (no shared memory, no barrier).
    """
    o_vals = cuda.local.array(MERGE_UNROLL, dtype=float32)
    m_vals = cuda.local.array(MERGE_UNROLL, dtype=float32)
    l_vals = cuda.local.array(MERGE_UNROLL, dtype=float32)
    hd = out.shape[2]
    for x in range(cuda.threadIdx.x, heads * hd, cuda.blockDim.x):
        h, d = h0 + x // hd, x % hd
        m, o, l = float32(-math.inf), float32(0), float32(0)  # noqa: E741
        for c0 in range(0, n_chunks, MERGE_UNROLL):
            for u in range(MERGE_UNROLL):  # past the last chunk: the last chunk again, with m = -inf (weight 0)
                c = min(c0 + u, n_chunks - 1)
                o_vals[u] = o_part[t, h, c, d]
                l_vals[u] = l_part[t, h, c]
                m_vals[u] = m_part[t, h, c] if c0 + u < n_chunks else float32(-math.inf)
            m_new = m
            for u in range(MERGE_UNROLL):
                m_new = max(m_new, m_vals[u])
            a = float32(math.exp(m - m_new))  # m_new is finite: chunk c0 holds keys
            o *= a
            l *= a  # noqa: E741
            for u in range(MERGE_UNROLL):
                w = float32(math.exp(m_vals[u] - m_new))
                o += w * o_vals[u]
                l += w * l_vals[u]  # noqa: E741
            m = m_new
        out[t, h, d] = o / l


@waits_for_inputs
@cuda.jit
def merge_chunks(o_part, m_part, l_part, positions, target, unit, out):
    """merge_heads for head h = blockIdx.x of query t = blockIdx.y, over the query's own chunks c < ceil(n /
    chunk_len(n)), n = positions[t] + 1 (a query with one chunk is left alone: flash_decode_chunks wrote it).
    Grid (H, T), a block of hd threads or more."""
    inputs_ready()
    t = cuda.blockIdx.y
    n = positions[t] + 1
    length = _chunk_len(n, target, unit)
    n_chunks = (n + length - 1) // length
    if n_chunks > 1:
        merge_heads(o_part, m_part, l_part, t, cuda.blockIdx.x, 1, n_chunks, out)


_CHUNKS = {}  # (dtype, group, head_dim, page_size, heads, unroll) -> (flash_decode_chunks, flash_decode,
# flash_decode_rows)


def _chunks_kernels(dtype, group, head_dim, page_size, heads, unroll):
    """(flash_decode_chunks, flash_decode, flash_decode_rows) for tables of `dtype` (float32, or uint16 holding
    bf16), `heads` query heads per block and `unroll` keys per team and step, built on first use."""
    key = (np.dtype(dtype), group, head_dim, page_size, heads, unroll)
    if key not in _CHUNKS:
        loads = {np.dtype(np.float32): f32x8, np.dtype(np.uint16): bf16x8}
        if key[0] not in loads:
            raise TypeError(f"KV tables must be float32 or bf16 stored as uint16, got {dtype}")
        _CHUNKS[key] = _make_chunks(loads[key[0]], group, head_dim, page_size, heads, unroll)
    return _CHUNKS[key]


def flash_attention(q, k_table, v_table, page_table, positions, page_size, max_len=None, out=None, stream=0,
                    rt=None, one_launch: bool = False, seq_of_row=None, chunks: Chunks = SEQUENCE_CHUNKS,
                    heads: int | None = None):
    """Causal GQA attention of one sequence through its page table: flash_decode_chunks, then merge_chunks; or,
    one_launch, flash_decode (the chunks merged by the last block of each query and group of heads to finish). With
    seq_of_row [T] int32, the rows belong to several sequences: page_table is [S, P], one row per sequence, row t
    reads its keys through page_table[seq_of_row[t]] (flash_decode_rows, always one launch; the same bits as each
    sequence's rows alone). Launched programmatically (a step plan with overlapping launches) the kernels look up
    their first rows in the page table before waiting for the kernel before them: it must not write the table.

    q [T, H, hd] float32; k_table, v_table [rows, Hkv, hd] float32 or uint16 (bf16 bits), same dtype, 16-byte
    aligned; page_table [P] int32 (the sequence's pages, logical order); positions [T] int32: query t sees logical
    keys 0..positions[t], key j at row page_table[j // page_size] * page_size + j % page_size (each positions[t] <
    P * page_size, unchecked). max_len: an upper bound of max(positions) + 1 on the host (it sizes the grid; a
    larger one costs idle blocks, never changes the result); None reads positions back from the device (a sync).
    chunks: the keys of a block step, the steps of a chunk and the blocks the chunk count fills the GPU with
    (Chunks); a query's bits depend on them, so every pass over a cache takes the same. heads: query heads per
    block, a divisor of G (None: SEQUENCE_HEADS for one sequence's queries, BATCH_HEADS for a batch's rows; 0 there:
    G, every head of a KV head); the bits do not depend on it.
    H a multiple of Hkv, G = H / Hkv <= MAX_GROUP, hd a multiple of 8 and <= MAX_HEAD_DIM, G hd <= MAX_GROUP_DIMS.
    -> out [T, H, hd] float32 (the same bits either way).
    """
    T, H, hd = q.shape
    Hkv = k_table.shape[1]
    if (H % Hkv or H // Hkv > MAX_GROUP or hd % 8 or hd > MAX_HEAD_DIM or H // Hkv * hd > MAX_GROUP_DIMS
            or k_table.shape[2] != hd or v_table.shape != k_table.shape or v_table.dtype != k_table.dtype
            or positions.shape != (T,)):
        raise ValueError(f"flash_attention: q {q.shape}, k_table {k_table.shape} {k_table.dtype}, v_table "
                         f"{v_table.shape} {v_table.dtype}, positions {positions.shape} (H / Hkv <= {MAX_GROUP}, "
                         f"hd a multiple of 8, <= {MAX_HEAD_DIM}, H / Hkv x hd <= {MAX_GROUP_DIMS})")
    if not (aligned16(k_table) and aligned16(v_table)):
        raise ValueError("flash_attention: the key and value tables must be C-contiguous and 16-byte aligned")
    G = H // Hkv
    if heads is None:
        heads = (SEQUENCE_HEADS if seq_of_row is None else BATCH_HEADS) or G
    if heads < 1 or G % heads:
        raise ValueError(f"flash_attention: {heads} query heads per block do not divide the {G} of a KV head")
    chunks_kernel, one_kernel, rows_kernel = _chunks_kernels(k_table.dtype, G, hd, page_size, heads, chunks.unroll)
    if (seq_of_row is None) != (page_table.ndim == 1) or (seq_of_row is not None and seq_of_row.shape != (T,)):
        raise ValueError(f"flash_attention: a page table [P] for one sequence, or [S, P] with seq_of_row [T]; got "
                         f"{page_table.shape} and {None if seq_of_row is None else seq_of_row.shape}")
    out = empty((T, H, hd), np.float32, stream, rt) if out is None else out
    if T == 0:
        return out
    if max_len is None:
        max_len = int(positions.copy_to_host().max()) + 1
    pages = page_table.shape[page_table.ndim - 1]  # (the simulator's shapes take no negative index)
    if max_len > pages * page_size:
        raise ValueError(f"flash_attention: max_len {max_len} > {pages} pages x {page_size}")
    target, unit = chunk_target(H, Hkv, chunks), chunk_unit(hd, chunks)
    n_chunks = max(1, min(target, -(-max_len // unit)))  # at least the chunks of any query of the pass
    common = (q, words(k_table), words(v_table), page_table, positions, target, unit, np.float32(1.0 / np.sqrt(hd)),
              out)
    if n_chunks == 1 and seq_of_row is None:  # each query normalizes its one chunk: no partial results, no merge
        launch(chunks_kernel, (1, H // heads, T), THREADS, stream, rt, *common, out.reshape(T, H, 1, hd), out, out)
        return out
    parts = (empty((T, H, n_chunks, hd), np.float32, stream, rt), empty((T, H, n_chunks), np.float32, stream, rt),
             empty((T, H, n_chunks), np.float32, stream, rt))
    if seq_of_row is not None or one_launch:
        counters = completion_counters(T * H // heads) if rt is None else rt.counters(T * H // heads)
        if seq_of_row is not None:
            launch(rows_kernel, (H // heads, T, n_chunks), THREADS, stream, rt, q, common[1], common[2], page_table,
                   seq_of_row, *common[4:], *parts, counters)
        else:
            launch(one_kernel, (n_chunks, H // heads, T), THREADS, stream, rt, *common, *parts, counters)
    else:
        launch(chunks_kernel, (n_chunks, H // heads, T), THREADS, stream, rt, *common, *parts)
        launch(merge_chunks, (H, T), min(MERGE_THREADS, -(-hd // 32) * 32), stream, rt, *parts, positions, target,
               unit, out)
    return out
