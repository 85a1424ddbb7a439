"""The persistent megakernel: one launch runs whole decode steps by interpreting the instruction list of `program`.

The grid is one block per SM (THREADS threads, the sampler's block). Block b runs queue b of the schedule, in
order, once per step (its instructions read into shared memory once per launch). The dependencies are counted:
instructions come in groups (a layer's instructions of one op; a query head's qkv; a KV head's key and value), each
group has a counter, and an instruction waits for whole groups (`schedule.counter_tables`):

    wait   a thread per group waited for reads its counter (an atomic: from the L2 cache, never a stale L1 line),
           pausing POLL_NS between reads, until it reaches size x epoch; then an acquire fence and a block barrier
           (the block sees what the other blocks wrote before they counted their instructions)
    run    the instruction's operation, by every thread of the block (the `op_*` device functions)
    mark   a block barrier, then thread 0 fences (release: the block's writes before the count) and adds 1 to its
           group's counter (kernels.gpu_fence: acquire and release, not the sequentially consistent threadfence)

Epochs make the counters reusable without clearing them: step t of a launch is epoch epoch0 + t + 1, and after E
steps a counter holds size x E. The first instruction of a step (embed) also waits for the previous step's last
(sample): everything of step t is an ancestor of its sample, so step t + 1 starts after all of step t. A launch
runs `steps` steps: the prompt is fed through `feed` (feed[t] >= 0: the token of step t; its logits are then not
computed), then each step embeds the token the previous one chose. No block waits for an instruction that comes
later in (step, program order), so the blocks cannot deadlock as long as they all run at once (one per SM). In
the simulator the blocks run one after another: the kernel runs there with one block, whose queue is the program.

The grid-barrier version (`barriers` > 0, the number of phases of `program.phases`) ignores the dependency lists: a
block passes every grid barrier between the phases before an instruction's (thread 0 adds 1 to the barrier counter,
the last of `counters`, then waits until every block has), and the barriers left at the end of a step. An
instruction then waits for the whole phase before it, and every block, busy or not, for every barrier: what the
counters save is measured against it.

Every matmul instruction starts by loading what depends on no other instruction (its first weights, its norm's
weights, its bias and RoPE angles) before it waits: they arrive while the block waits, and what is left once the
inputs are ready is a short chain: the activation row into shared memory, the FMAs, the reduction. A team of lanes
reads 16 contiguous bytes each of a bf16 row, the block's teams take rows k, k + teams, ..., and the teams' sums are
added in a fixed order: the same bits whichever block runs the instruction and whatever the other blocks do.
An instruction of several passes (the logits' 384 columns) issues the next pass's loads before the current pass's
reduction.
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np
from numba import float32, int32

from ..kernels import SIMULATOR, cuda, gpu_fence
from ..kernels.elementwise import FULL_MASK, NORM_THREADS, block_max, block_sum, segment_sum, silu_times
from ..kernels.sampling import THREADS, choose
from ..kernels.vector import bf16x8, f32x8
from .schedule import OPCODES

EMBED, QKV, ATTENTION, O_PROJ, GATE_UP, DOWN, LOGITS, SAMPLE = (
    OPCODES[op] for op in ("embed", "qkv", "attention", "o_proj", "gate_up", "down", "logits", "sample"))
HEAD_TEAM = 8  # lanes per weight row in a qkv instruction: 64 columns a pass, a whole head of up to 64
PASS_COLS = 8 * HEAD_TEAM
ROPE_PAIRS = PASS_COLS // 2  # a head's rotated pairs at most (hd <= PASS_COLS)
SLICE_TEAM = 2  # lanes per weight row in the other matmul instructions: slices of 16 columns, so that a layer's
# matmuls are cut in enough instructions to keep every SM reading
SLICE_COLS = 8 * SLICE_TEAM
UNROLL = 4  # weight loads in flight per thread (beyond the fetched rows; 8 spilled more registers, no faster)
PREFETCH = 1  # rows of a thread's share of a slice loaded before the instruction waits. More would hold more of the
# slice in registers, but 512 threads leave 128 registers each: the rows spill to local memory, and a spilled load
# must land before the block starts waiting (data/h200_kernel_notes.md: 1 row beat 4 and 9 on the H200)
MAX_K = 8192  # the longest activation row a matmul instruction reads (Llama-3.2-1B's d_ff): 32 KB of shared memory
MAX_QUEUE = 256  # instructions of one block's queue at most (read into shared memory once)
POLL_NS = 32  # a waiting thread's pause between two reads of a counter: fewer atomics crowding the L2 cache
ROW_LOADS = 4  # activations loaded per thread at once (a row of up to 2,048 in one round trip on 512 threads)
ROWS_IN_FLIGHT = 8  # cache rows whose loads attention issues before using them
QUERY_AT = THREADS  # attention's layout of the shared row: the values' partial sums, then the query,
SCORES_AT = QUERY_AT + 64  # then the scores (while they fit)
WARPS = THREADS // 32
LOADERS = {np.dtype(np.float32): f32x8, np.dtype(np.uint16): bf16x8}  # 8 weights from a uint32 view of the array


# ---- time stamps: the GPU's nanosecond clock, shared by all SMs (PTX %globaltimer) ----

if SIMULATOR:
    def globaltimer():
        return time.perf_counter_ns()
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    @intrinsic
    def globaltimer(typingctx):
        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(64), []), "mov.u64 $0, %globaltimer;", "=l",
                               side_effect=True)
            return builder.call(asm, [])

        return types.int64(), codegen


@cuda.jit(device=True)
def pass_barriers(counters, passed, upto, before):
    """Pass the grid barriers passed + 1 .. upto of a step, one after another: thread 0 arrives at each (the last
    counter + 1) and waits until every block has (the counter at before + blocks x the barrier's number; before: the
    counter when the step started); the block's other threads wait for it at the block barrier that follows. ->
    the barriers passed, max(passed, upto)."""
    blocks, at = cuda.gridDim.x, counters.shape[0] - 1
    while passed < upto:
        passed += 1
        if cuda.threadIdx.x == 0:
            cuda.atomic.add(counters, at, 1)
            while cuda.atomic.add(counters, at, 0) < before + blocks * passed:
                cuda.nanosleep(POLL_NS)
    return passed


# ---- the block's work on a slice of a matmul: fetch (before waiting), accumulate, reduce ----

@functools.cache
def _slice_matmul_for(load8, team):
    """(fetch, accumulate, reduce) for slices of 8 team columns of a [K, N] weight w seen as uint32 words (N and the
    slice's first column c0 multiples of 8). A team of `team` lanes reads 16 team contiguous bytes of a bf16 row; the
    block's teams take rows k, k + teams, ... (thread tid: rows tid // team + u teams). A thread's first rows come
    from `fetch`, issued before the instruction waits for its inputs (the weights depend on nothing); the rest, if
    any, are loaded by `accumulate`, UNROLL rows in flight. Every thread calls each."""
    cols = 8 * team

    @cuda.jit(device=True)
    def fetch(w, base, N, c0, K, buf, u0):
        """buf[u0 + u, :] = the thread's 8 weights of row tid // team + u teams, for u < PREFETCH - u0 (rows < K)."""
        tid = cuda.threadIdx.x
        teams, col = cuda.blockDim.x // team, c0 + 8 * (tid % team)
        for u in range(PREFETCH):
            k = tid // team + (u - u0) * teams
            if u >= u0 and k < K and col < N:
                v = load8(w, (base + k * N + col) // 8)
                for c in range(8):
                    buf[u, c] = v[c]

    @cuda.jit(device=True)
    def accumulate(a, K, w, base, N, c0, buf, u0, acc):
        """acc[c] = sum over the thread's rows k of a[k] w[k, c0 + 8 lane + c] (a: shared float32 [>= K]), rows in
        increasing order: the fetched ones from buf (rows u0 ..), the others loaded here."""
        tid = cuda.threadIdx.x
        teams, col = cuda.blockDim.x // team, c0 + 8 * (tid % team)
        for c in range(8):
            acc[c] = float32(0)
        if col < N:
            for u in range(PREFETCH):
                k = tid // team + (u - u0) * teams
                if u >= u0 and k < K:
                    x = a[k]
                    for c in range(8):
                        acc[c] += x * buf[u, c]
            tail = cuda.local.array((UNROLL, 8), dtype=float32)
            for k0 in range(tid // team + (PREFETCH - u0) * teams, K, UNROLL * teams):
                for u in range(UNROLL):
                    if k0 + u * teams < K:
                        v = load8(w, (base + (k0 + u * teams) * N + col) // 8)
                        for c in range(8):
                            tail[u, c] = v[c]
                for u in range(UNROLL):
                    if k0 + u * teams < K:
                        x = a[k0 + u * teams]
                        for c in range(8):
                            acc[c] += x * tail[u, c]

    @cuda.jit(device=True)
    def reduce(acc, red, y):
        """y[8 lane + c] = the sum of acc[c] over the block's teams, in a fixed order (red: shared float32 [WARPS,
        >= 8 team]; y: shared float32 [>= 8 team])."""
        tid = cuda.threadIdx.x
        offset = team  # the teams of a warp: lanes l, l ^ team, l ^ 2 team, ... hold the same columns
        while offset < 32:
            for c in range(8):
                acc[c] += cuda.shfl_xor_sync(FULL_MASK, acc[c], offset)
            offset *= 2
        if tid % 32 < team:
            for c in range(8):
                red[tid // 32, 8 * (tid % team) + c] = acc[c]
        cuda.syncthreads()
        for c in range(tid, cols, cuda.blockDim.x):
            v = float32(0)
            for wp in range(cuda.blockDim.x // 32):
                v += red[wp, c]
            y[c] = v
        cuda.syncthreads()  # y is written, red free again

    return fetch, accumulate, reduce


@cuda.jit(device=True)
def held_rows(K, team):
    """How many of buf's rows a thread's share of a K-row slice fills (at most PREFETCH)."""
    teams = cuda.blockDim.x // team
    return min(PREFETCH, (K + teams - 1) // teams)


@cuda.jit(device=True)
def load_row(src, n, a):
    """a[j] = src[j] for j < n (an activation row into shared memory): ROW_LOADS loads in flight per thread, then
    their stores (a row of up to ROW_LOADS x THREADS in one memory round trip)."""
    tid, T = cuda.threadIdx.x, cuda.blockDim.x
    v = cuda.local.array(ROW_LOADS, dtype=float32)
    for j0 in range(tid, n, ROW_LOADS * T):
        for u in range(ROW_LOADS):
            if j0 + u * T < n:
                v[u] = src[j0 + u * T]
        for u in range(ROW_LOADS):
            if j0 + u * T < n:
                a[j0 + u * T] = v[u]
    cuda.syncthreads()


@cuda.jit(device=True)
def fetch_gamma(norm, g0, d, gamma):
    """gamma[u] = norm[g0 + tid + u T] for u < ROW_LOADS (those < d): a norm's weights, loaded before waiting."""
    tid, T = cuda.threadIdx.x, cuda.blockDim.x
    for u in range(ROW_LOADS):
        if tid + u * T < d:
            gamma[u] = norm[g0 + tid + u * T]


@cuda.jit(device=True)
def normed_row(x, norm, g0, eps, gamma, a, scratch):
    """a[k] = x[0, k] / rms(x[0]) * norm[g0 + k] for k < d (RMSNorm into shared memory, the sum of squares in
    elementwise.row_rms's order: the same bits as rms_norm); gamma: the thread's fetched norm weights (the first
    ROW_LOADS T of them)."""
    d, tid, T = x.shape[1], cuda.threadIdx.x, cuda.blockDim.x
    load_row(x[0], d, a)
    sum_sq = float32(0)
    if tid < NORM_THREADS:
        for j in range(tid, d, NORM_THREADS):
            sum_sq += a[j] * a[j]
    sum_sq = block_sum(sum_sq, scratch)
    rms = float32(math.sqrt(sum_sq / float32(d) + eps))
    for u in range(ROW_LOADS):
        if tid + u * T < d:
            a[tid + u * T] = a[tid + u * T] / rms * gamma[u]
    for k in range(tid + ROW_LOADS * T, d, T):
        a[k] = a[k] / rms * norm[g0 + k]
    cuda.syncthreads()


@cuda.jit(device=True)
def attend(layer, g, p, qs, k_cache, v_cache, sc, out, big, scratch):
    """softmax(qs . k_t) v_t over the cache rows t <= p of KV head g into out [hd], the scores in sc [>= p + 1]:
    scores (a warp per key, ROWS_IN_FLIGHT keys' loads at a time) and their maximum; exponentials and their sum;
    values (thread (slice, e) adds column e of the rows slice, slice + slices, ...; the slices' sums added in order
    through big [>= THREADS])."""
    hd = k_cache.shape[3]
    tid, T, n = cuda.threadIdx.x, cuda.blockDim.x, p + 1
    lane, warp = tid % 32, tid // 32
    best = float32(-math.inf)
    kbuf = cuda.local.array((ROWS_IN_FLIGHT, 2), dtype=float32)  # a lane's (up to) 2 elements of each key
    for t0 in range(warp * ROWS_IN_FLIGHT, n, T // 32 * ROWS_IN_FLIGHT):
        for u in range(ROWS_IN_FLIGHT):
            for j in range(2):
                e = lane + 32 * j
                kbuf[u, j] = k_cache[layer, t0 + u, g, e] if t0 + u < n and e < hd else float32(0)
        for u in range(ROWS_IN_FLIGHT):
            s = float32(0)
            for j in range(2):
                if lane + 32 * j < hd:
                    s += qs[lane + 32 * j] * kbuf[u, j]
            s = segment_sum(s, 32)
            if t0 + u < n:
                if lane == 0:
                    sc[t0 + u] = s
                best = max(best, s)
    best = block_max(best, scratch)  # its barriers also publish the scores to the block
    total = float32(0)
    for t in range(tid, n, T):
        e = float32(math.exp(sc[t] - best))
        sc[t] = e
        total += e
    total = block_sum(total, scratch)  # and the exponentials
    slices = T // hd
    if tid < slices * hd:
        sl, e = tid // hd, tid % hd
        acc = float32(0)
        vbuf = cuda.local.array(ROWS_IN_FLIGHT, dtype=float32)
        for t0 in range(sl, n, slices * ROWS_IN_FLIGHT):  # the loads of ROWS_IN_FLIGHT rows, then their FMAs
            for u in range(ROWS_IN_FLIGHT):
                t = t0 + u * slices
                vbuf[u] = v_cache[layer, t, g, e] if t < n else float32(0)
            for u in range(ROWS_IN_FLIGHT):
                if t0 + u * slices < n:
                    acc += sc[t0 + u * slices] * vbuf[u]
        big[tid] = acc
    cuda.syncthreads()
    for e in range(tid, hd, T):
        s = float32(0)
        for sl in range(slices):
            s += big[sl * hd + e]
        out[e] = s / total


# ---- the operations: device functions of (instruction, buffers), every thread of the block calls ----

def _ops_for(load8):
    head_fetch, head_accumulate, head_reduce = _slice_matmul_for(load8, HEAD_TEAM)
    slice_fetch, slice_accumulate, slice_reduce = _slice_matmul_for(load8, SLICE_TEAM)

    @cuda.jit(device=True)
    def op_embed(token, table, x):
        """x[0] = the embedding of `token` (NaN for NO_TOKEN: the host reports the NaN that caused it)."""
        d = x.shape[1]
        for i8 in range(cuda.threadIdx.x, d // 8, cuda.blockDim.x):
            if token >= 0:
                v = load8(table, (token * d) // 8 + i8)
                for c in range(8):
                    x[0, 8 * i8 + c] = v[c]
            else:
                for c in range(8):
                    x[0, 8 * i8 + c] = float32(math.nan)

    @cuda.jit(device=True)
    def fetch(op, layer, h_or_c0, p, x, q, act, logits, bias, cos, sin, attn_norm, mlp_norm, final_norm, w_qkv, wo,
              w_gate, w_up, w_down, head, buf, gamma, rope):
        """What a matmul instruction reads that no other instruction writes, loaded before it waits for its inputs
        (it arrives while the block waits): the first weights of its slice into buf (see _slice_matmul_for), its
        norm's weights into gamma, and for a qkv head its bias and its RoPE angles at position p into rope [4,
        >= hd / 2] (shared; by the block's last threads: the first ones poll the counters)."""
        d, d_ff, hd, N = x.shape[1], act.shape[0], cos.shape[1] * 2, bias.shape[1]
        tid, T, half = cuda.threadIdx.x, cuda.blockDim.x, cos.shape[1]
        if op == QKV:
            h = h_or_c0
            head_fetch(w_qkv, layer * d * N, N, h * hd, d, buf, 0)
            fetch_gamma(attn_norm, layer * d, d, gamma)
            for i in range(T - 1 - tid, half, T):
                rope[0, i], rope[1, i] = bias[layer, h * hd + i], bias[layer, h * hd + i + half]
                rope[2, i], rope[3, i] = cos[p, i], sin[p, i]
        elif op == O_PROJ:
            slice_fetch(wo, layer * q.shape[0] * d, d, h_or_c0, q.shape[0], buf, 0)
        elif op == GATE_UP:
            slice_fetch(w_gate, layer * d * d_ff, d_ff, h_or_c0, d, buf, 0)
            slice_fetch(w_up, layer * d * d_ff, d_ff, h_or_c0, d, buf, held_rows(d, SLICE_TEAM))
            fetch_gamma(mlp_norm, layer * d, d, gamma)
        elif op == DOWN:
            slice_fetch(w_down, layer * d_ff * d, d, h_or_c0, d_ff, buf, 0)
        else:  # LOGITS
            head_fetch(head, 0, (logits.shape[0] + 7) // 8 * 8, h_or_c0, d, buf, 0)
            fetch_gamma(final_norm, 0, d, gamma)

    @cuda.jit(device=True)
    def op_qkv(layer, h, p, x, norm, eps, w, q, k_cache, v_cache, a, buf, gamma, rope, yh, red, scratch):
        """Head h of [q | k | v] (H + 2 Hkv heads of hd <= 64 columns) from the normalized x, + bias, RoPE at
        position p for q and k (bias and angles fetched in rope); q to q[h hd ...], k and v to row p of the layer's
        cache [L, capacity, Hkv, hd]."""
        d, hd, Hkv = x.shape[1], k_cache.shape[3], k_cache.shape[2]
        H, half = q.shape[0] // hd, hd // 2
        N = (H + 2 * Hkv) * hd
        acc = cuda.local.array(8, dtype=float32)
        normed_row(x, norm, layer * d, eps, gamma, a, scratch)
        head_accumulate(a, d, w, layer * d * N, N, h * hd, buf, 0, acc)
        head_reduce(acc, red, yh)
        for e in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
            i = e % half
            y0, y1 = yh[i] + rope[0, i], yh[i + half] + rope[1, i]
            v = y0 if e < half else y1
            if h < H + Hkv:  # q and k heads: rotate the pair (i, i + hd / 2)
                c, s = rope[2, i], rope[3, i]
                v = y0 * c - y1 * s if e < half else y0 * s + y1 * c
            if h < H:
                q[h * hd + e] = v
            elif h < H + Hkv:
                k_cache[layer, p, h - H, e] = v
            else:
                v_cache[layer, p, h - H - Hkv, e] = v

    @cuda.jit(device=True)
    def op_attention(layer, h, p, q, k_cache, v_cache, scores, attn, big, scratch):
        """Query head h against cache rows 0 .. p of its KV head: softmax(q k / sqrt(hd)) v into attn[h hd ...].
        big: shared float32 [MAX_K]: the partial sums of the values, the query, and the scores when they fit
        (p + 1 <= MAX_K - SCORES_AT), else in scores[h], global scratch [H, capacity]. hd <= 64."""
        hd, Hkv = k_cache.shape[3], k_cache.shape[2]
        g = h // (q.shape[0] // hd // Hkv)
        qs = big[QUERY_AT:SCORES_AT]  # the query, scaled by 1 / sqrt(hd)
        scale = float32(1) / float32(math.sqrt(hd))
        for j in range(cuda.threadIdx.x, hd, cuda.blockDim.x):
            qs[j] = q[h * hd + j] * scale
        cuda.syncthreads()
        out = attn[h * hd:(h + 1) * hd]
        if p + 1 <= MAX_K - SCORES_AT:
            attend(layer, g, p, qs, k_cache, v_cache, big[SCORES_AT:], out, big, scratch)
        else:
            attend(layer, g, p, qs, k_cache, v_cache, scores[h], out, big, scratch)

    @cuda.jit(device=True)
    def op_project_add(layer, c0, c1, src, K, w, x, a, buf, red, y):
        """x[0, c] += src @ w[layer][:, c] for c0 <= c < c1 (O and down projections, the residual in place): each
        pass's reduction runs while the next pass's weights load. A thread per column of a pass (SLICE_COLS <= 32)."""
        d, tid = x.shape[1], cuda.threadIdx.x
        acc = cuda.local.array(8, dtype=float32)
        load_row(src, K, a)
        for c in range(c0, c1, SLICE_COLS):
            width = min(SLICE_COLS, c1 - c)
            old = x[0, c + tid] if tid < width else float32(0)
            slice_accumulate(a, K, w, layer * K * d, d, c, buf, 0, acc)
            if c + SLICE_COLS < c1:
                slice_fetch(w, layer * K * d, d, c + SLICE_COLS, K, buf, 0)
            slice_reduce(acc, red, y)
            if tid < width:
                x[0, c + tid] = old + y[tid]

    @cuda.jit(device=True)
    def op_gate_up(layer, c0, c1, x, norm, eps, w_gate, w_up, act, a, buf, gamma, red, gate, up, scratch):
        """act[c] = silu(h @ w_gate[:, c]) * (h @ w_up[:, c]) for c0 <= c < c1, h the normalized x."""
        d, d_ff, tid = x.shape[1], act.shape[0], cuda.threadIdx.x
        u0 = held_rows(d, SLICE_TEAM)  # where the up rows start in buf
        acc_g = cuda.local.array(8, dtype=float32)
        acc_u = cuda.local.array(8, dtype=float32)
        normed_row(x, norm, layer * d, eps, gamma, a, scratch)
        for c in range(c0, c1, SLICE_COLS):
            slice_accumulate(a, d, w_gate, layer * d * d_ff, d_ff, c, buf, 0, acc_g)
            slice_accumulate(a, d, w_up, layer * d * d_ff, d_ff, c, buf, u0, acc_u)
            if c + SLICE_COLS < c1:
                slice_fetch(w_gate, layer * d * d_ff, d_ff, c + SLICE_COLS, d, buf, 0)
                slice_fetch(w_up, layer * d * d_ff, d_ff, c + SLICE_COLS, d, buf, u0)
            slice_reduce(acc_g, red, gate)
            slice_reduce(acc_u, red, up)
            for e in range(tid, min(SLICE_COLS, c1 - c), cuda.blockDim.x):
                act[c + e] = silu_times(gate[e], up[e])

    @cuda.jit(device=True)
    def op_logits(c0, c1, x, norm, eps, head, logits, a, buf, gamma, red, y, scratch):
        """logits[n] = h @ head[:, n] for c0 <= n < c1 (head [d, V rounded up to 8]), h the normalized x."""
        d, tid = x.shape[1], cuda.threadIdx.x
        V8 = (logits.shape[0] + 7) // 8 * 8  # the head's padded width
        acc = cuda.local.array(8, dtype=float32)
        normed_row(x, norm, 0, eps, gamma, a, scratch)
        for c in range(c0, c1, PASS_COLS):
            head_accumulate(a, d, head, 0, V8, c, buf, 0, acc)
            if c + PASS_COLS < c1:
                head_fetch(head, 0, V8, c + PASS_COLS, d, buf, 0)
            head_reduce(acc, red, y)
            for e in range(tid, min(PASS_COLS, c1 - c), cuda.blockDim.x):
                logits[c + e] = y[e]

    return op_embed, fetch, op_qkv, op_attention, op_project_add, op_gate_up, op_logits


# ---- the interpreter ----

def _make_megakernel(load8):
    op_embed, fetch, op_qkv, op_attention, op_project_add, op_gate_up, op_logits = _ops_for(load8)

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (THREADS,)}))
    def megakernel(ops, waits_start, waits, counter_of, sizes, queue_start, queue, phase, barriers, counters, epoch0,
                   feed, tokens_out, token, stops, position0,
                   temperature_top_p, top_k_seed, eps, cos, sin, embed, attn_norm, w_qkv, b_qkv, wo, mlp_norm, w_gate,
                   w_up, w_down, final_norm, head, x, q, attn, act, logits, k_cache, v_cache, scores, weights, stamps):
        """len(feed) decode steps (see the module's docstring). ops [n, 4], waits_start, waits, counter_of, sizes,
        queue_start, queue, phase: the program, its counters and its schedule (schedule.encode,
        schedule.counter_tables); barriers: 0 (counters), or the number of phases (the grid-barrier version);
        counters int32 [G + 1]: how many instructions of each group are done, over all steps, then the barriers
        passed by all the blocks together; feed int32 [steps]: the
        token of each step, or < 0 for the one the previous step chose; tokens_out int32 [steps]: the token each step
        chose; token int32 [1]: the token chosen last; stops int32 [S]: end tokens (the launch ends after the
        step that chose one: every block reads it before its next step); position0: the position of step 0 (step t
        is at position0 + t). Weights stacked by layer, matrices seen as uint32 words: w_qkv [L, d, (H + 2 Hkv) hd],
        wo [L, H hd, d], w_gate, w_up [L, d, d_ff], w_down [L, d_ff, d], embed [V, d], head [d, V rounded up to
        8]; b_qkv [L, (H + 2 Hkv) hd] and the norms float32 (flat). x [1, d], q, attn [H hd], act [d_ff], logits
        [V]; k_cache, v_cache [L, capacity, Hkv, hd]; scores [H, capacity]; weights uint64 [V] (the
        sampler's scratch); stamps int64 [n, 3]: for each instruction of the last step, the GPU clock (ns) when
        its block began it (fetching, then waiting), began running it, and marked it done."""
        a = cuda.shared.array(MAX_K, dtype=float32)
        red = cuda.shared.array((WARPS, PASS_COLS), dtype=float32)
        yh = cuda.shared.array(PASS_COLS, dtype=float32)
        y2 = cuda.shared.array(PASS_COLS, dtype=float32)
        scratch = cuda.shared.array(32, dtype=float32)
        mine = cuda.shared.array((MAX_QUEUE, 8), dtype=int32)  # this block's instructions, read once
        tid, b = cuda.threadIdx.x, cuda.blockIdx.x
        first, count = queue_start[b], queue_start[b + 1] - queue_start[b]
        for j in range(tid, count, cuda.blockDim.x):
            i = queue[first + j]
            mine[j, 0], mine[j, 1], mine[j, 2], mine[j, 3] = i, ops[i, 0], ops[i, 1], ops[i, 2]
            mine[j, 4], mine[j, 5], mine[j, 6], mine[j, 7] = ops[i, 3], waits_start[i], waits_start[i + 1], phase[i]
        cuda.syncthreads()
        sample_counter = counter_of[ops.shape[0] - 1]  # the last instruction: sample
        steps = feed.shape[0]
        buf = cuda.local.array((PREFETCH, 8), dtype=float32)  # what `fetch` loads before an instruction waits
        gamma = cuda.local.array(ROW_LOADS, dtype=float32)
        rope = cuda.shared.array((4, ROPE_PAIRS), dtype=float32)
        blocks = cuda.gridDim.x
        ended = cuda.shared.array(1, dtype=int32)
        for t in range(steps):
            epoch = epoch0 + t + 1
            p = position0 + t
            if t > 0 and feed[t] < 0 and stops.shape[0] > 0:  # did step t - 1 choose an end token?
                if tid == 0:
                    while cuda.atomic.add(counters, sample_counter, 0) < epoch - 1:
                        cuda.nanosleep(POLL_NS)
                    chosen = cuda.atomic.add(token, 0, 0)  # from the L2 cache: what the sampling block wrote
                    ended[0] = 0
                    for s in range(stops.shape[0]):
                        if chosen == stops[s]:
                            ended[0] = 1
                cuda.syncthreads()
                if ended[0] == 1:
                    break
            passed = 0  # grid barriers of this step passed (the barrier version)
            before = blocks * (epoch - 1) * barriers  # the barrier counter when the step starts
            fed_next = t + 1 < steps and feed[t + 1] >= 0  # the next token is known: no logits needed
            for j in range(count):
                i, op, layer, c0, c1 = mine[j, 0], mine[j, 1], mine[j, 2], mine[j, 3], mine[j, 4]
                if tid == 0:
                    stamps[i, 0] = globaltimer()
                if op != EMBED and op != ATTENTION and op != SAMPLE and not (op == LOGITS and fed_next):
                    fetch(op, layer, c0, p, x, q, act, logits, b_qkv, cos, sin, attn_norm, mlp_norm, final_norm, w_qkv,
                          wo, w_gate, w_up, w_down, head, buf, gamma, rope)
                if barriers > 0:
                    passed = pass_barriers(counters, passed, mine[j, 7], before)
                for w in range(mine[j, 5] + tid, mine[j, 6], cuda.blockDim.x):  # a thread per group waited for
                    c = waits[w]
                    while cuda.atomic.add(counters, c, 0) < sizes[c] * epoch:
                        cuda.nanosleep(POLL_NS)
                if op == EMBED and tid == 0 and barriers == 0:  # the previous step is over
                    while cuda.atomic.add(counters, sample_counter, 0) < epoch - 1:
                        cuda.nanosleep(POLL_NS)
                gpu_fence()  # acquire: what the groups waited for wrote is seen by this thread's reads (each poller)
                cuda.syncthreads()  # ... and, through the block barrier, by every thread of the block
                if tid == 0:
                    stamps[i, 1] = globaltimer()
                if op == EMBED:
                    op_embed(feed[t] if feed[t] >= 0 else token[0], embed, x)
                elif op == QKV:
                    op_qkv(layer, c0, p, x, attn_norm, eps, w_qkv, q, k_cache, v_cache, a, buf, gamma, rope, yh, red,
                           scratch)
                elif op == ATTENTION:
                    op_attention(layer, c0, p, q, k_cache, v_cache, scores, attn, a, scratch)
                elif op == O_PROJ:
                    op_project_add(layer, c0, c1, attn, attn.shape[0], wo, x, a, buf, red, yh)
                elif op == GATE_UP:
                    op_gate_up(layer, c0, c1, x, mlp_norm, eps, w_gate, w_up, act, a, buf, gamma, red, yh, y2,
                               scratch)
                elif op == DOWN:
                    op_project_add(layer, c0, c1, act, act.shape[0], w_down, x, a, buf, red, yh)
                elif op == LOGITS:
                    if not fed_next:
                        op_logits(c0, c1, x, final_norm, eps, head, logits, a, buf, gamma, red, yh, scratch)
                else:  # SAMPLE
                    chosen = int32(0)
                    if not fed_next:
                        chosen = choose(logits, weights, temperature_top_p[0], temperature_top_p[1], top_k_seed[0],
                                        top_k_seed[1], p + 1)
                    if tid == 0:
                        token[0] = chosen
                        tokens_out[t] = chosen
                cuda.syncthreads()
                if tid == 0:
                    gpu_fence()  # release: the block's writes, ordered before the barrier, before the count
                    cuda.atomic.add(counters, counter_of[i], 1)
                    stamps[i, 2] = globaltimer()
            pass_barriers(counters, passed, barriers, before)  # the step's last: the next starts after all of it

    return megakernel


@functools.cache
def megakernel_for(dtype) -> object:
    """The megakernel reading weights stored as `dtype` (float32, or bf16 bits as uint16), built on first use."""
    return _make_megakernel(LOADERS[np.dtype(dtype)])
