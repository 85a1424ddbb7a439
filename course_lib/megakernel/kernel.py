"""The persistent megakernel: one launch runs whole decode steps by interpreting the instruction list of `program`.

The grid is one block per SM (THREADS threads, the sampler's block). Block b runs queue b of the schedule, in
order, once per step (its instructions read into shared memory once per launch). The dependencies are counted:
instructions come in groups (a layer's instructions of one op; a query head's qkv; a KV head's key and value), each
group has a counter, and an instruction waits for whole groups (`schedule.counter_tables`):

    wait   a thread per group waited for reads its counter with acquire semantics (kernels.load_acquire: from the
           L2 cache, never a stale L1 line), pausing POLL_NS between reads, until it reaches size x epoch; then a
           block barrier (the block sees what the other blocks wrote before they counted their instructions)
    run    the instruction's operation, by every thread of the block (op_embed, the attention and projection bodies)
    mark   a block barrier, then thread 0 adds 1 to its group's counter with release semantics (kernels.add_release:
           the block's writes before the count, no value returned and no separate fence)

Epochs make the counters reusable without clearing them: step t of a launch is epoch epoch0 + t + 1, and after E
steps a counter holds size x E. The first instruction of a step (embed) also waits for the previous step's last
(sample): everything of step t is an ancestor of its sample, so step t + 1 starts after all of step t. A launch
runs `steps` steps: the prompt is fed through `feed` (feed[t] >= 0: the token of step t; the step before it then
computes no logits), then each step embeds the token the previous one chose. No block waits for an instruction that
comes later in (step, program order), so the blocks cannot deadlock as long as they all run at once (one per SM). The
simulator, which runs a kernel's blocks one after another, runs this one's at once (`kernels.blocks_together`: their
threads interleaved); by default it runs there with one block, whose queue is the program.

The grid-barrier version (`barriers` > 0, the number of phases of `program.phases`): a block passes every grid
barrier between the phases before an instruction's (thread 0 adds 1 to the barrier counter, the last of `counters`,
then waits until every block has), and the barriers left at the end of a step; the instruction's counters, still
polled, are complete by then. An instruction then waits for the whole phase before it, and every block, busy or not,
for every barrier: what the counters save is measured against it.

The projections (qkv, o_proj, gate_up, down, logits) run the bodies of the five-kernel step's projections
(kernels/row_dot): the weights stored a row per output, a warp per pair of outputs (a RoPE pair of a head, a gate row
and its up row, two neighbouring columns), WARPS pairs a pass, `pair_sums` then the same epilogue as the launched
kernels (`rope_store`, `swiglu_store`, `store_pair`). pair_sums issues its first weight loads, then waits: the
launched kernels for the kernel before (griddepcontrol), the megakernel for its counters (`counted`): the weights
travel while the block waits. A warp normalizes the row itself from the activations it reads (the RMSNorm of qkv,
gate_up and logits) and its 32 lanes' sums meet by shuffles: no shared memory, no block barrier inside an
instruction, and the same bits whichever block runs it. An attention instruction (a query head) runs the five step's
flash-decoding body (`paged_attention.chunk_block_for`, a block of WARPS warps, waiting by counters): its keys in one
chunk, an online softmax per team of lanes, the teams and warps merged at the end; the cache's rows are pages of an
identity page table.
"""

from __future__ import annotations

import functools
import math
import time

import numpy as np
from numba import float32, int32

from ..kernels import SIMULATOR, add_release, blocks_together, cuda, load_acquire, sized
from ..kernels.paged_attention import chunk_block_for
from ..kernels.row_dot import (
    pair_sums_for,
    residual_fetch_for,
    rope_fetch_for,
    rope_store_for,
    store_pair_for,
    swiglu_store,
)
from ..kernels.sampling import THREADS, choose
from ..kernels.vector import bf16x8, f32x8
from .schedule import OPCODES

EMBED, QKV, ATTENTION, O_PROJ, GATE_UP, DOWN, LOGITS, SAMPLE = (
    OPCODES[op] for op in ("embed", "qkv", "attention", "o_proj", "gate_up", "down", "logits", "sample"))
SLICE_COLS = sized(32, 16)  # weight rows of a projection instruction (program.build_program's cols): a pair a
# warp, WARPS pairs a pass
ATTENTION_UNROLL = 2  # keys per team of lanes and step of an attention instruction: the five step takes 4
# (paged_attention.SEQUENCE_CHUNKS), whose key and value registers spill under the megakernel's cap of 128 a thread
PAGE = 16  # the cache's rows as pages of kernels/paged_attention (an identity page table): its chunk_block's
# page_size
MAX_QUEUE = 256  # instructions of one block's queue at most (read into shared memory once)
POLL_NS = 32  # a waiting thread's pause between two reads of a counter: fewer requests crowding the L2 cache
WARPS = THREADS // 32
LOADERS = {np.dtype(np.float32): f32x8, np.dtype(np.uint16): bf16x8}  # 8 weights from a uint32 view of the array
WORDS_PER_PAIR = {np.dtype(np.float32): 2, np.dtype(np.uint16): 1}  # uint32 words of two weights


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


@cuda.jit(device=True)
def counted(ready):
    """Wait for the groups an instruction waits for, ready = (counters, waits, w0, w1, sizes, epoch, stamp): a thread
    per group waits[w0 .. w1 - 1] polls its counter (acquire loads: from the L2 cache) until it reaches size x
    epoch, then a block barrier; stamp[1] = the clock. w1 < 0: nothing to wait for (a pass after an
    instruction's first: no barrier either). Every thread of the block calls it."""
    counters, waits, w0, w1, sizes, epoch, stamp = ready
    if w1 >= 0:
        for w in range(w0 + cuda.threadIdx.x, w1, cuda.blockDim.x):
            c = waits[w]
            while load_acquire(counters, c) < sizes[c] * epoch:  # acquire: what the group wrote is seen by this
                cuda.nanosleep(POLL_NS)  # thread's reads after it...
        cuda.syncthreads()  # ... and, through the block barrier, by every thread of the block
        if cuda.threadIdx.x == 0:
            stamp[1] = globaltimer()


# ---- the operations: device functions of (instruction, buffers), every thread of the block calls ----

@functools.cache
def _embed_for(load8):
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

    return op_embed


# ---- the interpreter ----

def _make_megakernel(dtype, steps, group, head_dim):
    load8, wpp = LOADERS[dtype], WORDS_PER_PAIR[dtype]
    op_embed = _embed_for(load8)
    attention = chunk_block_for(f32x8, group, head_dim, PAGE, 1, ATTENTION_UNROLL, WARPS, counted)  # the five
    # step's flash-decoding body: a query head, its keys in one chunk, waiting by counters
    normed_sums = pair_sums_for(1, steps, wpp == 2, True, counted)  # kernels/row_dot's body, waiting by counters
    added_sums = pair_sums_for(1, steps, wpp == 2, False, residual_fetch_for(counted))  # x's values fetched too
    qkv_sums = pair_sums_for(1, steps, wpp == 2, True, rope_fetch_for(counted))  # RoPE's operands fetched too
    rope_store, store, store_add = rope_store_for(False), store_pair_for(False), store_pair_for(True)

    @blocks_together
    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (THREADS,)}))
    def megakernel(ops, waits_start, waits, counter_of, sizes, queue_start, queue, phase, barriers, counters, epoch0,
                   feed, tokens_out, token, stops, position0, temperature_top_p, top_k_seed, eps, cos, sin, embed,
                   attn_norm, w_qkv, b_qkv, wo, mlp_norm, w_gu, w_down, final_norm, head, x, x_words, q2, q3, attn3,
                   attn4, attn_words, act2, act_words, logits, logits2, k_cache, v_cache, k_words, v_words, pages,
                   weights, stamps):
        """len(feed) decode steps (see the module's docstring). ops [n, 4], waits_start, waits, counter_of, sizes,
        queue_start, queue, phase: the program, its counters and its schedule (schedule.encode,
        schedule.counter_tables); barriers: 0 (counters), or the number of phases (the grid-barrier version);
        counters int32 [G + 1]: how many instructions of each group are done, over all steps, then the barriers
        passed by all the blocks together; feed int32 [steps]: the token of each step, or < 0 for the one the
        previous step chose; tokens_out int32 [steps]: the token each step chose; token int32 [1]: the token chosen
        last; stops int32 [S]: end tokens (the launch ends after the step that chose one: every block reads it
        before its next step); position0: the position of step 0 (step t is at position0 + t). Weights as uint32
        words, matrices stored a row per output and stacked by layer (kernels/row_dot's layouts): w_qkv [L,
        paired_qkv rows (H + 2 Hkv) hd, d], wo [L, d, H hd], w_gu [L, paired_gate_up rows 2 d_ff, d], w_down [L,
        d, d_ff], head [V, d] (V even), embed [V, d]; b_qkv [L, (H + 2 Hkv) hd] float32 in paired_qkv's order; the
        norms float32 as words ([L d]). x [1, d] (and its words); q as q2 [1, H hd] and q3 [1, H, hd], attn as attn3
        [1, H, hd], attn4 [1, H, 1, hd] and words (views of the same memory); act2 [1, d_ff], logits [V] (logits2
        [1, V]); k_cache, v_cache [L, rows, Hkv, hd] (and their words; rows a multiple of PAGE), pages: the identity
        page table [rows / PAGE]; weights uint64 [V] (the sampler's scratch); stamps int64 [n, 3]: for each
        instruction of the
        last step, the GPU clock (ns) when its block began it (loading its first weights, then waiting), began
        running it, and marked it done."""
        mine = cuda.shared.array((MAX_QUEUE, 8), dtype=int32)  # this block's instructions, read once
        tid, b = cuda.threadIdx.x, cuda.blockIdx.x
        warp, lane = tid // 32, tid % 32
        first, count = queue_start[b], queue_start[b + 1] - queue_start[b]
        for j in range(tid, count, cuda.blockDim.x):
            i = queue[first + j]
            mine[j, 0], mine[j, 1], mine[j, 2], mine[j, 3] = i, ops[i, 0], ops[i, 1], ops[i, 2]
            mine[j, 4], mine[j, 5], mine[j, 6], mine[j, 7] = ops[i, 3], waits_start[i], waits_start[i + 1], phase[i]
        cuda.syncthreads()
        sample_counter = counter_of[ops.shape[0] - 1]  # the last instruction: sample
        steps = feed.shape[0]
        d, d_ff, n_q, n_qkv = x.shape[1], act2.shape[1], q2.shape[1], b_qkv.shape[1]
        layer_words = k_cache.shape[1] * k_cache.shape[2] * k_cache.shape[3]  # a layer's table (float32)
        scale = float32(1) / float32(math.sqrt(k_cache.shape[3]))
        here = cuda.local.array(1, dtype=int32)  # the step's position: the positions and slots of rope_fetch
        acc = cuda.local.array((1, 2), dtype=float32)
        pre = cuda.local.array((1, 4), dtype=float32)  # a qkv pair's bias, cos and sin (rope_fetch_for), or the
        # residual's two values (residual_fetch_for)
        pre_slots = cuda.local.array(1, dtype=int32)
        blocks = cuda.gridDim.x
        ended = cuda.shared.array(1, dtype=int32)
        for t in range(steps):
            epoch = epoch0 + t + 1
            p = position0 + t
            here[0] = p
            if t > 0 and feed[t] < 0 and stops.shape[0] > 0:  # did step t - 1 choose an end token?
                if tid == 0:
                    while load_acquire(counters, sample_counter) < epoch - 1:
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
                if barriers > 0:
                    passed = pass_barriers(counters, passed, mine[j, 7], before)
                if op == EMBED and tid == 0 and barriers == 0:  # the previous step is over
                    while load_acquire(counters, sample_counter) < epoch - 1:
                        cuda.nanosleep(POLL_NS)
                projection = op == QKV or op == O_PROJ or op == GATE_UP or op == DOWN or (op == LOGITS and not fed_next)
                if not projection and op != ATTENTION:  # (those wait inside pair_sums and chunk_block, once their
                    # first weights or keys are in flight)
                    counted((counters, waits, mine[j, 5], mine[j, 6], sizes, epoch, stamps[i]))
                if op == EMBED:
                    op_embed(feed[t] if feed[t] >= 0 else token[0], embed, x)
                elif op == ATTENTION:  # query head c0, keys 0 .. p in one chunk (target = unit = 1): attn3 written.
                    # Its first keys are asked of the L2 cache before the wait, and loaded after it
                    attention(0, c0, 0, q3, k_words[layer * layer_words:], v_words[layer * layer_words:], pages,
                              here, 1, 1, scale, attn3, attn4, attn3, attn3,
                              (counters, waits, mine[j, 5], mine[j, 6], sizes, epoch, stamps[i]))
                elif op == SAMPLE:
                    chosen = int32(0)
                    if not fed_next:
                        chosen = choose(logits, weights, temperature_top_p[0], temperature_top_p[1], top_k_seed[0],
                                        top_k_seed[1], p + 1)
                    if tid == 0:
                        token[0] = chosen
                        tokens_out[t] = chosen
                elif projection:  # pairs P0 .. P1 of a matrix of rows [2 pairs, K], a pair a warp, WARPS a pass
                    if op == QKV:  # RoPE pairs c0 .. c1 - 1 (of one head)
                        P0, P1, K, src, gamma = c0, c1, d, x_words, attn_norm[layer * d:]
                        w = w_qkv[layer * n_qkv * d * wpp // 2:]
                    elif op == O_PROJ:  # (gamma: not read without a norm)
                        P0, P1, K, src, gamma = c0 // 2, c1 // 2, n_q, attn_words, attn_norm[0:]
                        w = wo[layer * d * n_q * wpp // 2:]
                    elif op == GATE_UP:  # act columns c0 .. c1: pairs of a gate row and an up row
                        P0, P1, K, src, gamma = c0, c1, d, x_words, mlp_norm[layer * d:]
                        w = w_gu[layer * 2 * d_ff * d * wpp // 2:]
                    elif op == DOWN:
                        P0, P1, K, src, gamma = c0 // 2, c1 // 2, d_ff, act_words, attn_norm[0:]
                        w = w_down[layer * d * d_ff * wpp // 2:]
                    else:  # LOGITS
                        P0, P1, K, src, gamma, w = c0 // 2, c1 // 2, d, x_words, final_norm[0:], head[0:]
                    for p0 in range(P0, P1, WARPS):  # the first pass waits (after loading its first weights)
                        w1 = mine[j, 6] if p0 == P0 else -1
                        pair = (counters, waits, mine[j, 5], w1, sizes, epoch, stamps[i])  # counted's `ready`
                        if op == O_PROJ or op == DOWN:
                            added_sums(p0 + warp, P1, K // 8, src, 0, 1, gamma, eps, w, acc,
                                       (pair, (p0 + warp, P1, 0, 1, x, pre)))
                        elif op == QKV:  # the cache's row is the position (an identity page table)
                            qkv_sums(p0 + warp, P1, K // 8, src, 0, 1, gamma, eps, w, acc,
                                     (pair, (p0 + warp, P1, 0, 1, b_qkv[layer], cos, sin, here, here, pre, pre_slots)))
                        else:
                            normed_sums(p0 + warp, P1, K // 8, src, 0, 1, gamma, eps, w, acc, pair)
                        if p0 + warp < P1 and lane == 0:
                            if op == QKV:
                                rope_store(p0 + warp, 0, 1, acc, pre, pre_slots, k_cache[layer], v_cache[layer], q2)
                            elif op == GATE_UP:
                                swiglu_store(p0 + warp, 0, 1, acc, act2)
                            elif op == LOGITS:
                                store(p0 + warp, 0, 1, acc, pre, logits2)
                            else:
                                store_add(p0 + warp, 0, 1, acc, pre, x)
                cuda.syncthreads()
                if tid == 0:  # release: the block's writes, ordered before the barrier, seen before the count
                    add_release(counters, counter_of[i], 1)
                    stamps[i, 2] = globaltimer()
            pass_barriers(counters, passed, barriers, before)  # the step's last: the next starts after all of it

    return megakernel


@functools.cache
def megakernel_for(dtype, steps: int, group: int, head_dim: int) -> object:
    """The megakernel reading weights stored as `dtype` (float32, or bf16 bits as uint16), rows of up to 256 steps
    elements (steps = ceil(K / 256) for the longest row K of its matrices), `group` query heads per KV head of
    head_dim, built on first use."""
    return _make_megakernel(np.dtype(dtype), steps, group, head_dim)
