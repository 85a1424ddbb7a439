"""The baseline kernels against course_lib.reference (or NumPy), in Numba's CUDA simulator when there is no GPU.

Shapes are tiny (the simulator interprets each CUDA thread in Python) and never multiples of the block or
tile sizes. Weights are tried as float32 and as bf16 (uint16 bits); the reference then sees the widened float32
values, so both sides compute with the same numbers. Every output is filled with NaN (or a sentinel) before the
kernel runs, so an element the kernel forgets to write fails the test. Seed: KERNEL_TEST_SEED (default in checks.py).

On a GPU, the `test_*_real` tests also run every kernel at the real shapes of SmolLM2-135M and Llama-3.2-1B
(skipped in the simulator).
"""

import os

import numpy as np
import pytest
from checks import REAL_MODELS, U32, check, dev, poison, poisoned, randn, real_shapes

from course_lib import by_mode
from course_lib import reference as R
from course_lib.kernels import SIM_SMS, SIMULATOR, completion_counters, cuda, sampling
from course_lib.kernels import attention as attn
from course_lib.kernels import copy as copy_k
from course_lib.kernels import elementwise as ew
from course_lib.kernels import matmul as mm
from course_lib.kernels import narrow as nw
from course_lib.kernels import vector as vec
from course_lib.model.config import LLAMA_32_1B, SMOLLM2_135M, ModelConfig
from course_lib.model.safetensors_io import bf16_to_f32, f32_to_bf16

WEIGHT_DTYPES = ["f32", "bf16"]


def weight(rng, dtype, *shape):
    """(array as stored, its float32 values): float32 as is, or rounded to bf16 and kept as uint16 bits."""
    w = randn(rng, *shape)
    if dtype == "f32":
        return w, w
    bits = f32_to_bf16(w)
    return bits, bf16_to_f32(bits)


def dot_tolerance(a, b, c=2.0):
    """Elementwise bound on |kernel - reference| for a @ b computed in float32 (a [..., K], b [K, N]).

    Each output is a dot product of length K. Summing K rounded products in float32, in any order, errs by at
    most about K * u * sum_i |a_i b_i| (u = 2^-24, the unit roundoff: the classic gamma_K bound of floating-point
    summation). The kernel and the reference each commit such an error, in different orders: hence c = 2.
    """
    return c * a.shape[-1] * U32 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))


def rms_norm_tolerance(want):
    """Bound for rms_norm (rows of d): the sum of d squares errs by <= d u relative, sqrt halves it, the
    divide and multiply add a few u; both sides err."""
    return 2 * (want.shape[-1] + 8) * U32 * np.abs(want)


def rope_tolerance(x):
    """Bound for rope on x [..., hd]: a c - b s is two products and a sum (|c|, |s| <= 1), possibly fused on the
    GPU: a few u of |a| + |b| for both components of each pair (a, b) = (x[..., i], x[..., i + hd/2])."""
    half = x.shape[-1] // 2
    a, b = np.abs(x[..., :half]), np.abs(x[..., half:])
    return 4 * U32 * np.concatenate([a + b] * 2, -1)


def silu_mul_tolerance(want):
    """Bound for silu(gate) * up: exp (<= 2 ulp on the GPU), add, divide, multiply on each side: within 16 u."""
    return 16 * U32 * np.abs(want)


# ---- simulator polyfills ----

@cuda.jit
def _warp_probe(out_xor, out_down, out_bits):
    t = cuda.threadIdx.x
    v = cuda.shfl_xor_sync(0xFFFFFFFF, t, 1)
    cuda.syncwarp()
    out_xor[t] = v
    out_down[t] = cuda.shfl_down_sync(0xFFFFFFFF, t * 10, 2)
    out_bits[t] = cuda.libdevice.int_as_float(0x3F800000 + t)


def test_simulator_polyfills():
    if SIMULATOR:
        from numba.cuda.simulator.kernelapi import FakeCUDAModule

        from course_lib.kernels import _sim

        assert _sim.installed()
        before = {n: FakeCUDAModule.__dict__[n] for n in ("shfl_down_sync", "shfl_xor_sync", "syncwarp")}
        _sim.install()  # idempotent: nothing replaced
        assert all(FakeCUDAModule.__dict__[n] is f for n, f in before.items())
    n = 64  # two full warps (a partial warp with a full mask is undefined on the GPU)
    out_xor, out_down, out_bits = poisoned(n, np.int32), poisoned(n, np.int32), poisoned(n)
    _warp_probe[1, n](out_xor, out_down, out_bits)
    t = np.arange(n)
    np.testing.assert_array_equal(out_xor.copy_to_host(), t ^ 1)
    np.testing.assert_array_equal(out_down.copy_to_host(), np.where(t % 32 < 30, t + 2, t) * 10)  # lanes 30, 31 keep
    np.testing.assert_array_equal(out_bits.copy_to_host(), (0x3F800000 + t).astype(np.uint32).view(np.float32))


@cuda.jit
def _early_leaver(out, leave):
    """Lane `leave` returns before the warp's shuffle; the others need its value: a deadlock on the GPU."""
    t = cuda.threadIdx.x
    if t == leave:
        return
    out[t] = cuda.shfl_xor_sync(0xFFFFFFFF, t, 1)


@pytest.mark.skipif(not SIMULATOR, reason="the simulator's scheduler: a GPU would hang")
def test_the_simulator_names_a_deadlock_at_once():
    """A block whose live threads all wait and none can go on is an error naming them, raised as soon as it
    happens (not after a timeout); the same kernel with every lane present runs."""
    import threading

    out = poisoned(32, np.int32)
    with pytest.raises(threading.BrokenBarrierError, match="every live thread waits"):
        _early_leaver[1, 32](out, 5)
    _early_leaver[1, 32](out, 32)
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(32) ^ 1)



def _butterfly(values, width, op):
    """NumPy: each lane's value after the xor butterfly over aligned segments of `width` lanes (op(own, other))."""
    v = list(values)
    offset = width // 2
    while offset:
        v = [op(v[lane], v[lane ^ offset]) for lane in range(len(v))]
        offset //= 2
    return np.array(v, np.float32)


def _segment_probe(reduce):
    @cuda.jit
    def probe(x, width, out):
        t = cuda.threadIdx.x
        out[t] = reduce(x[t], width)

    return probe


@pytest.mark.parametrize("width", [1, 2, 8, 32])
def test_segment_reductions_follow_the_butterfly(rng, width):
    """segment_sum and segment_max give every lane the bits of the butterfly (its own order of operations); in the
    simulator their twins (one exchange) give the bits of the shuffled versions they replace, even where the order
    of max's operands shows (signed zeros, NaN: Python's max keeps its first operand, the GPU's fmaxf a number)."""
    x = (rng.standard_normal(64) * 2.0 ** rng.integers(-20, 20, 64)).astype(np.float32)

    def run(reduce, values):
        out = poisoned(64)
        _segment_probe(reduce)[1, 64](dev(values), width, out)
        return out.copy_to_host().view(np.uint32)

    for reduce, op in ((ew.segment_sum, lambda a, b: a + b), (ew.segment_max, max)):
        expect = np.concatenate([_butterfly(x[w:w + 32], width, op) for w in (0, 32)])
        np.testing.assert_array_equal(run(reduce, x), expect.view(np.uint32))
    if SIMULATOR:
        x[[3, 40]], x[[4, 41]], x[9] = -0.0, 0.0, np.nan
        for twin, shuffled in ((ew.segment_sum, ew.shuffled_segment_sum), (ew.segment_max, ew.shuffled_segment_max)):
            np.testing.assert_array_equal(run(twin, x), run(shuffled, x))

# ---- matmul.py ----

@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("M,K,N", [(1, 37, 70), (3, 70, 37), (17, 37, 70)])
def test_matmul(rng, M, K, N, dtype):
    a = randn(rng, M, K)
    b, b32 = weight(rng, dtype, K, N)
    got = mm.matmul(dev(a), dev(b), out=poisoned((M, N))).copy_to_host()
    check(got, R.linear(a, b32), dot_tolerance(a, b32))


def test_matmul_two_row_tiles(rng):
    a, b = randn(rng, 65, 20), randn(rng, 20, 5)
    got = mm.matmul(dev(a), dev(b)).copy_to_host()
    check(got, a @ b, dot_tolerance(a, b))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_add_bias(rng, dtype):
    c = randn(rng, 3, 70)
    bias, bias32 = weight(rng, dtype, 70)
    c_dev = dev(c)
    mm.add_bias(c_dev, dev(bias))
    np.testing.assert_array_equal(c_dev.copy_to_host(), c + bias32)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_transpose(rng, dtype):
    x, _ = weight(rng, dtype, 33, 37)
    out = poisoned((37, 33), x.dtype)
    np.testing.assert_array_equal(mm.transpose(dev(x), out=out).copy_to_host(), x.T)


def test_tied_logits_bf16(rng):
    """The baseline logits with tied embeddings: x @ embed.T, with embed.T made by the transpose kernel."""
    embed, embed32 = weight(rng, "bf16", 70, 37)
    x = randn(rng, 2, 37)
    w = R.Weights(embed=embed32, layers=[], final_norm=np.ones(37, np.float32), lm_head=None)
    got = mm.matmul(dev(x), mm.transpose(dev(embed)), out=poisoned((2, 70))).copy_to_host()
    check(got, R.logits(x, w), dot_tolerance(x, embed32.T))


# ---- elementwise.py ----

@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_embedding(rng, dtype):
    table, table32 = weight(rng, dtype, 50, 37)
    ids = np.array([49, 0, 17, 17], np.int32)
    got = ew.embedding(dev(table), dev(ids), out=poisoned((4, 37))).copy_to_host()
    np.testing.assert_array_equal(got, R.embedding(table32, ids))


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
def test_rms_norm(rng, dtype):
    d = 37
    x = randn(rng, 3, d) * np.array([[0.01], [1.0], [30.0]], np.float32)
    w, w32 = weight(rng, dtype, d)
    got = ew.rms_norm(dev(x), dev(w), 1e-5, out=poisoned((3, d))).copy_to_host()
    want = R.rms_norm(x, w32, 1e-5)
    check(got, want, rms_norm_tolerance(want))


def test_rms_norm_in_place(rng):
    x, w = randn(rng, 2, 37), randn(rng, 37)
    x_dev = dev(x)
    ew.rms_norm(x_dev, dev(w), 1e-6, out=x_dev)
    want = R.rms_norm(x, w, 1e-6)
    check(x_dev.copy_to_host(), want, rms_norm_tolerance(want))


@pytest.mark.parametrize("heads", [1, 3])
def test_rope(rng, heads):
    config = ModelConfig("llama", vocab_size=8, d_model=10 * heads, n_layers=1, n_heads=heads, n_kv_heads=1,
                         d_ff=8, max_seq_len=32)
    cos, sin = R.rope_tables(config, 32)
    positions = np.array([3, 31, 7], np.int32)
    x = randn(rng, 3, heads, 10)
    x_dev = dev(x)
    ew.rope(x_dev, dev(cos), dev(sin), dev(positions))
    check(x_dev.copy_to_host(), R.rope(x, cos[positions], sin[positions]), rope_tolerance(x))


def test_silu_mul(rng):
    gate, up = randn(rng, 3, 70, scale=4.0), randn(rng, 3, 70)
    got = ew.silu_mul(dev(gate), dev(up), out=poisoned((3, 70))).copy_to_host()
    want = R.swiglu(gate, up)
    check(got, want, silu_mul_tolerance(want))


def check_add(rng, T, d):
    """add of two [T, d] arrays into a new array and in place: exactly a + b."""
    a, b = randn(rng, T, d), randn(rng, T, d)
    got = ew.add(dev(a), dev(b), out=poisoned((T, d))).copy_to_host()
    np.testing.assert_array_equal(got, a + b)
    a_dev = dev(a)
    ew.add(a_dev, dev(b), out=a_dev)  # the residual add in place
    np.testing.assert_array_equal(a_dev.copy_to_host(), a + b)


def test_add(rng):
    check_add(rng, 3, 37)


# ---- attention.py ----

def attention_tolerance(q, k, v, positions, c=2.0):
    """Bound on |kernel - exact| for attention, per output element.

    A score q.k * scale over hd terms errs by delta <= (hd + 2) u scale sum_d |q_d k_d| (dot product bound);
    p = exp(score - max) then has relative error about 2 delta + 2 u (the max carries the same kind of error),
    and the normalized sum of n terms p_j v_j / l adds (n + 4) u relative to sum_j p_j |v_j| / l <= max |v|.
    """
    T, H, hd = q.shape
    S, Hkv, _ = k.shape
    kv = np.arange(H) // (H // Hkv)
    abs_scores = np.einsum("thd,shd->ths", np.abs(q), np.abs(k[:, kv])) / np.sqrt(hd)  # [T, H, S]
    visible = np.arange(S)[None, None, :] <= positions[:, None, None]
    delta = (hd + 2) * U32 * np.where(visible, abs_scores, 0).max(-1)  # [T, H]
    n = (positions + 1)[:, None]
    vmax = np.abs(v[:, kv]).max(axis=(0, 2))[None, :]  # [1, H]
    return (c * (2 * delta + (n + 6) * U32) * vmax)[..., None]


@pytest.mark.parametrize("T,H,Hkv,hd,S,positions", [
    (2, 4, 2, 8, 20, [18, 19]),  # prefill of 2 tokens, GQA groups of 2
    (1, 2, 1, 6, 300, [299]),  # decode over a cache longer than a block (3 chunks of keys)
    (2, 2, 2, 130, 5, [2, 4]),  # MHA, head_dim above the block size, cache rows past the position ignored
])
def test_attention(rng, T, H, Hkv, hd, S, positions):
    check_attention(rng, T, H, Hkv, hd, S, positions)


def check_attention(rng, T, H, Hkv, hd, S, positions):
    """attention of random q [T, H, hd] over a random cache k, v [S, Hkv, hd] against the float64 reference."""
    q, k, v = randn(rng, T, H, hd), randn(rng, S, Hkv, hd), randn(rng, S, Hkv, hd)
    positions = np.array(positions, np.int32)
    got = attn.attention(dev(q), dev(k), dev(v), dev(positions), out=poisoned((T, H, hd))).copy_to_host()
    want = R.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), positions)
    check(got, want, attention_tolerance(q, k, v, positions))


# ---- sampling.py ----

def _sample_on_device(logits, temperature=0.0, top_k=None, top_p=None, seed=0, position=1):
    """sample_next on logits (a copy on the device) for the token at `position`: (the token, the advanced inputs
    token, position, slot, history[position], and x, the chosen token's row of an embedding table of random bf16
    bits (token 0's for NO_TOKEN)), every output poisoned first."""
    V, d = logits.size, sampling.THREADS + 5  # the block's threads write x[0] in two rounds
    token, pos, slot = poisoned(1, np.int32), dev(np.array([position - 1], np.int32)), poisoned(1, np.int32)
    history, x = poisoned(position + 2, np.int32), poisoned((1, d))
    settings = dev(np.array([temperature, 1.0 if top_p is None else top_p]))
    top_k_seed = dev(np.array([top_k or 0, seed], np.int64))
    table = dev(np.array([5, 2, 7], np.int32))
    bits = np.random.default_rng([V, position, seed]).integers(0, 0x7F80, (V, d), dtype=np.uint16)  # finite bf16
    embed = dev(bits | np.uint16(0x8000) * (bits & 1))  # both signs
    slices = sampling.SLICES
    parts = poisoned(slices), poisoned(slices, np.int32), poisoned(slices, np.int32)  # each block's best, its NaN
    counters = dev(np.zeros(1, np.int32))
    sampling.sample_next(embed)[slices, sampling.THREADS](dev(logits), cuda.device_array(V, np.uint64), settings,
                                                          top_k_seed, token, pos, slot, table, 4, history, embed, x,
                                                          *parts, counters)
    assert counters.copy_to_host()[0] == 0, "the last block leaves its counter at zero for the next launch"
    tok = int(token.copy_to_host()[0])
    assert pos.copy_to_host()[0] == position and history.copy_to_host()[position] == tok
    want_slot = table.copy_to_host()[position // 4] * 4 + position % 4 if position < 12 else -1
    assert slot.copy_to_host()[0] == want_slot
    np.testing.assert_array_equal(x.copy_to_host()[0], bf16_to_f32(embed.copy_to_host()[max(tok, 0)]))
    return tok


@pytest.mark.parametrize("V", [1, 37, 1000])
def test_argmax_random(rng, V):
    logits = randn(rng, V)
    assert _sample_on_device(logits) == int(np.argmax(logits))


@pytest.mark.parametrize("ties", [[900, 261, 517, 5], [256, 33], [999, 998], [600, 999]])  # same thread; warp 0 vs
# warp 1; within the last slice of sample_next's blocks; the last block's slice and another's (SLICES >= 2 slices)
def test_argmax_ties_lowest_index(rng, ties):
    logits = randn(rng, 1000)
    logits[ties] = 10.0
    assert _sample_on_device(logits, position=12) == min(ties)  # position 12: the first past the page table, slot -1


@pytest.mark.parametrize("where", [0, 499, 500, 999])  # the first and the last logit of the slices (two or more)
def test_argmax_at_the_edges_of_the_slices(rng, where):
    logits = randn(rng, 1000)
    logits[where] = 10.0
    assert _sample_on_device(logits) == where
    logits[where] = np.nan  # a NaN in any one slice: no token
    assert _sample_on_device(logits) == sampling.NO_TOKEN


def test_argmax_nan_and_inf(rng):
    logits = randn(rng, 300)
    logits[123] = np.nan
    assert _sample_on_device(logits) == sampling.NO_TOKEN
    assert _sample_on_device(logits, temperature=1.0) == sampling.NO_TOKEN
    assert _sample_on_device(np.full(40, -np.inf, np.float32)) == 0


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8),
                                                     (1.0, 10, 0.5), (0.5, 1, None)])
def test_sampler_kernel_equals_its_twin(rng, temperature, top_k, top_p):
    """The kernel draws the twin's token (kernels.sampling.sample) for fresh logits, seeds and positions. In the
    simulator both compute exp in float64 and round it: equal bit for bit. On a GPU expf differs from it by an ulp
    now and then, which moves a draw only when the target falls within that of a boundary between two tokens."""
    for _ in range(3 if SIMULATOR else 50):
        logits = randn(rng, by_mode(49152, 300), scale=3.0)
        seed, position = int(rng.integers(0, 2**63)), int(rng.integers(1, 12))
        assert _sample_on_device(logits, temperature, top_k, top_p, seed, position) == \
            sampling.sample(logits, temperature, top_k, top_p, seed, position)


def test_top_p_keeps_the_prefix_that_reaches_it():
    """top-p keeps the smallest set of likeliest tokens whose weight reaches top_p, the boundary included: logits
    0, ln 1/2, ln 1/2 weigh exactly 2^32, 2^31, 2^31 (exp rounded to float32 is 1/2), so token 0 alone holds half
    the total. At top_p = 0.5 every draw is token 0; a hair above, the tied pair joins."""
    logits = np.array([0, np.log(0.5), np.log(0.5)], np.float32)
    assert {sampling.sample(logits, 1.0, None, 0.5, seed, 1) for seed in range(40)} == {0}
    assert {sampling.sample(logits, 1.0, None, 0.5 + 1e-9, seed, 1) for seed in range(40)} == {0, 1, 2}
    if SIMULATOR:  # there the kernel's exp is the twin's (float64, rounded); a GPU's expf may be an ulp off this tie
        assert {_sample_on_device(logits, 1.0, None, 0.5, seed, 1) for seed in range(6)} == {0}


def _seed_drawing(u_bits: int, position: int) -> int:
    """A seed below 2^63 (the kernel takes it as an int64) whose uniform(seed, position) is u_bits * 2^-53 exactly:
    splitmix64's mixer run backwards (each xorshift undone by repeating it, each product by the constant's inverse
    mod 2^64) from each of the 2^11 hashes that give those 53 bits, until one gives such a seed."""
    m64 = (1 << 64) - 1

    def unshift(y, s):
        x = y
        for _ in range(64 // s + 1):
            x = y ^ (x >> s)
        return x

    def unmix(z):
        z = unshift(z, 31) * pow(sampling._MIX2, -1, 1 << 64) & m64
        z = unshift(z, 27) * pow(sampling._MIX1, -1, 1 << 64) & m64
        return unshift(z, 30)

    seed = next(seed for low in range(1 << 11)
                if (seed := unmix((unmix(u_bits << 11 | low) - position * sampling._GOLDEN) & m64)) < 1 << 63)
    assert sampling.uniform(seed, position) == u_bits * 2.0**-53
    return seed


def test_draw_on_a_boundary_inside_a_thread():
    """The draw takes the first token whose running weight exceeds the target: tokens 0 and 1 weigh 2^32 each
    (logit 0; the others -200, weight 0), and a seed whose uniform is exactly 1/2 gives target 2^32, the first unit of
    token 1. Both tokens are one thread's (V = 2 THREADS ids, two a thread), so the walk inside a thread decides."""
    logits = np.full(2 * sampling.THREADS, -200.0, np.float32)
    logits[:2] = 0
    seed = _seed_drawing(1 << 52, position=1)
    assert sampling.sample(logits, 1.0, None, None, seed, 1) == 1
    assert _sample_on_device(logits, 1.0, None, None, seed, 1) == 1


def test_top_p_within_top_k():
    """top-p applies to the tokens top-k keeps, its total included: logits 0, ln 1/2, -5, -6, -7 with top_k = 2 keep
    weights 1 and 1/2; top_p = 0.7 of their 1.5 needs both (token 0 alone holds 2/3). A total over the kept tokens
    without the k-th would need 0.7 of 1 and keep token 0 alone."""
    logits = np.array([0, np.log(0.5), -5, -6, -7], np.float32)
    assert {sampling.sample(logits, 1.0, 2, 0.7, seed, 1) for seed in range(20)} == {0, 1}
    assert {_sample_on_device(logits, 1.0, 2, 0.7, seed, 1) for seed in range(by_mode(20, 12))} == {0, 1}


@pytest.mark.skipif(not SIMULATOR, reason="on a GPU the blocks have their full size in every test")
def test_block_reductions_across_warps_in_the_simulator(rng, monkeypatch):
    """The simulator's sampler and norm blocks are one warp (kernels.sized), so there their reductions across warps
    (shared scratch, a second round of shuffles, the scan's sums of the warps before) add one term. The simulator
    reads a module's constants as the kernel runs: with three warps a block, the sampler draws its twin's token
    (cut into the same 96 ranges of ids) and the norm stays within its bound."""
    monkeypatch.setattr(sampling, "THREADS", 96)
    monkeypatch.setattr(ew, "NORM_THREADS", 96)
    for temperature, top_k, top_p in ((0.0, None, None), (0.8, 50, None), (1.0, None, 0.9), (0.7, 20, 0.5)):
        logits = randn(rng, 300, scale=3.0)
        seed, position = int(rng.integers(0, 2**63)), int(rng.integers(1, 12))
        assert _sample_on_device(logits, temperature, top_k, top_p, seed, position) == \
            sampling.sample(logits, temperature, top_k, top_p, seed, position, threads=96)
    x = randn(rng, 3, 200) * np.array([[0.01], [1.0], [30.0]], np.float32)
    w, w32 = weight(rng, "f32", 200)
    want = R.rms_norm(x, w32, 1e-5)
    check(ew.rms_norm(dev(x), dev(w), 1e-5, out=poisoned((3, 200))).copy_to_host(), want, rms_norm_tolerance(want))


def test_feed_tokens_feeds_each_row_the_token_its_source_chose(rng):
    """feed_tokens (the first kernel of a pipelined batched step): a row with a source row takes the token that row
    chose (0 for NO_TOKEN), the others keep the token the host sent; the NumPy twin gives the same ids. 70 rows: more
    than one block."""
    T, R = 70, 64
    sent = rng.integers(0, 49152, T).astype(np.int32)
    sources = np.where(rng.random(T) < 0.7, rng.integers(0, R, T), -1).astype(np.int32)
    chosen = rng.integers(0, 49152, R).astype(np.int32)
    chosen[sources[sources >= 0][0]] = sampling.NO_TOKEN
    tokens = dev(sent)
    sampling.feed_tokens[2, 64](tokens, dev(sources), dev(chosen))
    want = sampling.feed(sent, sources, chosen)
    assert tokens.copy_to_host().tolist() == want.tolist()
    assert (want[sources < 0] == sent[sources < 0]).all() and 0 in want[sources >= 0]
    assert (want[sources >= 0] == np.where(chosen == sampling.NO_TOKEN, 0, chosen)[sources[sources >= 0]]).all()
    tokens = dev(np.array([7, 8, 9], np.int32))  # source row 0 is a row like any other
    sampling.feed_tokens[1, 64](tokens, dev(np.array([0, 1, -1], np.int32)), dev(np.array([40, 41], np.int32)))
    assert tokens.copy_to_host().tolist() == [40, 41, 9]


def test_sample_batch_draws_each_rows_token(rng):
    """sample_batch (one block per row, each row its own settings and position) gives every row the twin's token:
    greedy, sampled with top-k or top-p, and a row with a NaN (NO_TOKEN); the output poisoned first."""
    V = by_mode(49152, 300)
    settings = [(0.0, None, None, 1), (1.0, None, None, 7), (0.7, 5, None, 2**62), (1.3, None, 0.8, 11),
                (0.0, None, None, 3)]
    logits = randn(rng, len(settings), V, scale=3.0)
    logits[4, 17] = np.nan
    positions = rng.integers(1, 500, len(settings)).astype(np.int32)
    got = sampling.sample_batch(dev(logits), settings, positions)
    want = [sampling.sample(row, *s, position=int(p)) for row, s, p in zip(logits, settings, positions, strict=True)]
    assert got.tolist() == want and want[4] == sampling.NO_TOKEN
    with pytest.raises(ValueError, match="settings"):
        sampling.sample_batch(dev(logits), settings[:2], positions)


@pytest.mark.skipif(SIMULATOR, reason="many draws: a GPU test (the twin's distribution is tested on the host)")
def test_sampler_kernel_distribution(rng):
    """On fixed logits, the kernel's draws over 4,000 positions match the softmax (chi-square, 9 degrees of freedom:
    27.88 is exceeded with probability 0.001 by a correct sampler); top-k never draws outside its set."""
    p = rng.dirichlet(np.ones(10))
    logits = np.log(p).astype(np.float32)
    n = 4000
    counts = np.bincount([_sample_on_device(logits, 1.0, None, None, 5, pos) for pos in range(1, n + 1)], minlength=10)
    assert ((counts - n * p) ** 2 / (n * p)).sum() < 27.88, counts
    top3 = set(np.argsort(-p)[:3])
    assert {_sample_on_device(logits, 1.0, 3, None, 9, pos) for pos in range(1, 300)} <= top3


# ---- copy.py ----

@pytest.mark.parametrize("blocks", [None, 1, 3])
def test_copy(rng, blocks):
    src = randn(rng, 1000)
    got = copy_k.copy(dev(src), dst=poisoned(1000), blocks=blocks).copy_to_host()
    np.testing.assert_array_equal(got, src)


def test_read(rng):
    """Thread g sums the 8-element groups g, g + S, ... (S threads): small integers make every sum exact, so the
    per-thread sums must equal NumPy's, whatever the order; 5 or 6 groups per thread take both loops."""
    S = copy_k.THREADS
    src = rng.integers(-8, 9, 8 * (5 * S + 37)).astype(np.float32)
    got = copy_k.read(dev(src), blocks=1, out=poisoned(S)).copy_to_host()
    groups = src.reshape(-1, 8).sum(axis=1)
    np.testing.assert_array_equal(got, [groups[g::S].sum() for g in range(S)])
    with pytest.raises(ValueError, match="multiple of 8"):
        copy_k.read(dev(src[:-3]))


def test_graph_errors_are_clear():
    """No graph in the simulator; on a GPU, none on the default stream (it cannot be captured)."""
    from course_lib.gpu.graphs import Graph

    with pytest.raises(RuntimeError if SIMULATOR else ValueError, match="need a GPU" if SIMULATOR else "default"):
        Graph(lambda: None, cuda.default_stream())


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU")
def test_graph_replays_the_captured_launches(rng):
    """Capture runs nothing; each replay runs the captured kernels again, on the arrays' current contents."""
    from course_lib.gpu.graphs import Graph

    stream = cuda.stream()
    src, mid, dst = dev(randn(rng, 4096)), poisoned(4096), poisoned(4096)
    graph = Graph(lambda: (copy_k.copy(src, mid, stream=stream), copy_k.copy(mid, dst, stream=stream)), stream)
    assert np.isnan(dst.copy_to_host()).all()
    for _ in range(2):
        fresh = randn(rng, 4096)
        src.copy_to_device(fresh)
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(dst.copy_to_host(), fresh)


class _CountingRuntime:
    """The part of course_lib.gpu.runtime.Runtime the wrappers use: empty() and launch(name, kernel, grid, block)."""

    def __init__(self):
        self.launched, self.allocations = [], 0

    def empty(self, shape, dtype=np.float32, name=None):
        self.allocations += 1
        return cuda.device_array(shape, dtype)

    def launch(self, name, kernel, grid, block, *args):
        self.launched.append(name)
        kernel[grid, block](*args)

    def split_k_scratch(self, partial_shape, groups):
        return nw.partial_sums(partial_shape), completion_counters(groups)


def test_cached_views_follow_their_array(rng):
    """A view is made once per array and shape and sees the array's current contents; its cache entry goes when
    the array dies, so a later array (which may reuse the id) gets a view of its own."""
    from course_lib.kernels import _VIEWS, reshaped

    x = dev(randn(rng, 6, 4))
    flat = reshaped(x, -1)
    assert reshaped(x, -1) is flat and reshaped(x, 3, 8) is not flat and reshaped(x, 3, 8).shape == (3, 8)
    fresh = randn(rng, 6, 4)
    x.copy_to_device(fresh)
    np.testing.assert_array_equal(flat.copy_to_host(), fresh.reshape(-1))
    key = (id(x), (-1,))
    del x, flat
    assert key not in _VIEWS
    y = dev(np.arange(24, dtype=np.float32).reshape(6, 4))
    np.testing.assert_array_equal(reshaped(y, -1).copy_to_host(), np.arange(24))


def test_wrappers_launch_through_a_runtime(rng):
    rt, src = _CountingRuntime(), randn(rng, 300)
    got = copy_k.copy(dev(src), rt=rt).copy_to_host()
    np.testing.assert_array_equal(got, src)
    assert rt.launched == ["copy_grid_stride"] and rt.allocations == 1


# ---- real shapes of SmolLM2-135M and Llama-3.2-1B (GPU only) ----
#
# Every kernel at the shapes a forward pass of the two models gives it. The CPU side dominates the time: weights
# are drawn once per shape and the float64 reference is computed once, for the most rows, then sliced.

REAL_M = (1, 16, 64 + 7)  # rows of a matmul: one token (decode), a few, past one 64-row tile of the GPU matmul
REAL_T = [1, 100]  # tokens in a pass: decode, prefill
REAL_PROJECTIONS = [  # (K, N) = (in, out) of wq and wo, wk and wv, w_gate and w_up, w_down
    (576, 576), (576, 192), (576, 1536), (1536, 576),  # SmolLM2-135M
    (2048, 2048), (2048, 512), (2048, 8192), (8192, 2048),  # Llama-3.2-1B
]
ROPE_POSITIONS = 8192  # rows of the RoPE tables: positions 0..8191


def test_real_shapes_are_the_models():
    """The explicit shapes above are those of the two configs (runs everywhere)."""
    shapes = []
    for c in (SMOLLM2_135M, LLAMA_32_1B):
        shapes += [(c.d_model, c.d_model), (c.d_model, c.d_kv), (c.d_model, c.d_ff), (c.d_ff, c.d_model)]
    assert shapes == REAL_PROJECTIONS
    assert [(c.vocab_size, c.n_heads, c.n_kv_heads, c.head_dim) for c in (SMOLLM2_135M, LLAMA_32_1B)] == [
        (49152, 9, 3, 64), (128256, 32, 8, 64)]


def check_matmul_rows(a, b_dev, b32, want, what):
    """matmul(a[:M], b) for each M of REAL_M, against rows :M of want (the float64 reference for all of a)."""
    tol = dot_tolerance(a, b32)
    for M in REAL_M:
        got = mm.matmul(dev(a[:M]), b_dev, out=poisoned((M, b32.shape[1]))).copy_to_host()
        check(got, want[:M], tol[:M], f"{what}, M={M}")


@real_shapes
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("K,N", REAL_PROJECTIONS)
def test_matmul_real(rng, K, N, dtype):
    a = randn(rng, max(REAL_M), K)
    b, b32 = weight(rng, dtype, K, N)
    want = R.linear(a.astype(np.float64), b32.astype(np.float64))
    check_matmul_rows(a, dev(b), b32, want, f"[M, {K}] @ [{K}, {N}] {dtype}")


@real_shapes
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("tied", [True, False], ids=["embed.T", "lm_head"])
def test_logits_real(rng, tied, dtype):
    """SmolLM2's logits [M, 49152]: x @ embed.T, the [49152, 576] table transposed by the transpose kernel into a
    poisoned [576, 49152] array (tied), or x @ a [576, 49152] lm_head (direct)."""
    V, d = SMOLLM2_135M.vocab_size, SMOLLM2_135M.d_model
    x = randn(rng, max(REAL_M), d)
    final_norm = np.ones(d, np.float32)
    if tied:
        embed, embed32 = weight(rng, dtype, V, d)
        w_dev, w32 = mm.transpose(dev(embed), out=poisoned((d, V), embed.dtype)), embed32.T
        w64 = R.Weights(embed=embed32.astype(np.float64), layers=[], final_norm=final_norm, lm_head=None)
    else:
        head, w32 = weight(rng, dtype, d, V)
        w_dev = dev(head)
        w64 = R.Weights(embed=None, layers=[], final_norm=final_norm, lm_head=w32.astype(np.float64))
    check_matmul_rows(x, w_dev, w32, R.logits(x.astype(np.float64), w64), f"logits {'tied' if tied else 'lm_head'}")


@real_shapes
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("config", REAL_MODELS)
def test_embedding_real(rng, config, dtype):
    """The whole [V, d] table, poisoned except the rows looked up: reading a wrong row brings NaN."""
    V, d = config.vocab_size, config.d_model
    ids = np.concatenate([[V - 1, 0, 17, 17], rng.integers(0, V, max(REAL_T))])[:max(REAL_T)].astype(np.int32)
    rows, inverse = np.unique(ids, return_inverse=True)
    stored, values32 = weight(rng, dtype, len(rows), d)
    table = np.full((V, d), poison(stored.dtype), stored.dtype)
    table[rows] = stored
    table_dev = dev(table)
    for T in REAL_T:  # ids[:1] is the last row
        got = ew.embedding(table_dev, dev(ids[:T]), out=poisoned((T, d))).copy_to_host()
        np.testing.assert_array_equal(got, R.embedding(values32, inverse[:T]), err_msg=f"T={T}")


@real_shapes
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("config", REAL_MODELS)
@pytest.mark.parametrize("T", REAL_T)
def test_rms_norm_real(rng, T, config, dtype):
    d = config.d_model
    x = randn(rng, T, d) * np.geomspace(0.01, 30, T, dtype=np.float32)[:, None]  # rows from small to large
    w, w32 = weight(rng, dtype, d)
    got = ew.rms_norm(dev(x), dev(w), config.rms_eps, out=poisoned((T, d))).copy_to_host()
    want = R.rms_norm(x, w32, config.rms_eps)
    check(got, want, rms_norm_tolerance(want))


@real_shapes
@pytest.mark.parametrize("config", REAL_MODELS)
@pytest.mark.parametrize("T", REAL_T)
def test_rope_real(rng, T, config):
    """q [T, H, 64] and k [T, Hkv, 64] rotated at positions up to 8191 (the first is 8191, the second 0)."""
    cos, sin = R.rope_tables(config, ROPE_POSITIONS)
    cos_dev, sin_dev = dev(cos), dev(sin)
    positions = np.concatenate([[ROPE_POSITIONS - 1, 0], rng.integers(0, ROPE_POSITIONS, T)])[:T].astype(np.int32)
    c64, s64 = cos[positions].astype(np.float64), sin[positions].astype(np.float64)
    for heads in (config.n_heads, config.n_kv_heads):
        x = randn(rng, T, heads, config.head_dim)
        x_dev = dev(x)
        ew.rope(x_dev, cos_dev, sin_dev, dev(positions))
        check(x_dev.copy_to_host(), R.rope(x.astype(np.float64), c64, s64), rope_tolerance(x), f"{heads} heads")


@real_shapes
@pytest.mark.parametrize("config", REAL_MODELS)
@pytest.mark.parametrize("T", REAL_T)
def test_silu_mul_real(rng, T, config):
    gate, up = randn(rng, T, config.d_ff, scale=4.0), randn(rng, T, config.d_ff)
    got = ew.silu_mul(dev(gate), dev(up), out=poisoned((T, config.d_ff))).copy_to_host()
    want = R.swiglu(gate.astype(np.float64), up.astype(np.float64))
    check(got, want, silu_mul_tolerance(want))


@real_shapes
@pytest.mark.parametrize("config", REAL_MODELS)
@pytest.mark.parametrize("T", REAL_T)
def test_add_real(rng, T, config):
    check_add(rng, T, config.d_model)


@real_shapes
@pytest.mark.parametrize("config", REAL_MODELS)
@pytest.mark.parametrize("T,S", [(1, 1), (1, 17), (1, 1000), (1, 4096), (100, 100)])
def test_attention_real(rng, T, S, config):
    """Decode (T = 1 at position S - 1, a cache of S) and a prefill of T = 100 tokens at positions 0..99."""
    check_attention(rng, T, config.n_heads, config.n_kv_heads, config.head_dim, S, np.arange(S - T, S))


@real_shapes
@pytest.mark.parametrize("V", [49152, 128256])
def test_argmax_real(rng, V):
    logits = randn(rng, V)
    assert _sample_on_device(logits) == int(np.argmax(logits))
    logits[V - 1] = logits.max() + 1  # the last element wins
    assert _sample_on_device(logits) == V - 1
    logits[12345] = logits[V - 1]  # a tie: the lower index wins
    assert _sample_on_device(logits) == 12345


# ---- every kernel compiles for the H200 (sm_90), even without a GPU ----

_PTX_SCRIPT = r'''
import importlib.util, os, re, shutil, subprocess, sys, tempfile
spec = importlib.util.spec_from_file_location("course_lib.device", "course_lib/device.py")
device = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device)
device.gpu_available = lambda: True  # compile for the real CUDA target, not the simulator
sys.modules["course_lib.device"] = device
import numpy as np
from course_lib.kernels import cuda
if cuda.config.ENABLE_CUDASIM:
    sys.exit("SKIP: the simulator was selected anyway")
import numba.cuda.cuda_paths as paths
import numba.cuda.cudadrv.nvrtc as nvrtc
import numba.cuda.dispatcher as dispatcher
nvrtc.get_arch_option = lambda major, minor: f"compute_{major}{minor}"  # no NVRTC needed to name the arch
_nvrtc_path = paths._get_nvrtc_path
def _nvrtc_or_none():
    try:
        return _nvrtc_path()
    except Exception:
        return None
paths._get_nvrtc_path = _nvrtc_or_none
class _H200:
    compute_capability = (9, 0)
dispatcher.get_current_device = lambda: _H200()  # device functions compile for "the current device"
try:
    cuda.compile_ptx(lambda a: None, "void(float32[::1])", cc=(9, 0))
except Exception as e:
    print(f"SKIP: no NVVM/libdevice to compile with ({type(e).__name__})")
    sys.exit(0)
from course_lib.kernels import attention, copy, elementwise, fused, matmul, narrow, paged_attention, row_dot, sampling
F1, F2, F3, I1 = "float32[::1]", "float32[:, ::1]", "float32[:, :, ::1]", "int32[::1]"
jobs = [
    ("rope_pairs", elementwise.rope_pairs, f"void({F3}, {F2}, {F2}, {I1})"),
    ("silu_mul_flat", elementwise.silu_mul_flat, f"void({F1}, {F1}, {F1})"),
    ("add_flat", elementwise.add_flat, f"void({F1}, {F1}, {F1})"),
    ("attention_two_pass", attention.attention_two_pass, f"void({F3}, {F3}, {F3}, {I1}, float32, {F3})"),
    ("sample_next", sampling.sample_next(np.zeros(1, np.uint16)), f"void({F1}, uint64[::1], float64[::1], "
     f"int64[::1], {I1}, {I1}, {I1}, {I1}, int64, {I1}, uint16[:, ::1], {F2}, {F1}, {I1}, {I1}, {I1})"),
    ("feed_tokens", sampling.feed_tokens, f"void({I1}, {I1}, {I1})"),
    ("sample_rows", sampling.sample_rows, f"void({F2}, uint64[:, ::1], float64[:, ::1], int64[:, ::1], {I1}, {I1})"),
    ("copy_grid_stride", copy.copy_grid_stride, f"void({F1}, {F1})"),
]
for dtype in (np.float32, np.uint16):
    w1, w2, dt = f"{np.dtype(dtype).name}[::1]", f"{np.dtype(dtype).name}[:, ::1]", np.dtype(dtype)
    jobs += [
        (f"matmul_tiled[{dt}]", matmul._MATMUL[dt], f"void({F2}, {w2}, {F2})"),
        (f"add_bias_rows[{dt}]", matmul._ADD_BIAS[dt], f"void({F2}, {w1})"),
        (f"transpose_tiled[{dt}]", matmul._TRANSPOSE[dt], f"void({w2}, {w2})"),
        (f"embedding_rows[{dt}]", elementwise._EMBEDDING[dt], f"void({w2}, {I1}, {F2})"),
        (f"rms_norm_rows[{dt}]", elementwise._RMS_NORM[dt], f"void({F2}, {w1}, float32, {F2})"),
        (f"swiglu_tiled_two_passes[{dt}]", fused._TWO_PASSES[dt], f"void({F2}, {w2}, {w2}, {F2})"),
        (f"swiglu_tiled_interleaved[{dt}]", fused._INTERLEAVED[dt], f"void({F2}, {w2}, {F2})"),
    ]
for rows in (1, narrow.KERNEL_ROWS, narrow.MAX_ROWS):  # the narrow kernels, one per (R, weight kind)
    for kind, w2 in (("f32", F2), ("bf16", "uint16[:, ::1]"), ("f32x8", "uint32[::1]"), ("bf16x8", "uint32[::1]")):
        for bias, b1 in (("f32", F1), ("bf16", "uint16[::1]")) if rows <= narrow.KERNEL_ROWS else ():
            jobs.append((f"split_k[{kind}, R={rows}, bias {bias}]", narrow.kernel_for("split_k", kind, rows, bias),
                         f"void({F2}, {F1}, float32, {w2}, {b1}, {F3}, {I1}, {F2})"))
        if rows <= narrow.KERNEL_ROWS:  # out += a @ b: the residual added in the reduction
            jobs.append((f"split_k_add[{kind}, R={rows}]", narrow.kernel_for("split_k", kind, rows, "f32", True),
                         f"void({F2}, {F1}, float32, {w2}, {F1}, {F3}, {I1}, {F2})"))
        if rows == narrow.KERNEL_ROWS:  # a block per chunk of rows (a batch's)
            jobs.append((f"split_k_chunked[{kind}]", narrow.kernel_for("split_k", kind, rows, chunked=True),
                         f"void({F2}, {F1}, float32, {w2}, {F1}, {F3}, {I1}, {F2})"))
        if rows <= narrow.KERNEL_ROWS and kind.endswith("x8"):  # the fused projections (kernels/fused.py)
            jobs.append((f"split_k_norm[{kind}, R={rows}]", narrow.kernel_for("split_k", kind, rows, normed=True),
                         f"void({F2}, {F1}, float32, {w2}, {F1}, {F3}, {I1}, {F2})"))
            jobs.append((f"qkv_rope[{kind}, R={rows}]", fused.qkv_rope_kernel(rows, kind, "f32", True, np.float32, 64),
                         f"void({F2}, {F1}, float32, {w2}, {F1}, {F3}, {I1}, {F2}, {F2}, {F3}, {F3}, {I1}, {I1}, "
                         f"{F2})"))
            jobs.append((f"gate_up_swiglu[{kind}, R={rows}]", fused.gate_up_kernel(rows, kind, "f32", True),
                         f"void({F2}, {F1}, float32, {w2}, {F1}, {F3}, {I1}, {F2})"))
        if rows == narrow.KERNEL_ROWS and kind.endswith("x8"):
            jobs.append((f"qkv_rope_chunked[{kind}]", fused.qkv_rope_kernel(rows, kind, "f32", False, np.float32, 64,
                                                                            True),
                         f"void({F2}, {F1}, float32, {w2}, {F1}, {F3}, {I1}, {F2}, {F2}, {F3}, {F3}, {I1}, {I1}, "
                         f"{F2})"))
            jobs.append((f"gate_up_swiglu_chunked[{kind}]", fused.gate_up_kernel(rows, kind, "f32", False, True),
                         f"void({F2}, {F1}, float32, {w2}, {F1}, {F3}, {I1}, {F2})"))
        if rows == narrow.KERNEL_ROWS and kind.endswith("x8"):  # a batch's rows: the tile kernels (every tile for
            # bf16, the first for float32), with their epilogues for the first tile and SmolLM2's residue of 32
            for tile in narrow.TILES if kind == "bf16x8" else narrow.TILES[:1]:
                jobs.append((f"split_k_tile_sums[{kind}, {tile}]", narrow.tile_sums_kernel(tile, kind),
                             f"void({F2}, {w2}, {F3})"))
            for tile in narrow.ROWS_TILES:
                jobs.append((f"transposed_rows[{kind}, {tile}]", narrow.transposed_rows_kernel(tile, kind),
                             f"void({F2}, uint32[::1], {F2})"))
            if kind == "bf16x8":  # the tile epilogues' launches (they read no weights), for the first tile
                group = narrow.VEC * narrow.TILES[0][0]
                jobs.append(("matmul_tiles_store_add", narrow.kernel_for("split_k", kind, rows, "f32", True,
                                                                         group=group), f"void({F3}, {F1}, {F2})"))
                jobs.append(("add_norm_epilogue", narrow.add_norm_kernel(3), f"void({F3}, {F2}, {F1}, float32, {F2})"))
                jobs.append(("qkv_rope_tiles", fused.qkv_rope_tiles_kernel(group, "f32", np.uint16, 64),
                             f"void({F3}, {F1}, {F2}, {F2}, uint16[:, :, ::1], uint16[:, :, ::1], {I1}, {I1}, {F2})"))
                jobs.append(("gate_up_swiglu_tiles", fused.gate_up_tiles_kernel(group, "f32"),
                             f"void({F3}, {F1}, {F2})"))
        a2 = "uint32[::1]" if kind.endswith("x8") else F2  # 16-byte loads of a too
        jobs.append((f"transposed[{kind}, R={rows}]", narrow.kernel_for("transposed", kind, rows),
                     f"void({F2}, {F1}, float32, {a2}, {w2}, {F2})" if kind.endswith("x8")
                     else f"void({F2}, {F1}, float32, {w2}, {F2})"))
        if rows == 1 and kind.endswith("x8"):  # the final norm inside the logits (the fused step)
            jobs.append((f"transposed_norm[{kind}]", narrow.kernel_for("transposed", kind, rows, normed=True),
                         f"void({F2}, {F1}, float32, {a2}, {w2}, {F2})"))
F4, U1 = "float32[:, :, :, ::1]", "uint32[::1]"
ROW_ARGS = f"int32, int32, {U1}, int32, {U1}, float32, {U1}"  # pairs, per_row, a, T, gamma, eps, weight rows
for rows in (1, row_dot.ROWS):  # the one-pass projections: one chunk of loads, and several (K > 2048)
    for steps in (3, 32):
        for wide in (False, True):
            what = f"R={rows}, steps={steps}, {'f32' if wide else 'bf16'}"
            jobs.append((f"project_rows_add[{what}]", row_dot.project_kernel(rows, steps, wide, False, True),
                         f"void({ROW_ARGS}, {F2})"))
            if steps == 3:  # the normed inputs: rows of d_model
                jobs.append((f"project_rows_norm[{what}]", row_dot.project_kernel(rows, steps, wide, True, False),
                             f"void({ROW_ARGS}, {F2})"))
                jobs.append((f"qkv_rope_rows[{what}]", row_dot.qkv_rope_kernel(rows, steps, wide, True, not wide),
                             f"void({ROW_ARGS}, {F1}, {F2}, {F2}, {F3 if wide else 'uint16[:, :, ::1]'}, "
                             f"{F3 if wide else 'uint16[:, :, ::1]'}, {I1}, {I1}, {F2})"))
                jobs.append((f"gate_up_swiglu_rows[{what}]", row_dot.gate_up_kernel(rows, steps, wide, True),
                             f"void({ROW_ARGS}, {F2})"))
for dtype in (np.float32, np.uint16):  # paged attention: write_rows, flash-decoding for a few (group, head_dim)
    dt = np.dtype(dtype)
    jobs.append((f"write_rows_flat[{dt}]", paged_attention._WRITE_ROWS[dt], f"void({F3}, {dt.name}[:, :, ::1], {I1})"))
    for group, hd, page in ((3, 64, 16), (4, 128, 16), (8, 128, 16), (4, 256, 16), (1, 40, 5)):
        sequence, batch = paged_attention.SEQUENCE_CHUNKS.unroll, paged_attention.BATCH_CHUNKS.unroll
        heads = paged_attention.SEQUENCE_HEADS or group, paged_attention.BATCH_HEADS or group  # as flash_decode's
        chunks, one_launch, _ = paged_attention._chunks_kernels(dt, group, hd, page, heads[0], sequence)
        args = f"{F3}, {U1}, {U1}, {I1}, {I1}, int64, int64, float32, {F3}, {F4}, {F3}, {F3}"
        jobs.append((f"flash_decode_chunks[{dt}, G={group}, hd={hd}, page {page}]", chunks, f"void({args})"))
        if (group, hd) == (3, 64):  # SmolLM2's: a sequence's one launch, a batch's rows (its own unroll)
            batch_chunks = paged_attention._chunks_kernels(dt, group, hd, page, heads[0], batch)[0]
            rows = paged_attention._chunks_kernels(dt, group, hd, page, heads[1], batch)[2]
            jobs.append((f"flash_decode_chunks[{dt}, G={group}, hd={hd}, a batch's unroll]", batch_chunks,
                         f"void({args})"))  # a batched generator's prefills
            jobs.append((f"flash_decode[{dt}, G={group}, hd={hd}]", one_launch, f"void({args}, {I1})"))
            jobs.append((f"flash_decode_rows[{dt}, G={group}, hd={hd}]", rows,
                         f"void({F3}, {U1}, {U1}, int32[:, ::1], {I1}, {I1}, int64, int64, float32, {F3}, {F4}, "
                         f"{F3}, {F3}, {I1})"))
from course_lib.megakernel.kernel import megakernel_for  # noqa: E402
I2, U1 = "int32[:, ::1]", "uint32[::1]"
for dtype in (np.uint16,):  # the megakernel (bf16 weights; float32 weights change only its 16-byte loader), SmolLM2's
    jobs.append((f"megakernel[{np.dtype(dtype)}]", megakernel_for(dtype, 6, 3, 64),  # rows up to 6 x 256, G 3, hd 64
                 f"void({I2}, {', '.join([I1] * 7)}, int32, {I1}, int32, {I1}, {I1}, {I1}, {I1}, int32, float64[::1], "
                 f"int64[::1], float32, {F2}, {F2}, {', '.join([U1] * 3)}, {F2}, {', '.join([U1] * 6)}, {F2}, {U1}, "
                 f"{F2}, {F3}, {F3}, {F4}, {U1}, {F2}, {U1}, {F1}, {F2}, {F4}, {F4}, {U1}, {U1}, {I1}, uint64[::1], "
                 "int64[:, ::1])"))
jobs.append(("merge_chunks", paged_attention.merge_chunks, f"void({F4}, {F3}, {F3}, {I1}, int64, int64, {F3})"))
ptxas = shutil.which("ptxas")
verbose = os.environ.get("PTXAS_VERBOSE") == "1"  # ptxas's report of each kernel (registers, spills), printed
failed = 0
for name, kernel, sig in jobs:
    try:  # with the kernel's launch bounds, as on the GPU: they cap its registers (65,536 per SM / threads)
        bounds = getattr(kernel, "targetoptions", {}).get("launch_bounds")
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0), launch_bounds=bounds)
        if not name.startswith(("sample_", "megakernel")):  # the sampler's draw and thresholds: float64 on purpose
            assert ".f64" not in ptx, "float64 arithmetic (a float literal without float32(...)?)"
        if getattr(kernel, "waits_for_inputs", False):  # may be launched programmatically (kernels/overlap.py)
            assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, "no griddepcontrol"
        if name.startswith("flash_decode"):  # the first keys asked of the L2 cache before the wait (a load there
            # would be moved past it by ptxas: paged_attention's docstring)
            assert -1 < ptx.find("prefetch.global.L2") < ptx.find("griddepcontrol.wait"), "no prefetch before the wait"
        if ptxas:
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ptx)
                f.flush()
                r = subprocess.run([ptxas, "-arch=sm_90", f.name, "-o", os.devnull, "-v"], capture_output=True,
                                   text=True)
            assert r.returncode == 0, r.stderr[-2000:]
            if verbose:
                print(r.stderr)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
            if spills and any(int(n) for n in spills.groups()):
                print("SPILLS", name, bounds, spills.group(1), spills.group(2))
        print("OK", name)
    except Exception as e:
        failed += 1
        print("FAIL", name, type(e).__name__, str(e)[-3000:])
print("TOTAL", len(jobs))
sys.exit(1 if failed else 0)
'''


@pytest.mark.skipif(not SIMULATOR, reason="on a GPU the kernels compile for real in the tests that run them")
def test_kernels_compile_for_sm90():
    """Compile every kernel to PTX for compute capability 9.0 (H200), in a subprocess without the simulator:
    the simulator runs kernels as Python and would not notice typing errors or non-constant shared shapes. With
    ptxas at hand, each is assembled under its launch bounds, as on the GPU, and the kernels that spill registers to
    local memory there are printed (`pytest -s`; PTXAS_VERBOSE=1 prints ptxas's whole report)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], cwd=Path(__file__).resolve().parents[1], env=env,
                       capture_output=True, text=True)  # no timeout: compile time is no test's business
    out = r.stdout + r.stderr
    if "SKIP:" in out:
        pytest.skip(out[out.index("SKIP:"):].splitlines()[0])
    assert r.returncode == 0, out[-6000:]
    print("".join(line + "\n" for line in out.splitlines() if line.startswith("SPILLS")), end="")
    total = int(out.split("TOTAL ")[1].split()[0])
    assert total >= 50 and out.count("OK ") == total, out


# ---- narrow.py: split-K matmul and transposed matmul for R <= 16 rows ----

class _RecordingRuntime(_CountingRuntime):
    """A _CountingRuntime that also keeps the shape of each split-K launch's partial sums (it shows the slices)."""

    def __init__(self):
        super().__init__()
        self.partials = []

    def launch(self, name, kernel, grid, block, *args):
        if name.startswith("matmul_split_k"):
            self.partials.append(args[5].shape)  # (a, gamma, eps, weights, bias, partial, done, out)
        elif name.startswith("split_k_tile_sums"):
            self.partials.append(args[2].shape)  # (a, weights, partial); its epilogue's launch reads that one
        super().launch(name, kernel, grid, block, *args)


def test_matmul_narrow_more_slices_than_a_round_of_loads(rng):
    """K = 576, N = 72 (16-byte loads): 9 slices of K, more than the UNROLL a last block adds per round of loads, so
    the slices' sum takes a second round (the tests above make 2 or 3 slices in the simulator)."""
    a, b, bias, want, tol = linear_case(rng, 1, 576, 72, "bf16", "f32")
    rt = _RecordingRuntime()
    got = nw.matmul_narrow(dev(a), dev(b), dev(bias), out=poisoned((1, 72)), rt=rt).copy_to_host()
    [(slices, _, _)] = set(rt.partials)
    assert slices > nw.UNROLL
    check(got, want, tol)


@cuda.jit
def _rows_of_block_probe(done, out):
    """out[z, x] = (the first completion counter, the first row) that nw.rows_of_block gives block (x, 0, z) of a
    launch of chunks of KERNEL_ROWS rows."""
    lo, hi, counters = nw.rows_of_block(out.shape[0] * nw.KERNEL_ROWS, nw.KERNEL_ROWS, done)
    if cuda.threadIdx.x == 0:
        out[cuda.blockIdx.z, cuda.blockIdx.x, 0] = counters[cuda.blockIdx.x]
        out[cuda.blockIdx.z, cuda.blockIdx.x, 1] = lo


def test_each_chunk_of_rows_has_its_own_counters():
    """rows_of_block: in a launch of G column groups, chunk z takes the counters done[z G .. z G + G - 1] and the rows
    from z KERNEL_ROWS. Chunks sharing counters would race on a GPU (a block elected last before another chunk's
    slices are written); the simulator, which runs blocks one after another, would not show it in a product."""
    G, Z = 3, 4
    out = poisoned((Z, G, 2), np.int32)
    _rows_of_block_probe[(G, 1, Z), 32](dev(np.arange(G * Z, dtype=np.int32)), out)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[..., 0], np.arange(G * Z).reshape(Z, G))
    np.testing.assert_array_equal(got[..., 1], np.repeat(np.arange(Z)[:, None] * nw.KERNEL_ROWS, G, axis=1))


def linear_case(rng, M, K, N, dtype, bias_dtype):
    """a [M, K], weights b [K, N] stored as dtype, bias [N] stored as bias_dtype (or None); the float32 reference
    linear(a, b, bias) and its tolerance: the bias is one more term of each dot product (a 1 times the bias)."""
    a = randn(rng, M, K)
    b, b32 = weight(rng, dtype, K, N)
    bias, bias32 = weight(rng, bias_dtype, N) if bias_dtype else (None, None)
    if bias is None:
        return a, b, None, R.linear(a, b32), dot_tolerance(a, b32)
    tol = dot_tolerance(np.hstack([a, np.ones((M, 1), np.float32)]), np.vstack([b32, bias32[None]]))
    return a, b, bias, R.linear(a, b32, bias32), tol


@pytest.mark.parametrize("bias_dtype", [None, "f32", "bf16"])
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("N", [72, 71])  # 72: 16-byte loads of 8 columns per lane; 71: one element per load
@pytest.mark.parametrize("M", [1, 3, 6, 16])
def test_matmul_narrow(rng, M, N, dtype, bias_dtype):
    K = 200
    a, b, bias, want, tol = linear_case(rng, M, K, N, dtype, bias_dtype)
    rt = _RecordingRuntime()
    got = nw.matmul_narrow(dev(a), dev(b), None if bias is None else dev(bias), out=poisoned((M, N)), rt=rt)
    check(got.copy_to_host(), want, tol)
    [(slices, rows, cols)] = set(rt.partials)  # the partial sums, shared by the launches
    assert rt.allocations == 0  # out was given; the partial sums are a view of a buffer kept between calls
    whole = 0 if M <= nw.KERNEL_ROWS else M if N % 8 == 0 else M - M % nw.KERNEL_ROWS  # rows of the launch of
    # chunks (any number with 16-byte loads, a multiple of KERNEL_ROWS else); then the rest
    assert (rows, cols) == (max(whole, M - whole), N) and slices >= 2 and K % slices != 0  # K not a multiple
    if N % 8 == 0:  # a batch's rows: the tile kernel, its sums and their epilogue (the bias inside)
        want = ["split_k_tile_sums_vec", "matmul_tiles_store"] if whole else ["matmul_split_k_vec"]
    else:
        want = ["matmul_split_k"] * ((whole > 0) + (whole < M))
    assert rt.launched == want


def test_a_norm_of_several_rows_is_computed_first(rng):
    """matmul_narrow(norm=...) normalizes one row inside the split-K kernel; more rows are normalized by rms_norm
    first (the kernel of several rows with the norm inside would spill registers: narrow.NORMED_ROWS), then the plain
    kernel, with the same bits (test_rows_of_a_batch_have_the_bits_of_each_row_alone)."""
    K, N = 64, 40  # 16-byte loads
    norm = (dev(1 + randn(rng, K, scale=0.1)), np.float32(1e-5))
    b = dev(f32_to_bf16(randn(rng, K, N, scale=0.2)))
    for rows, launched in ((nw.NORMED_ROWS, ["matmul_split_k_norm_vec"]),
                           (nw.NORMED_ROWS + 2, ["rms_norm_rows", "matmul_split_k_vec"])):
        rt = _RecordingRuntime()
        nw.matmul_narrow(dev(randn(rng, rows, K)), b, out=poisoned((rows, N)), rt=rt, norm=norm)
        assert rt.launched == launched, rows


def test_matmul_narrow_deterministic(rng):
    """Fixed summation order (no atomics): two runs agree bit for bit, and a row's result does not depend on the
    other rows (one token alone or inside a prompt gets the same bits), here across a launch of two chunks of
    KERNEL_ROWS rows (a block for each) and a launch of the row left."""
    M = 2 * nw.KERNEL_ROWS + 1
    a, b, bias, want, tol = linear_case(rng, M, 200, 72, "bf16", "f32")
    a_dev, b_dev, bias_dev = dev(a), dev(b), dev(bias)
    first = nw.matmul_narrow(a_dev, b_dev, bias_dev).copy_to_host()
    second = nw.matmul_narrow(a_dev, b_dev, bias_dev, out=poisoned((M, 72))).copy_to_host()
    check(first, want, tol)
    np.testing.assert_array_equal(first.view(np.uint32), second.view(np.uint32))
    for r in (1, nw.KERNEL_ROWS + 1, M - 1):
        alone = nw.matmul_narrow(dev(a[r:r + 1]), b_dev, bias_dev, out=poisoned((1, 72))).copy_to_host()
        np.testing.assert_array_equal(first[r:r + 1].view(np.uint32), alone.view(np.uint32))


@pytest.mark.parametrize("N", [24, 23])  # 16-byte loads (a tile kernel a launch), one element per load
def test_matmul_narrow_many_rows(rng, N):
    """More rows than a launch takes (LAUNCH_ROWS): launches of LAUNCH_ROWS rows, then (one element per load) a
    multiple of KERNEL_ROWS, then the rest; every row within the float32 tolerance, and the last one bit for bit as
    alone."""
    M = nw.LAUNCH_ROWS + nw.KERNEL_ROWS + 2
    a, b, bias, want, tol = linear_case(rng, M, 40, N, "bf16", "f32")
    rt = _RecordingRuntime()
    got = nw.matmul_narrow(dev(a), dev(b), dev(bias), out=poisoned((M, N)), rt=rt).copy_to_host()
    check(got, want, tol)
    tiled = ["split_k_tile_sums_vec", "matmul_tiles_store"]  # the slices' sums, then the epilogue's launch
    assert rt.launched == (2 * tiled if N % 8 == 0 else ["matmul_split_k"] * 3)
    assert [rows for _, rows, _ in rt.partials] == ([nw.LAUNCH_ROWS, M - nw.LAUNCH_ROWS] if N % 8 == 0  # the tile
                                                    else [nw.LAUNCH_ROWS] * 3)  # launches' views of one scratch
    for r in (M - 1, nw.tile_rows(nw.TILES[0]) + 1):  # the last row, and one of the second chunk of the first launch
        alone = nw.matmul_narrow(dev(a[r:r + 1]), dev(b), dev(bias)).copy_to_host()
        np.testing.assert_array_equal(got[r:r + 1].view(np.uint32), alone.view(np.uint32), err_msg=f"row {r}")


def test_matmul_narrow_into_a_strided_output(rng):
    """A batch's rows written into columns of a wider array (not C-contiguous: the tile kernels' 16-byte stores
    cannot take it) go through the chunks of KERNEL_ROWS rows instead, with the bits of the contiguous output."""
    M, K, N = nw.tile_rows(nw.TILES[0]) + 2, 200, 72
    a, b, bias, want, tol = linear_case(rng, M, K, N, "bf16", "f32")
    a_dev, b_dev, bias_dev = dev(a), dev(b), dev(bias)
    whole = nw.matmul_narrow(a_dev, b_dev, bias_dev, out=poisoned((M, N))).copy_to_host()
    wide = poisoned((M, N + 1))  # its columns 1 .. N: rows that start 4 bytes past a 16-byte boundary
    rt = _RecordingRuntime()
    nw.matmul_narrow(a_dev, b_dev, bias_dev, out=wide[:, 1:], rt=rt)
    np.testing.assert_array_equal(wide.copy_to_host()[:, 1:].view(np.uint32), whole.view(np.uint32))
    check(whole, want, tol)
    assert "matmul_tiles" not in rt.launched and set(rt.launched) == {"matmul_split_k_vec"}


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("N", [72, 71])
@pytest.mark.parametrize("M", [1, 6])  # 6: a tile kernel, or a launch of 4 rows and one of 2
def test_matmul_narrow_accumulate_is_the_add_kernel_bit_for_bit(rng, M, N, dtype):
    """out += a @ b in the reduction (the fused residual) gives the bits of the matmul then the add kernel."""
    a, b, _, want, tol = linear_case(rng, M, 200, N, dtype, None)
    x = randn(rng, M, N)
    a_dev, b_dev = dev(a), dev(b)
    separate = ew.add(dev(x), nw.matmul_narrow(a_dev, b_dev, out=poisoned((M, N)))).copy_to_host()
    rt = _RecordingRuntime()
    fused = nw.matmul_narrow(a_dev, b_dev, out=dev(x), rt=rt, accumulate=True).copy_to_host()
    np.testing.assert_array_equal(fused.view(np.uint32), separate.view(np.uint32))
    check(fused, x + want, tol)
    if N % 8 == 0:  # 6 rows: the tile kernel, then its epilogue's launch adding
        assert rt.launched == (["matmul_split_k_vec_add"] if M <= nw.KERNEL_ROWS
                               else ["split_k_tile_sums_vec", "matmul_tiles_store_add"])
    else:
        assert set(rt.launched) == {"matmul_split_k_add"}
    with pytest.raises(ValueError, match="give out"):
        nw.matmul_narrow(a_dev, b_dev, accumulate=True)


@pytest.mark.parametrize("left", [nw.KERNEL_ROWS, nw.KERNEL_ROWS + 2])  # rows after the first launch
@pytest.mark.parametrize("N", [72, 71])  # 16-byte loads (the epilogue normalizes), one element per load (rms_norm)
def test_norm_after_the_residual_is_rms_norm_bit_for_bit(rng, N, left):
    """matmul_narrow(accumulate=True, norm_after=(gamma, eps, h)): x gets the bits of the plain accumulating matmul
    and h those of rms_norm(x) afterwards, for a launch of tiled rows (the add and the norm in one epilogue, a block
    per row), then the rows left: 4 (the split-K kernel, then rms_norm) or 6 (a second tiled launch, its epilogue
    writing h from row LAUNCH_ROWS on); without 16-byte loads, the launches and one rms_norm of all the rows."""
    M, K = nw.LAUNCH_ROWS + left, 200
    a, b, _, want, tol = linear_case(rng, M, K, N, "bf16", None)
    x = randn(rng, M, N)
    gamma, eps = 1 + randn(rng, N, scale=0.1), np.float32(1e-5)
    a_dev, b_dev, gamma_dev = dev(a), dev(b), dev(gamma)
    plain = nw.matmul_narrow(a_dev, b_dev, out=dev(x), accumulate=True)
    normed = ew.rms_norm(plain, gamma_dev, eps, out=poisoned((M, N))).copy_to_host()
    rt = _RecordingRuntime()
    h = poisoned((M, N))
    got = nw.matmul_narrow(a_dev, b_dev, out=dev(x), rt=rt, accumulate=True, norm_after=(gamma_dev, eps, h))
    np.testing.assert_array_equal(got.copy_to_host().view(np.uint32), plain.copy_to_host().view(np.uint32))
    np.testing.assert_array_equal(h.copy_to_host().view(np.uint32), normed.view(np.uint32))
    y = x + want  # the reference; y errs by tol_y, which reaches h through y / rms and through rms itself
    rms, tol_y = np.sqrt((y * y).mean(1, keepdims=True) + eps), tol + U32 * np.abs(y)
    want_h = y / rms * gamma
    check(h.copy_to_host(), want_h, rms_norm_tolerance(want_h)
          + np.abs(gamma) * (tol_y + np.abs(y) * tol_y.max(1, keepdims=True) / rms) / rms)
    tiled = ["split_k_tile_sums_vec", "add_norm_epilogue"]
    if N % 8 == 0:
        assert rt.launched == tiled + (["matmul_split_k_vec_add", "rms_norm_rows"] if left <= nw.KERNEL_ROWS else tiled)
    else:  # launches of chunks of rows, the rows left, then one norm of them all
        assert rt.launched[-1] == "rms_norm_rows" and set(rt.launched[:-1]) == {"matmul_split_k_add"}
    with pytest.raises(ValueError, match="norm_after"):
        nw.matmul_narrow(a_dev, b_dev, out=dev(x), norm_after=(gamma_dev, eps, h))


@pytest.mark.parametrize("N", [72, 2 * ew.NORM_THREADS + 5])  # columns a thread holds: 3 (1 in the simulator), more
def test_add_norm_epilogue_over_rounds_of_slices(rng, N):
    """add_norm_epilogue alone on more slices than a thread loads at once (several rounds): x gets x + the slices
    added in slice order from zero, h the bits of rms_norm(x) afterwards, whatever the columns a thread holds."""
    per_thread = -(-N // ew.NORM_THREADS)
    S, R, eps = max(1, 4 * nw.UNROLL // per_thread) * 2 + 3, 3, np.float32(1e-5)
    partial, x = randn(rng, S, R, N), randn(rng, R, N)
    gamma = 1 + randn(rng, N, scale=0.1)
    want = np.zeros((R, N), np.float32)
    for s in range(S):  # float32 additions in slice order, as the kernel's
        want = want + partial[s]
    want = x + want
    x_dev, h = dev(x), poisoned((R, N))
    nw.add_norm_kernel(per_thread)[R, ew.NORM_THREADS](dev(partial), x_dev, dev(gamma), eps, h)
    np.testing.assert_array_equal(x_dev.copy_to_host().view(np.uint32), want.view(np.uint32))
    normed = ew.rms_norm(dev(want), dev(gamma), eps, out=poisoned((R, N))).copy_to_host()
    np.testing.assert_array_equal(h.copy_to_host().view(np.uint32), normed.view(np.uint32))


def test_matmul_narrow_rejects(rng):
    a, b = dev(np.zeros((0, 8), np.float32)), dev(randn(rng, 8, 5))  # no rows (any number >= 1 is taken)
    with pytest.raises(ValueError, match="rows"):
        nw.matmul_narrow(a, b)
    with pytest.raises(ValueError):
        nw.matmul_narrow(dev(randn(rng, 2, 9)), b)
    with pytest.raises(ValueError):
        nw.matmul_narrow(dev(randn(rng, 2, 8)), b, bias=dev(randn(rng, 6)))
    with pytest.raises(ValueError):
        nw.matmul_narrow(dev(randn(rng, 2, 8)), b, out=dev(randn(rng, 3, 5)))
    with pytest.raises(TypeError):
        nw.matmul_narrow(dev(randn(rng, 2, 8)), dev(np.zeros((8, 5), np.float64)))


@pytest.mark.parametrize("M,path", [(3, ["matmul_split_k"]),
                                    (17, ["matmul_tiled", "add_bias_rows"])])
def test_linear_dispatch_narrow_or_tiled(rng, M, path):
    """linear: matmul_narrow up to 16 rows, the tiled matmul and add_bias beyond."""
    a, b, bias, want, tol = linear_case(rng, M, 70, 37, "f32", "bf16")
    rt = _RecordingRuntime()
    got = nw.linear(dev(a), dev(b), dev(bias), out=poisoned((M, 37)), rt=rt).copy_to_host()
    check(got, want, tol)
    assert rt.launched == path


def tied_weights(embed):
    """Weights with only a tied embedding table, for reference.logits (x @ embed.T)."""
    return R.Weights(embed=embed, layers=[], final_norm=np.ones(embed.shape[1], np.float32), lm_head=None)


@pytest.mark.parametrize("dtype,K", [("f32", 200), ("bf16", 200), ("bf16", 131),  # K % 8 != 0: one per load
                                     ("bf16", 576), ("f32", 2056)])  # rounds of 8 groups per lane, then 1 left
@pytest.mark.parametrize("M,N", [(1, 37), (3, 37), (16, 9)])  # small N at M = 16: simulated shuffles are slow
def test_matmul_transposed(rng, M, N, dtype, K):
    """a @ b.T with b [N, K] read in place: the tied-embedding logits (reference.logits with embed = b)."""
    b, b32 = weight(rng, dtype, N, K)
    a = randn(rng, M, K)
    rt = _RecordingRuntime()
    got = nw.matmul_transposed(dev(a), dev(b), out=poisoned((M, N)), rt=rt).copy_to_host()
    check(got, R.logits(a, tied_weights(b32)), dot_tolerance(a, b32.T))
    assert rt.launched == ["matmul_transposed_vec" if K % 8 == 0 else "matmul_transposed_warps"]


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("K", [72, 40])  # several pieces of K, and a piece cut short (K < TILE_PIECE here)
def test_matmul_transposed_rows_gives_each_row_its_bits_alone(rng, dtype, K):
    """The batch's logits (matmul_transposed_rows): a @ b.T within the float32 tolerance, and each row with the
    bits it gets in a launch of its own (another tile: one thread sums an output along K in order, whatever the
    tile), the first and last rows of the first tile and the last row."""
    M, N = nw.tile_rows(nw.ROWS_TILES[0]) + 3, 70  # two tiles of rows; N: the last block's rows of b cut short
    b, b32 = weight(rng, dtype, N, K)
    a = randn(rng, M, K)
    rt = _RecordingRuntime()
    got = nw.matmul_transposed_rows(dev(a), dev(b), out=poisoned((M, N)), rt=rt).copy_to_host()
    check(got, R.logits(a, tied_weights(b32)), dot_tolerance(a, b32.T))
    assert rt.launched == ["matmul_transposed_rows"]
    for r in (0, nw.tile_rows(nw.ROWS_TILES[0]) - 1, M - 1):
        alone = nw.matmul_transposed_rows(dev(a[r:r + 1]), dev(b), out=poisoned((1, N))).copy_to_host()
        np.testing.assert_array_equal(got[r:r + 1].view(np.uint32), alone.view(np.uint32), err_msg=f"row {r}")
    with pytest.raises(ValueError, match="expected"):
        nw.matmul_transposed_rows(dev(a[:, :K - 1]), dev(b))


@cuda.jit
def _quads_through_shared(src, out, lo):
    """Each thread t < 6: quad t of src staged in shared memory, read back by shared_load16, written by store_quad to
    out[:, lo:][t // 3, t % 3 // 2, 4 (t % 2) ..] (a view whose rows are strided)."""
    staged = cuda.shared.array((6, 4), dtype=np.float32)
    t = cuda.threadIdx.x
    if t < 6:
        for j in range(4):
            staged[t, j] = src[4 * t + j]
    cuda.syncthreads()
    if t < 6:
        a, b, c, d = vec.shared_load16(staged, t)
        view = out[:, lo:]
        vec.store_quad(view, (t // 3, t % 3 // 2, 4 * (t % 2)), a, b, c, d)


def test_shared_load16_and_store_quad():
    """The 16-byte shared load reads quad i of a shared array; the 16-byte store writes four floats at an element's
    address in a strided view, and nothing else: the rest of the poisoned output keeps its poison."""
    src = np.arange(24, dtype=np.float32) + 0.5
    out = poisoned((2, 5, 8))
    _quads_through_shared[1, 32](dev(src), out, 3)
    got = out.copy_to_host()
    expected = np.full_like(got, np.nan)
    for t in range(6):
        expected[t // 3, 3 + t % 3 // 2, 4 * (t % 2):4 * (t % 2) + 4] = src[4 * t:4 * t + 4]
    written = ~np.isnan(expected)
    np.testing.assert_array_equal(got[written], expected[written])
    assert np.isnan(got[~written]).all() and written.sum() == 24


@pytest.mark.parametrize("K", [131, 40, 128])  # two slices of odd lengths (residues of two lengths), one short
# slice, slices of whole residues (their steps written out)
def test_every_tile_sums_a_slice_with_the_same_bits(rng, K):
    """The slices' sums of a batch's rows (tile_sums_kernel) are the same bits whatever the tile, and with the
    residues' steps written out (residue = uniform_residue) or walked by loops: each output is summed in the slice
    order of split_k_sums, whichever thread and block hold it. The slices added in order give a row the bits of the
    split-K kernel on that row alone, and add up to a @ b. With K = 128 also as one slice (S = 1), of several
    pieces: the residues of the pieces after the first are not the slice's first."""
    M, N = 11, 48
    a, b = randn(rng, M, K), f32_to_bf16(randn(rng, K, N, scale=0.2))
    a_dev, words = dev(a), nw.words(dev(b))

    def sums_of(tile, residue, S):
        partial = poisoned((S, M, N))
        grid = (-(-N // (nw.VEC * tile[0])), S, -(-M // nw.tile_rows(tile)))
        nw.tile_sums_kernel(tile, "bf16x8", residue)[grid, nw.TILE_THREADS](a_dev, words, partial)
        return partial.copy_to_host()

    S = nw.split_k(K, N, 32 * nw.VEC, nw.sm_count())
    residue = nw.uniform_residue(K, S)
    assert (residue > 0) == (K == 128)
    tiles = (*nw.TILES, nw.ROWS_TILES[0])  # and a tile of a quad a thread (the batch logits' layout, tile_thread)
    sums = {(tile, r): sums_of(tile, r, S) for tile in tiles for r in {0, residue}}
    first = sums[nw.TILES[0], 0]
    for (tile, r), got in sums.items():
        np.testing.assert_array_equal(got.view(np.uint32), first.view(np.uint32), err_msg=f"{tile}, residue {r}")
    check(first.sum(0), a @ bf16_to_f32(b), dot_tolerance(a, bf16_to_f32(b)))
    for r in (0, M - 1):  # the slices added in order, as the epilogue adds them: the row's bits alone
        total = first[0, r].copy()
        for s in range(1, S):
            total = total + first[s, r]
        alone = nw.matmul_narrow(dev(a[r:r + 1]), dev(b), out=poisoned((1, N))).copy_to_host()
        np.testing.assert_array_equal(total.view(np.uint32), alone[0].view(np.uint32), err_msg=f"row {r}")
    if K == 128:
        one = nw.uniform_residue(K, 1)
        assert nw.WARPS * one > nw.TILE_PIECE  # more than one piece to the slice
        np.testing.assert_array_equal(sums_of(nw.TILES[0], one, 1).view(np.uint32),
                                      sums_of(nw.TILES[0], 0, 1).view(np.uint32))


def test_split_k_slices_at_least_min():
    """Every slice [s K // S, (s + 1) K // S) is at least MIN_SLICE long (or there is one slice)."""
    for K in (1, 63, 64, 127, 128, 200, 576, 1000, 1536, 8192):
        for N in (1, 37, 576, 2048, 49152):
            for cols, sms in ((32, 2), (32, 132), (64, 132)):
                S = nw.split_k(K, N, cols, sms)
                bounds = [s * K // S for s in range(S + 1)]
                assert S >= 1 and bounds[-1] == K
                assert S == 1 or min(np.diff(bounds)) >= nw.MIN_SLICE, (K, N, cols, sms, S)
    assert [nw.split_k(K, 70, 32, 132, warps=8, per_sm=2) for K in (127, 128, 191, 192)] == [1, 2, 2, 3]


def test_split_k_grid_near_target():
    """With K long enough, groups x S is the multiple of the group count nearest per_sm x SMs (2 here)."""
    for N in (70, 576, 2048, 8192, 49152):
        for cols in (32, 64):
            groups, target = -(-N // cols), 2 * 132
            S = nw.split_k((1 << 20) + 1, N, cols, 132, per_sm=2)  # not whole steps: any S
            assert abs(groups * S - target) <= groups / 2 or (S == 1 and groups > target), (N, cols, S)
    assert nw.split_k(8192, 2048, 32, 132, per_sm=2) == 4  # 64 groups x 4 = 256 blocks for 264 wanted
    assert nw.split_k(576, 576, 32, 132, per_sm=2) == 9  # capped: 9 slices of 64
    assert nw.split_k(200, 70, 32, SIM_SMS, warps=2, per_sm=2) == 3  # the simulator tests' shape


def test_split_k_whole_steps():
    """When K is a multiple of a block's step (WARPS x UNROLL rows), every slice is whole steps, and S is the
    divisor of K / step nearest the slice count it would have had."""
    step = nw.WARPS * nw.UNROLL
    for K in (step, 9 * step, 24 * step, 128 * step, 224 * step):
        for N in (70, 576, 2048, 8192, 49152):
            S = nw.split_k(K, N, 256, 132)
            free = nw.split_k(K + 1, N, 256, 132)  # K + 1 rows: not whole steps
            divisors = [d for d in range(1, K // step + 1) if (K // step) % d == 0 and K // d >= nw.MIN_SLICE]
            assert K % S == 0 and (K // S) % step == 0, (K, N, S)
            assert abs(S - free) == min(abs(d - free) for d in divisors or [1]), (K, N, S, free)
    assert nw.split_k(128 * step, 2048, 256, 132, per_sm=2) == 32  # 8 groups: 33 wanted, 32 divides 128


@real_shapes
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("K,N", REAL_PROJECTIONS)
def test_matmul_narrow_real(rng, K, N, dtype):
    """[R, K] @ [K, N] + bias for R = 1 and 16; bit-identical when run again, and a row alone or among 16."""
    a, b, bias, _, tol = linear_case(rng, 16, K, N, dtype, dtype)
    b32 = bf16_to_f32(b) if dtype == "bf16" else b
    bias32 = bf16_to_f32(bias) if dtype == "bf16" else bias
    want = R.linear(a.astype(np.float64), b32.astype(np.float64), bias32.astype(np.float64))
    b_dev, bias_dev = dev(b), dev(bias)
    for rows in (1, 16):
        got = nw.matmul_narrow(dev(a[:rows]), b_dev, bias_dev, out=poisoned((rows, N))).copy_to_host()
        check(got, want[:rows], tol[:rows], f"[{rows}, {K}] @ [{K}, {N}] {dtype}")
    again = nw.matmul_narrow(dev(a), b_dev, bias_dev).copy_to_host()
    np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))
    alone = nw.matmul_narrow(dev(a[15:]), b_dev, bias_dev).copy_to_host()  # the last row alone: the same bits
    np.testing.assert_array_equal(alone.view(np.uint32), got[15:].view(np.uint32))


@real_shapes
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("config", REAL_MODELS)
def test_matmul_transposed_real(rng, config, dtype):
    """The tied logits x @ embed.T of both models ([49152, 576] and [128256, 2048] tables), R = 1 and 16."""
    V, d = config.vocab_size, config.d_model
    embed, embed32 = weight(rng, dtype, V, d)
    x = randn(rng, 16, d)
    want = R.logits(x.astype(np.float64), tied_weights(embed32.astype(np.float64)))
    tol, embed_dev = dot_tolerance(x, embed32.T), dev(embed)
    for rows in (1, 16):
        got = nw.matmul_transposed(dev(x[:rows]), embed_dev, out=poisoned((rows, V))).copy_to_host()
        check(got, want[:rows], tol[:rows], f"{config.name} logits, R={rows}, {dtype}")


@pytest.mark.parametrize("how,K,N,dtype", [("bias", 80, 40, "bf16"), ("accumulate", 67, 33, "f32"),
                                           ("norm", 80, 40, "bf16"), ("bias", 131, 40, "bf16"),
                                           ("accumulate", 131, 48, "f32")])  # 16-byte loads, or one element per
# load; K = 131: two slices of K of odd lengths, residues of different lengths in the block of many rows
def test_rows_of_a_batch_have_the_bits_of_each_row_alone(rng, how, K, N, dtype):
    """A launch of many rows (a batch's: a block per chunk of rows, each chunk with its own counters; with 16-byte
    loads the block of many rows, else chunks of KERNEL_ROWS and the rows past a multiple of KERNEL_ROWS in a launch
    of their own) gives every row the bits that row gets alone, in a launch of one row: plain with a bias, adding
    into the output, and normalizing its rows."""
    R = nw.tile_rows(nw.TILES[0]) + nw.KERNEL_ROWS + 1
    a, x0 = randn(rng, R, K), randn(rng, R, N)
    b = randn(rng, K, N, scale=0.2)
    b = f32_to_bf16(b) if dtype == "bf16" else b
    bias = randn(rng, N) if how == "bias" else None
    norm = (dev(1 + randn(rng, K, scale=0.1)), np.float32(1e-5)) if how == "norm" else None
    accumulate = how == "accumulate"

    def product(rows):
        out = dev(x0[rows]) if accumulate else poisoned((len(rows), N))
        return nw.matmul_narrow(dev(a[rows]), dev(b), None if bias is None else dev(bias), out=out,
                                accumulate=accumulate, norm=norm).copy_to_host()

    together = product(np.arange(R))
    for r in (0, nw.KERNEL_ROWS + 1, R - 2, R - 1):  # rows of the first and second chunks, the last two
        np.testing.assert_array_equal(product(np.array([r])).view(np.uint32), together[r:r + 1].view(np.uint32),
                                      err_msg=f"row {r}")


# ---- overlap.py: a chain of kernels launched programmatically ----

@pytest.mark.parametrize("overlap", [False, True])
def test_a_chain_of_dependent_kernels_computes_its_length(overlap):
    """Each link of the chain adds one to what the previous link wrote (bench.overlap_chain): launched
    programmatically on a GPU (each link waiting for its inputs), the chain still sums to its length; a link that
    ran ahead of its input would leave less."""
    from course_lib.measure.bench import overlap_chain

    links = 6 if SIMULATOR else 200
    plan, check = overlap_chain(links, 64 if SIMULATOR else 32 * 1024, overlap)
    assert plan.launches == links
    for _ in range(2):  # a second run starts again from zeros
        np.testing.assert_array_equal(check(), np.full(64 if SIMULATOR else 32 * 1024, links, np.float32))
