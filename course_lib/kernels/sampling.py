"""Choosing the next token on the GPU: greedy argmax, or seeded temperature / top-k / top-p sampling, in one block.

The decode step ends here, so that the host never needs the 4 * V bytes of logits: `sample_next` (SLICES blocks find
the largest logit of a slice each; the last of them to finish reduces theirs and draws) writes the chosen id's
embedding row into the residual stream where the next step's first layer reads it (the embedding needs no
kernel of its own), advances the position and the cache slot, and records the id in a history the host reads (4
bytes per token). `sample_rows` samples the rows of a batch, one block per row, each with
its own settings and position (`sample_batch` on the host): T ids come back instead of T x V logits.

The rule, the same in `sample` (NumPy, the twin the kernels are tested against) and in `choose` (the kernels' body):
- temperature 0: the largest logit, lowest id on ties (as numpy.argmax);
- otherwise weights w_i = exp((x_i - max x) / temperature) in float32, held as integers W_i = floor(w_i 2^32)
  (so every sum below is exact and independent of the order of addition: a token lighter than 2^-32 of the
  heaviest one is never drawn);
- top-k keeps every token whose logit is at least the k-th largest (ties at the boundary all stay);
- top-p then keeps the tokens whose logit is at least t, the largest threshold whose kept weight reaches
  top_p of the total (the smallest set of most likely tokens that reaches top_p; ties all stay);
- the draw: u in [0, 1) from a counter-based hash of (seed, position of the new token), target = floor(u Z)
  with Z the kept total, and the token is the first id, in id order, where the running sum of kept W passes
  the target. The same (seed, position) always gives the same token, in any run, on any backend.
Any NaN logit gives NO_TOKEN (-1), which is no token id: the caller must check for it.
"""

import math

import numpy as np
from numba import float32, float64, int32, int64, uint32, uint64

from course_lib.kernels import SIMULATOR, cuda, empty, for_weight_dtypes, last_to_arrive, launch, pick, sized
from course_lib.kernels.elementwise import FULL_MASK, segment_sum
from course_lib.kernels.overlap import inputs_ready, waits_for_inputs

THREADS = sized(512, 32)  # one block; a multiple of 32 (1024 threads: too few registers each for the radix select)
SLICES = sized(32, 2)  # blocks of sample_next: each finds the largest logit of a slice, the last to finish goes on
# (one block reading all V logits would leave the other SMs idle; notebook 06 measures both)
UNROLL = 16  # loads in flight per thread in the pass that finds the largest logit (a memory latency a round)
RADIX = 256  # bins of a radix-select round (8 bits of a key)
NO_TOKEN = -1
_NONE = 2**31 - 1  # the index of a thread that has seen no logit yet
SCALE = 2.0**32  # W_i = floor(w_i * SCALE)
_MIX1, _MIX2, _GOLDEN = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


# ---- the counter-based generator (splitmix64's mixer), on the host ----

def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def uniform(seed: int, position: int) -> float:
    """u in [0, 1) with 53 random bits, a function of (seed, position) alone."""
    return (_mix64((_mix64(seed & _M64) + position * _GOLDEN) & _M64) >> 11) * 2.0**-53


def sortable(x: np.ndarray) -> np.ndarray:
    """uint32 keys in the order of the float32 values x (-inf lowest, +inf highest)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return np.where(bits >> 31, ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


# ---- the NumPy twin ----

def sample(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None, seed: int,
           position: int, threads: int = THREADS) -> int:
    """The next token by the rule at the top of this module. logits [V] float32; position: the position the new
    token will take; threads: the kernel's block size (it fixes how the id range is cut for the walk, which
    does not change the result)."""
    x = np.asarray(logits, np.float32)
    if np.isnan(x).any():
        return NO_TOKEN
    if temperature == 0:
        return int(np.argmax(x))
    keys = sortable(x)
    z = (x - x.max()) / np.float32(temperature)
    w = (np.exp(z.astype(np.float64)).astype(np.float32).astype(np.float64) * SCALE).astype(np.uint64)
    keep = np.ones(x.size, bool)
    if top_k is not None and top_k < x.size:
        keep = keys >= np.partition(keys, x.size - top_k)[x.size - top_k]
    if top_p is not None and top_p < 1:
        order = np.argsort(~keys[keep], kind="stable")  # kept tokens, largest logit first
        kept_keys, mass = keys[keep][order], np.cumsum(w[keep][order])
        need = top_p * float(mass[-1])
        first = int(np.argmax(mass.astype(np.float64) >= need))  # the first prefix that reaches top_p
        keep &= keys >= kept_keys[first]  # ... and every token tied with its last one
    kept = np.where(keep, w, np.uint64(0))
    total = int(kept.sum())
    target = min(int(uniform(seed, position) * float(total)), total - 1)
    return int(np.argmax(np.cumsum(kept) > target))


# ---- device functions ----

@cuda.jit(device=True)
def sortable_key(x):
    bits = uint32(cuda.libdevice.float_as_int(x))
    return ~bits if bits >> uint32(31) else bits | uint32(0x80000000)


if SIMULATOR:  # NumPy's uint64 scalars warn on the wrap-around the mixer relies on: the host's Python integers
    @cuda.jit(device=True)
    def uniform_on_device(seed, position):
        return float64(uniform(int(seed), int(position)))
else:
    @cuda.jit(device=True)
    def mix64(z):
        z = (z ^ (z >> uint64(30))) * uint64(_MIX1)
        z = (z ^ (z >> uint64(27))) * uint64(_MIX2)
        return z ^ (z >> uint64(31))

    @cuda.jit(device=True)
    def uniform_on_device(seed, position):
        """`uniform` on the device: uint64 arithmetic wraps mod 2^64 as the host's masks do."""
        h = mix64(mix64(uint64(seed)) + uint64(position) * uint64(_GOLDEN))
        return float64(h >> uint64(11)) * float64(2.0**-53)


@cuda.jit(device=True)
def visit(x, j, v, i, nan):
    """Fold logit x at index j into a thread's (best value, its index, any NaN); indices come in increasing order,
    so only a strictly larger value replaces (the lowest index wins a tie)."""
    if x != x:
        return v, i, int32(1)
    if x > v or i == _NONE:
        return x, int32(j), nan
    return v, i, nan


@cuda.jit(device=True)
def warp_best(v, i, nan):
    """(best value, lowest index of it, any NaN) over the warp, in every lane (shfl_xor_sync butterfly)."""
    offset = 16
    while offset > 0:
        other_v = cuda.shfl_xor_sync(FULL_MASK, v, offset)
        other_i = cuda.shfl_xor_sync(FULL_MASK, i, offset)
        nan |= cuda.shfl_xor_sync(FULL_MASK, nan, offset)
        if other_v > v or (other_v == v and other_i < i):
            v, i = other_v, other_i
        offset //= 2
    return v, i, nan


@cuda.jit(device=True)
def block_best(logits, lo, hi, best_v, best_i, any_nan):
    """(largest of logits[lo:hi], its lowest index, any NaN) over the block, in every thread: one pass, UNROLL loads in
    flight per thread (-inf and no index for an empty slice). best_v, best_i, any_nan: shared [32] float32, int32,
    int32."""
    xs = cuda.local.array(UNROLL, dtype=float32)
    v, i, nan = float32(-math.inf), int32(_NONE), int32(0)
    j = lo + cuda.threadIdx.x
    while j < hi:  # rounds of UNROLL logits a thread, all the loads issued before the first is used
        for u in range(UNROLL):
            xs[u] = logits[j + u * THREADS] if j + u * THREADS < hi else float32(0)
        for u in range(UNROLL):
            if j + u * THREADS < hi:
                v, i, nan = visit(xs[u], j + u * THREADS, v, i, nan)
        j += UNROLL * THREADS
    return block_best_of(v, i, nan, best_v, best_i, any_nan)


@cuda.jit(device=True)
def block_best_of(v, i, nan, best_v, best_i, any_nan):
    """(best value, lowest index of it, any NaN) over the threads' own (v, i, nan), in every thread: by warps, then
    across them through best_v, best_i, any_nan (shared [32] float32, int32, int32)."""
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    v, i, nan = warp_best(v, i, nan)
    if lane == 0:
        best_v[warp], best_i[warp], any_nan[warp] = v, i, nan
    cuda.syncthreads()
    n_warps = THREADS // 32
    v = best_v[lane] if lane < n_warps else float32(-math.inf)
    i = best_i[lane] if lane < n_warps else int32(_NONE)
    nan = any_nan[lane] if lane < n_warps else int32(0)
    v, i, nan = warp_best(v, i, nan)
    cuda.syncthreads()
    return v, i, nan


@cuda.jit(device=True)
def block_sum_i64(v, scratch):
    """The sum of int64 v over the block (exact); every thread gets it. scratch: shared int64[32]."""
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    v = segment_sum(v, 32)
    if lane == 0:
        scratch[warp] = v
    cuda.syncthreads()
    v = scratch[lane] if lane < cuda.blockDim.x // 32 else int64(0)
    v = segment_sum(v, 32)
    cuda.syncthreads()
    return v


@cuda.jit(device=True)
def radix_threshold(logits, weights, low, need, by_weight, hist, state):
    """The largest key t >= low such that the tokens whose keys are >= t count (by_weight False) or weigh (True)
    at least `need`, among the keys >= low: a radix select, 8 bits a round from the top, each round one pass over
    the logits into a shared histogram of RADIX bins (integer atomics: exact whatever their order), then one thread
    walks the bins down to the digit where the running total reaches `need`. hist: shared int64[RADIX]; state:
    shared int64[2]."""
    tid, V = cuda.threadIdx.x, logits.shape[0]
    prefix, fixed, above = uint32(0), uint32(0), int64(0)  # the digits chosen, their bits, the total above them
    for r in range(4):
        shift = uint32(24 - 8 * r)
        for b in range(tid, RADIX, THREADS):
            hist[b] = int64(0)
        cuda.syncthreads()
        for i in range(tid, V, THREADS):
            key = sortable_key(logits[i])
            if key >= low and (key & fixed) == prefix:
                cuda.atomic.add(hist, int32((key >> shift) & uint32(RADIX - 1)), int64(weights[i]) if by_weight
                                else int64(1))
        cuda.syncthreads()
        if tid == 0:
            run, digit = above, 0
            for b in range(RADIX - 1, -1, -1):
                if float64(run + hist[b]) >= need:
                    digit = b
                    break
                run += hist[b]
            state[0], state[1] = int64(prefix | (uint32(digit) << shift)), run
        cuda.syncthreads()
        prefix, above = uint32(state[0]), state[1]
        fixed |= uint32(RADIX - 1) << shift
        cuda.syncthreads()
    return max(prefix, low)


@cuda.jit(device=True)
def exclusive_scan_i64(v, scratch):
    """(sum of v over the threads before this one, sum over the block), int64, exact. scratch: shared int64[32]."""
    lane, warp = cuda.threadIdx.x % 32, cuda.threadIdx.x // 32
    incl = v
    offset = 1
    while offset < 32:  # inclusive scan within the warp
        other = cuda.shfl_up_sync(FULL_MASK, incl, offset)
        if lane >= offset:
            incl += other
        offset *= 2
    if lane == 31:
        scratch[warp] = incl
    cuda.syncthreads()
    before, total = int64(0), int64(0)
    for w in range(cuda.blockDim.x // 32):
        if w < warp:
            before += scratch[w]
        total += scratch[w]
    cuda.syncthreads()
    return before + incl - v, total


@cuda.jit(device=True)
def choose(logits, weights, temperature, top_p, top_k, seed, position):
    """The token at `position` drawn from logits [V] float32 by the rule at the top (NO_TOKEN on a NaN), returned
    to every thread of the block (one block of THREADS; all its threads call). weights: scratch uint64 [V];
    top_p >= 1: off; top_k <= 0 or >= V: off."""
    f_scratch = cuda.shared.array(32, dtype=float32)  # (one line each: the simulator tells shared arrays apart by
    i_scratch = cuda.shared.array(32, dtype=int32)  # the line that declares them)
    n_scratch = cuda.shared.array(32, dtype=int32)
    m, best, nan = block_best(logits, 0, logits.shape[0], f_scratch, i_scratch, n_scratch)
    return draw(logits, weights, temperature, top_p, top_k, seed, position, m, best, nan)


@cuda.jit(device=True)
def draw(logits, weights, temperature, top_p, top_k, seed, position, m, best, nan):
    """`choose` once the largest logit m, its lowest index `best` and whether any logit is a NaN are known (every
    thread of the block holds them): the greedy token, or the draw."""
    i_scratch = cuda.shared.array(32, dtype=int64)
    choice = cuda.shared.array(1, dtype=int32)
    hist = cuda.shared.array(RADIX, dtype=int64)
    state = cuda.shared.array(2, dtype=int64)
    tid, V = cuda.threadIdx.x, logits.shape[0]
    if tid == 0:
        choice[0] = NO_TOKEN
        if nan == 0 and temperature == 0:  # greedy: the lowest id of the largest logit
            choice[0] = best
    if nan == 0 and temperature > 0:
        for i in range(tid, V, THREADS):
            z = (logits[i] - m) / float32(temperature)
            weights[i] = uint64(float64(float32(math.exp(z))) * SCALE)
        cuda.syncthreads()  # the draw reads weights other threads wrote
        low = uint32(0)  # the smallest key kept
        if 0 < top_k < V:  # top-k: the k-th largest key
            low = radix_threshold(logits, weights, low, float64(top_k), False, hist, state)
        if top_p < 1:  # top-p: the largest key whose kept weight reaches top_p of the total
            total = int64(0)
            for i in range(tid, V, THREADS):
                if sortable_key(logits[i]) >= low:
                    total += int64(weights[i])
            need = top_p * float64(block_sum_i64(total, i_scratch))
            low = radix_threshold(logits, weights, low, need, True, hist, state)
        # the draw: thread j owns the ids [j per, (j + 1) per), walked in id order by the thread holding the target
        per = (V + THREADS - 1) // THREADS
        lo, hi = min(tid * per, V), min(tid * per + per, V)
        mine = int64(0)
        for i in range(lo, hi):
            if sortable_key(logits[i]) >= low:
                mine += int64(weights[i])
        before, total = exclusive_scan_i64(mine, i_scratch)
        target = min(int64(uniform_on_device(seed, position) * float64(total)), total - 1)
        if before <= target < before + mine:
            run = before
            for i in range(lo, hi):
                if sortable_key(logits[i]) >= low:
                    run += int64(weights[i])
                    if run > target:
                        choice[0] = int32(i)
                        break
    cuda.syncthreads()
    return choice[0]


def _make_embed_into(to_f32):
    @cuda.jit(device=True)
    def embed_into(table, row, x):
        """x[0] = table[row] in float32 (to_f32 reads the table), by the block's threads."""
        for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            x[0, j] = to_f32(table[row, j])

    return embed_into


_EMBED_INTO = for_weight_dtypes(_make_embed_into)


def embed_into(table):
    """The device function embed_into(table, row, x) for an embedding table of table's dtype."""
    return pick(_EMBED_INTO, table)


@cuda.jit(device=True)
def advance(tok, p, token, position, slot, page_table, page_size, history):
    """The next step's inputs after choosing `tok` for position p + 1, written by thread 0: history[p + 1] = token[0]
    = tok, position[0] = p + 1, slot[0] = its cache row (-1 past the page table)."""
    if cuda.threadIdx.x == 0:
        nxt = p + 1
        history[nxt] = tok
        token[0] = tok
        position[0] = nxt
        slot[0] = page_table[nxt // page_size] * page_size + nxt % page_size \
            if nxt < page_table.shape[0] * page_size else -1


def _make_sample_next(to_f32):
    embed_into = _make_embed_into(to_f32)

    @waits_for_inputs
    @cuda.jit
    def sample_next(logits, weights, temperature_top_p, top_k_seed, token, position, slot, page_table, page_size,
                    history, table, x, part_v, part_i, part_nan, counters):
        """Choose the token after position[0] from logits [V] float32 (`choose`: block b of the B = gridDim.x finds
        the largest logit of the slice [b ceil(V / B), (b + 1) ceil(V / B)) and writes it to part_v, part_i and
        part_nan [B] (float32, int32, int32); the last block to finish (counters[0], zero before the launch and
        after it) reduces the B of them, then draws), then feed the next step:
        history[p + 1] = token[0] = the choice, position[0] = p + 1, slot[0] = its cache row (-1 past the page
        table), and x[0] = table[choice] (its embedding row, as embedding_rows writes it: the next step starts at
        its first layer, no embedding kernel; token 0's row for NO_TOKEN, whose step is never read).

        weights: scratch uint64 [V]; temperature_top_p float64 [2] (top_p >= 1: off); top_k_seed int64 [2] (top_k
        <= 0 or >= V: off); page_table [P] int32, page_size; history int32 [>= p + 2]; table [V, d] float32 or bf16
        bits (to_f32 reads it), x [1, d] float32 (written after the wait: every reader of x, the final norm or the
        logits' kernel, has ended). Grid B <= THREADS (SLICES), blocks of THREADS."""
        inputs_ready()
        f_scratch = cuda.shared.array(32, dtype=float32)
        i_scratch = cuda.shared.array(32, dtype=int32)
        n_scratch = cuda.shared.array(32, dtype=int32)
        V, b, blocks, tid = logits.shape[0], cuda.blockIdx.x, cuda.gridDim.x, cuda.threadIdx.x
        per = (V + blocks - 1) // blocks
        v, i, nan = block_best(logits, min(b * per, V), min(b * per + per, V), f_scratch, i_scratch, n_scratch)
        if tid == 0:
            part_v[b], part_i[b], part_nan[b] = v, i, nan
        if not last_to_arrive(counters, 0, blocks):
            return
        v, i, nan = float32(-math.inf), int32(_NONE), int32(0)
        if tid < blocks:  # one slice's best a thread: indices increase with b, as visit's order asks
            v, i, nan = part_v[tid], part_i[tid], part_nan[tid]
        m, best, nan = block_best_of(v, i, nan, f_scratch, i_scratch, n_scratch)
        p = position[0]
        tok = draw(logits, weights, temperature_top_p[0], temperature_top_p[1], top_k_seed[0], top_k_seed[1], p + 1,
                   m, best, nan)
        embed_into(table, max(tok, 0), x)
        advance(tok, p, token, position, slot, page_table, page_size, history)

    return sample_next


_SAMPLE_NEXT = for_weight_dtypes(_make_sample_next)


def sample_next(table):
    """The sample_next kernel for an embedding table of table's dtype (float32, or bf16 bits in uint16)."""
    return pick(_SAMPLE_NEXT, table)


@waits_for_inputs
@cuda.jit
def sample_rows(logits, weights, temperature_top_p, top_k_seed, positions, tokens):
    """tokens[t] = the token at positions[t] drawn from logits[t] (`choose`) with row t's own settings: a batch of
    sequences sampled at once, one block per row. logits [T, V] float32; weights: scratch uint64 [T, V];
    temperature_top_p float64 [T, 2]; top_k_seed int64 [T, 2]; positions, tokens [T] int32. Grid T, THREADS."""
    inputs_ready()
    t = cuda.blockIdx.x
    tok = choose(logits[t], weights[t], temperature_top_p[t, 0], temperature_top_p[t, 1], top_k_seed[t, 0],
                 top_k_seed[t, 1], positions[t])
    if cuda.threadIdx.x == 0:
        tokens[t] = tok


def feed(tokens: np.ndarray, feed_from: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """NumPy twin of feed_tokens: tokens with tokens[t] = chosen[feed_from[t]] where feed_from[t] >= 0 (0 where that
    is NO_TOKEN: the row's sequence has ended, its row is padding)."""
    out = np.array(tokens, np.int32)
    fed = feed_from >= 0
    ids = chosen[feed_from[fed]]
    out[fed] = np.where(ids == NO_TOKEN, 0, ids)
    return out


@waits_for_inputs
@cuda.jit
def feed_tokens(tokens, feed_from, chosen):
    """tokens[t] = chosen[feed_from[t]] where feed_from[t] >= 0, the others as the host sent them: the first kernel
    of a batched step that the host queued before the step before it had ended (course_lib.batch), each row fed the
    token its sequence's row of that step chose (still on the device) instead of one the host has not seen yet. A
    NO_TOKEN is fed as 0: its sequence ended on a NaN, the row's result is thrown away, and the embedding must not
    read outside its table. tokens, feed_from [T] int32, chosen [R] int32; a thread per row."""
    inputs_ready()
    t = cuda.grid(1)
    if t < tokens.shape[0] and feed_from[t] >= 0:
        tok = chosen[feed_from[t]]
        tokens[t] = 0 if tok == NO_TOKEN else tok


def device_settings(temperature: float, top_k: int | None, top_p: float | None, seed: int) -> tuple[tuple, tuple]:
    """A request's settings as the kernels read them: (temperature, top_p) float64 and (top_k, seed) int64, a top_p
    of 1 and a top_k of 0 standing for none."""
    return (temperature, 1.0 if top_p is None else top_p), (0 if top_k is None else top_k, seed)


def sample_batch(logits, settings, positions, stream=0, rt=None) -> np.ndarray:
    """The next token of each row of logits [T, V] float32 (on the device), row t drawn with settings[t] =
    (temperature, top_k, top_p, seed) (None: off) for the token at positions[t]: sample_rows, then the T ids copied
    to the host (int32; NO_TOKEN for a row with a NaN). The same tokens as `sample` row by row."""
    T, V = logits.shape
    if len(settings) != T or len(positions) != T:
        raise ValueError(f"sample_batch: {T} rows of logits, {len(settings)} settings, {len(positions)} positions")
    encoded = [device_settings(*s) for s in settings]
    floats = np.array([f for f, _ in encoded], np.float64)
    ints = np.array([i for _, i in encoded], np.int64)
    put = cuda.to_device if rt is None else rt.to_device
    tokens = empty(T, np.int32, stream, rt)
    launch(sample_rows, T, THREADS, stream, rt, logits, empty((T, V), np.uint64, stream, rt), put(floats), put(ints),
           put(np.asarray(positions, np.int32)), tokens)
    return tokens.copy_to_host(stream=stream if rt is None else rt.stream)
