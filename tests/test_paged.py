"""The paged KV cache (course_lib.gpu.kv_cache) and its kernels (course_lib.kernels.paged_attention).

Bookkeeping is pure host code. The kernels run in Numba's CUDA simulator when there is no GPU, on tiny shapes;
outputs are filled with NaN (tables with a sentinel) first, so a forgotten write fails. The attention is checked
against the float64 reference on the logical keys gathered through a shuffled page table; bf16 tables are compared
with the bf16-rounded values the kernel reads. On a GPU, the `_real` tests also run the shapes of SmolLM2-135M and
Llama-3.2-1B and Llama-3.1-8B up to 4096 keys (skipped in the simulator).
"""

import numpy as np
import pytest
from checks import REAL_MODELS, U32, check, dev, poisoned, randn, real_shapes

from course_lib import reference as R
from course_lib.gpu.kv_cache import (
    CacheFullError,
    PagedKVCache,
    SequenceExistsError,
    SequenceTooLongError,
    UnknownSequenceError,
)
from course_lib.kernels import cuda
from course_lib.kernels import paged_attention as pa
from course_lib.kernels.vector import bf16x8, words
from course_lib.model.config import LLAMA_31_8B, ModelConfig
from course_lib.model.safetensors_io import bf16_to_f32, f32_to_bf16

TINY = ModelConfig("llama", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                   max_seq_len=256, name="tiny")


# ---- PagedKVCache: host bookkeeping ----

def held(cache, *seqs):
    """Pages held by the sequences (from their page tables)."""
    return sum(int((cache.page_table(s, cache.pages) >= 0).sum()) for s in seqs)


def test_cache_tables():
    cache = PagedKVCache(TINY, pages=5, page_size=4, dtype="bf16")
    assert len(cache.k) == len(cache.v) == TINY.n_layers
    assert cache.k[1].shape == (20, TINY.n_kv_heads, TINY.head_dim) and cache.k[1].dtype == np.uint16
    assert PagedKVCache(TINY, pages=2).v[0].dtype == np.float32
    with pytest.raises(ValueError):
        PagedKVCache(TINY, pages=2, dtype="f16")


def test_cache_pages_taken_lazily_and_slots():
    cache = PagedKVCache(TINY, pages=6, page_size=4)
    cache.add("a")
    assert "a" in cache and "b" not in cache and cache.length("a") == 0 and cache.free_pages == 6
    np.testing.assert_array_equal(cache.page_table("a", 3), [-1, -1, -1])  # no page before the first token
    slots = cache.slots("a", 6)  # positions 0..5: pages 0 and 1
    assert slots.dtype == np.int32
    np.testing.assert_array_equal(slots, [0, 1, 2, 3, 4, 5])
    assert cache.length("a") == 6 and cache.free_pages == 4
    np.testing.assert_array_equal(cache.slots("a", 2), [6, 7])  # fills page 1: no new page
    assert cache.free_pages == 4
    np.testing.assert_array_equal(cache.slots("a", 0), np.zeros(0, np.int32))
    np.testing.assert_array_equal(cache.slots("a", 1), [8])  # position 8: a third page
    np.testing.assert_array_equal(cache.page_table("a", 4), [0, 1, 2, -1])


def test_cache_interleaved_sequences_and_free():
    cache = PagedKVCache(TINY, pages=8, page_size=4)
    cache.add(1)
    cache.add(2)
    np.testing.assert_array_equal(cache.slots(1, 3), [0, 1, 2])  # page 0
    np.testing.assert_array_equal(cache.slots(2, 5), [4, 5, 6, 7, 8])  # pages 1, 2
    np.testing.assert_array_equal(cache.slots(1, 3), [3, 12, 13])  # page 0 full, then page 3
    np.testing.assert_array_equal(cache.page_table(1, 4), [0, 3, -1, -1])
    np.testing.assert_array_equal(cache.page_table(2, 4), [1, 2, -1, -1])
    cache.free(1)  # pages 0 and 3 back; the lowest free page is taken first
    assert 1 not in cache and cache.free_pages == 6
    cache.add(3)
    np.testing.assert_array_equal(cache.slots(3, 9), [0, 1, 2, 3, 12, 13, 14, 15, 16])  # pages 0, 3, 4
    assert cache.free_pages + held(cache, 2, 3) == cache.pages
    cache.add(1)  # a freed id can come back
    assert cache.length(1) == 0


def test_cache_full_changes_nothing():
    cache = PagedKVCache(TINY, pages=3, page_size=4, max_len=100)  # sequences may outgrow the cache
    cache.add("a")
    cache.add("b")
    cache.slots("a", 5)  # 2 pages
    with pytest.raises(CacheFullError):
        cache.slots("b", 9)  # needs 3 pages, 1 free
    assert cache.length("b") == 0 and cache.free_pages == 1 and held(cache, "a", "b") == 2
    with pytest.raises(CacheFullError):
        cache.slots("a", 8)  # 13 positions: 4 pages
    assert cache.length("a") == 5 and cache.free_pages == 1
    np.testing.assert_array_equal(cache.slots("b", 4), [8, 9, 10, 11])  # still usable: the last page
    assert isinstance(CacheFullError("x"), RuntimeError)


def test_cache_max_len():
    cache = PagedKVCache(TINY, pages=10, page_size=4, max_len=12)
    cache.add("a")
    cache.add("b", max_len=5)
    cache.slots("b", 5)
    with pytest.raises(SequenceTooLongError):
        cache.slots("b", 1)
    with pytest.raises(SequenceTooLongError):
        cache.slots("a", 13)  # the cache-wide default
    assert cache.length("a") == 0 and cache.length("b") == 5 and cache.free_pages == 8
    cache.slots("a", 12)
    assert cache.free_pages + held(cache, "a", "b") == cache.pages
    assert PagedKVCache(TINY, pages=3, page_size=4).max_len == 12
    assert issubclass(SequenceTooLongError, ValueError)


def test_cache_unknown_and_duplicate_ids():
    cache = PagedKVCache(TINY, pages=4, page_size=4)
    cache.add("a")
    cache.slots("a", 6)
    with pytest.raises(SequenceExistsError):
        cache.add("a")
    assert cache.length("a") == 6  # untouched
    cache.free("a")
    with pytest.raises(UnknownSequenceError):
        cache.free("a")  # freed twice
    for call in (lambda: cache.slots("a", 1), lambda: cache.length("a"), lambda: cache.page_table("a", 2),
                 lambda: cache.free("never"), lambda: cache.free(["unhashable"])):
        with pytest.raises(UnknownSequenceError):
            call()
    assert cache.free_pages == cache.pages  # nothing leaked, the free list has each page once
    cache.add("b")
    np.testing.assert_array_equal(cache.page_table("b", 4), [-1] * 4)
    np.testing.assert_array_equal(cache.slots("b", 16), np.arange(16))
    assert cache.free_pages == 0
    assert issubclass(UnknownSequenceError, ValueError) and issubclass(SequenceExistsError, ValueError)


def test_cache_page_table_too_narrow():
    cache = PagedKVCache(TINY, pages=4, page_size=2)
    cache.add(0)
    cache.slots(0, 5)
    with pytest.raises(ValueError):
        cache.page_table(0, 2)
    np.testing.assert_array_equal(cache.page_table(0, 3), [0, 1, 2])


# ---- write_rows ----

def bf16_cases(rng):
    """float32 values that exercise the bf16 rounding: random, ties (to even both ways), just off a tie, the
    largest finite values (round up to inf), infinities, NaNs (quiet, signalling, negative), zeros, subnormals."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0x7F7FFFFF, 0x7F7F8000,
                     0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x00000000, 0x80000000,
                     0x00000001, 0x00018000, 0x807FFFFF], np.uint32)
    return np.concatenate([bits.view(np.float32), randn(rng, 60) * np.float32(1e3)])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_write_rows(rng, dtype):
    T, Hkv, hd, rows = 3, 2, 13, 12
    new = rng.permutation(bf16_cases(rng)).reshape(T, Hkv, hd)  # the 78 values of bf16_cases
    slots = np.array([7, 0, 11], np.int32)
    sentinel = np.float32(-5.0) if dtype == "f32" else np.uint16(0xABCD)
    table = np.full((rows, Hkv, hd), sentinel)
    got = pa.write_rows(dev(new), dev(table), dev(slots)).copy_to_host()
    want = table.copy()
    want[slots] = new if dtype == "f32" else f32_to_bf16(new)
    assert got.dtype == table.dtype
    np.testing.assert_array_equal(got.view(np.uint32 if dtype == "f32" else np.uint16),
                                  want.view(np.uint32 if dtype == "f32" else np.uint16))  # bit for bit, NaN too


def test_write_rows_bf16_rounding_bit_exact(rng):
    """Every special value of bf16_cases, one row each: the device rounding equals f32_to_bf16 bit for bit."""
    x = bf16_cases(rng)[:, None, None]
    got = pa.write_rows(dev(x), poisoned(x.shape, np.uint16), dev(np.arange(len(x), dtype=np.int32)))
    np.testing.assert_array_equal(got.copy_to_host(), f32_to_bf16(x))


def test_write_rows_negative_slot_skipped(rng):
    new = randn(rng, 3, 1, 4)
    got = pa.write_rows(dev(new), dev(np.full((5, 1, 4), 9.0, np.float32)), dev(np.array([4, -1, 1], np.int32)))
    want = np.full((5, 1, 4), 9.0, np.float32)
    want[[4, 1]] = new[[0, 2]]
    np.testing.assert_array_equal(got.copy_to_host(), want)


# ---- flash_attention ----

def flash_tolerance(q, k, v, positions, tiles, c=2.0):
    """Bound on |kernel - exact| per output element, derived like test_kernels.attention_tolerance.

    A score q.k * scale errs by delta <= (hd + 2) u scale sum_d |q_d k_d|; p = exp(score - m) then carries a
    relative error of about 2 delta + 2 u (m, a score, errs like one). The online softmax multiplies each p by
    at most `tiles` rescale factors exp(m_old - m_new) (one per later tile of its chunk, and the merge's
    exp(m_c - M)): each errs by about 2 u + u |m_old - m_new| <= 2 u + 2 u smax (smax = max |score|), plus
    u for the product. Relative errors eps_j of the weights move the normalized output by at most
    max_j |eps_j| max_j |v_j - out| <= 2 max|eps| vmax; the sums of n terms add (n + 6) u vmax. c = 2: margin.
    """
    T, H, hd = q.shape
    S, Hkv, _ = k.shape
    kv = np.arange(H) // (H // Hkv)
    abs_scores = np.einsum("thd,shd->ths", np.abs(q), np.abs(k[:, kv])) / np.sqrt(hd)  # [T, H, S]
    visible = np.arange(S)[None, None, :] <= positions[:, None, None]
    smax = np.where(visible, abs_scores, 0).max(-1)  # [T, H], >= |score|
    delta = (hd + 2) * U32 * smax
    eps = 2 * delta + 2 * U32 + tiles * (3 * U32 + 2 * U32 * smax)
    n = (positions + 1)[:, None]
    vmax = np.abs(v[:, kv]).max(axis=(0, 2))[None, :]
    return (c * (2 * eps + (n + 6) * U32) * vmax)[..., None]


def logical_rows(page_table, n, page_size):
    """The table rows of a sequence's logical keys 0 .. n - 1: key j at page_table[j // page_size] * page_size +
    j % page_size."""
    j = np.arange(n)
    return page_table[j // page_size] * page_size + j % page_size


def paged_case(rng, T, H, Hkv, hd, n, dtype, page_size, spare_pages=3):
    """A random sequence of n keys in shuffled pages of a larger table (other rows hold garbage: huge values,
    as another sequence's would be) and T queries at positions n - T .. n - 1.
    -> (q, tables as stored, page_table, positions, k and v logical [n, Hkv, hd] as the kernel reads them)."""
    P = -(-n // page_size)
    total = P + spare_pages
    page_table = rng.permutation(total)[:P].astype(np.int32)
    k, v = randn(rng, total * page_size, Hkv, hd), randn(rng, total * page_size, Hkv, hd)
    rows = logical_rows(page_table, n, page_size)
    unused = np.setdiff1d(np.arange(total * page_size), rows)
    k[unused], v[unused] = 1e30, np.nan  # read by mistake, they would show
    if dtype == "bf16":
        k, v = f32_to_bf16(k), f32_to_bf16(v)
        k_log, v_log = bf16_to_f32(k[rows]), bf16_to_f32(v[rows])
    else:
        k_log, v_log = k[rows], v[rows]
    q = randn(rng, T, H, hd)
    positions = np.arange(n - T, n, dtype=np.int32)
    return q, k, v, page_table, positions, k_log, v_log


def run_flash(q, k, v, page_table, positions, page_size, max_len=None, one_launch=False,
              chunks=pa.SEQUENCE_CHUNKS):
    T, H, hd = q.shape
    out = dev(np.full((T, H, hd), np.nan, np.float32))
    return pa.flash_attention(dev(q), dev(k), dev(v), dev(page_table), dev(positions), page_size,
                              max_len=max_len, out=out, one_launch=one_launch, chunks=chunks).copy_to_host()


def rescales(n, H, Hkv, hd, chunks=pa.SEQUENCE_CHUNKS):
    """How many factors exp(m_old - m_new) can multiply a weight p: one per later step of its team in the chunk,
    one per shuffle round merging the teams of a warp (at most 5), one for the warps, then in merge_chunks one per
    later round of its component's thread (MERGE_UNROLL chunks each)."""
    length, count = pa.chunks_for(n, H, Hkv, hd, chunks=chunks)
    return rescales_of(length, pa.tile_keys(hd, chunks.unroll), count)


def rescales_of(length, step, count):
    """rescales() for chunks of `length` keys read `step` keys a block step, `count` chunks."""
    return -(-length // step) + 5 + 1 + -(-count // pa.MERGE_UNROLL)


def check_flash(rng, T, H, Hkv, hd, n, dtype, page_size=4, chunks=pa.SEQUENCE_CHUNKS):
    q, k, v, page_table, positions, k_log, v_log = paged_case(rng, T, H, Hkv, hd, n, dtype, page_size)
    got = run_flash(q, k, v, page_table, positions, page_size, max_len=n, chunks=chunks)
    want = R.attention(q.astype(np.float64), k_log.astype(np.float64), v_log.astype(np.float64), positions)
    tiles = rescales(n, H, Hkv, hd, chunks)
    check(got, want, flash_tolerance(q, k_log, v_log, positions, tiles),
          f"n={n} {dtype} T={T} H={H} Hkv={Hkv} {chunks}")


@pytest.mark.parametrize("H,Hkv,hd", [(2, 2, 16), (3, 1, 16)])  # GQA groups of 1 and 3
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 300])  # one page, page boundaries, several chunks and steps
def test_flash_decode(rng, n, dtype, H, Hkv, hd):
    check_flash(rng, 1, H, Hkv, hd, n, dtype)


@pytest.mark.parametrize("n, target, far", [(100, 1, False), (300, 2, False), (300, 2, True)])  # one chunk,
# normalized at once; two, merged; far: warp 1's keys score 120 above warp 0's
def test_chunk_block_merges_its_warps(rng, n, target, far):
    """The simulator's flash-decoding blocks have one warp (WARPS), so there the warps' merge through shared memory
    has a single term: a block of two warps built from the same body (chunk_block_for, as the megakernel builds its
    own), each warp's teams given keys of the chunk, against the float64 reference. With `far`, the merge must
    rescale by the larger of the warps' maxima: exp(120) overflows float32."""
    H, Hkv, hd, page, warps, unroll = 3, 1, 16, 4, 2, pa.SEQUENCE_CHUNKS.unroll
    block = pa.chunk_block_for(bf16x8, H // Hkv, hd, page, 1, unroll, warps=warps)
    step = warps * (32 // pa.team_size(hd)) * unroll  # keys of one block step: both warps' teams
    assert n >= warps * 32 // pa.team_size(hd)  # every team of both warps holds keys

    @cuda.jit
    def two_warps(q, k_words, v_words, page_table, positions, target, unit, scale, out, o_part, m_part, l_part):
        block(cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z, q, k_words, v_words, page_table, positions, target,
              unit, scale, out, o_part, m_part, l_part, 0)

    q, k, v, page_table, positions, k_log, v_log = paged_case(rng, 1, H, Hkv, hd, n, "bf16", page)
    if far:  # the keys of warp 1's teams (key j goes to team j % teams of the step) all 30: scores 16 x 30 / 4
        teams = step // unroll
        mine = np.arange(n) % teams >= teams // 2
        q[:] = 1
        k[logical_rows(page_table, n, page)[mine]] = f32_to_bf16(np.full((mine.sum(), Hkv, hd), 30.0, np.float32))
        k_log[mine] = 30.0
    length = pa.chunk_len(n, target, step)
    chunks = -(-n // length)
    assert chunks == target
    out = poisoned(q.shape)
    parts = (poisoned((1, H, chunks, hd)), poisoned((1, H, chunks)), poisoned((1, H, chunks)))
    two_warps[(chunks, H, 1), 32 * warps](dev(q), words(dev(k)), words(dev(v)), dev(page_table), dev(positions),
                                          target, step, np.float32(1 / np.sqrt(hd)), out, *parts)
    if chunks > 1:
        pa.merge_chunks[(H, 1), 32](*parts, dev(positions), target, step, out)
    want = R.attention(q.astype(np.float64), k_log.astype(np.float64), v_log.astype(np.float64), positions)
    tiles = rescales_of(length, step, chunks)
    check(out.copy_to_host(), want, flash_tolerance(q, k_log, v_log, positions, tiles), f"n={n}, {warps} warps")


@pytest.mark.parametrize("n", [2, 3])
def test_flash_batch_chunks(rng, n):
    """A batch's chunks (BATCH_CHUNKS: several block steps of two keys a team): n chunks, each of several steps (the
    last of one step and a few keys), merged; against the float64 reference, for a decode's query and a prefill's
    three."""
    hd, Hkv, batch = 16, 1, pa.BATCH_CHUNKS
    unit, step = pa.chunk_unit(hd, batch), pa.tile_keys(hd, batch.unroll)
    assert batch.steps > 1 and unit == batch.steps * step
    keys = (n - 1) * unit + step + 5
    assert pa.chunks_for(keys, 3, Hkv, hd, chunks=batch) == (unit, n)
    for T in (1, 3):
        check_flash(rng, T, 3, Hkv, hd, keys, "bf16", page_size=16, chunks=batch)


@pytest.mark.parametrize("rows", [False, True])  # one sequence's queries, or rows of several sequences
def test_flash_heads_per_block_keep_the_bits(rng, rows):
    """A block of one query head gives each head the bits of a block of the whole group (G = 3), whether the chunks
    are merged by a kernel, by the last block of a query's heads, or by the last block of each row's heads."""
    H, Hkv, hd, n, page = 3, 1, 16, 2 * pa.chunk_unit(16) + 5, 4  # three chunks: merged
    q, k, v, page_table, positions, _, _ = paged_case(rng, 2, H, Hkv, hd, n, "bf16", page)
    table, seq_of_row = (dev(page_table[None]), dev(np.zeros(2, np.int32))) if rows else (dev(page_table), None)
    for one_launch in ([True] if rows else [False, True]):
        got = [pa.flash_attention(dev(q), dev(k), dev(v), table, dev(positions), page, max_len=n,
                                  out=poisoned(q.shape), one_launch=one_launch, heads=heads,
                                  seq_of_row=seq_of_row).copy_to_host() for heads in (3, 1)]
        np.testing.assert_array_equal(got[1].view(np.uint32), got[0].view(np.uint32))
    with pytest.raises(ValueError, match="do not divide"):
        pa.flash_attention(dev(q), dev(k), dev(v), dev(page_table), dev(positions), page, max_len=n, heads=2)


@pytest.mark.parametrize("chunks", [pa.SEQUENCE_CHUNKS, pa.BATCH_CHUNKS])
@pytest.mark.parametrize("one_launch", [False, True])
def test_flash_grid_follows_the_chunks(rng, monkeypatch, chunks, one_launch):
    """flash_attention launches a block per chunk (recorded, not run): one key past a batch's chunk (four steps of
    two keys a team) is three chunks of one sequence's (a step of four keys), or two of a batch's; the merge counts
    them alike."""
    hd, Hkv, page = 16, 1, 16
    n = pa.chunk_unit(hd, pa.BATCH_CHUNKS) + 1
    launches = []  # (kernel, grid, the kernel's arguments)
    monkeypatch.setattr(pa, "launch", lambda kernel, grid, block, stream, rt, *args: launches.append((kernel, grid,
                                                                                                     args)))
    q, k, v, page_table, positions, _, _ = paged_case(rng, 1, 3, Hkv, hd, n, "bf16", page)
    pa.flash_attention(dev(q), dev(k), dev(v), dev(page_table), dev(positions), page, max_len=n,
                       one_launch=one_launch, chunks=chunks)
    count, unit = pa.chunks_for(n, 3, Hkv, hd, chunks=chunks)[1], pa.chunk_unit(hd, chunks)
    assert count == (2 if chunks == pa.BATCH_CHUNKS else 3)
    (kernel, grid, args), *merge = launches
    heads = pa.SEQUENCE_HEADS or 3  # a block per query head, or per KV head (its G = 3 query heads)
    assert grid == (count, 3 // heads, 1) and args[6] == unit  # (q, k, v, page_table, positions, target, unit, ...)
    # the kernel built for these chunks' keys per team and step
    assert kernel is pa._chunks_kernels(np.uint16, 3, hd, page, heads, chunks.unroll)[1 if one_launch else 0]
    assert len(merge) == (0 if one_launch else 1)
    for _, _, args in merge:  # merge_chunks(o, m, l, positions, target, unit, out): the chunks counted alike
        assert args[5] == unit


@pytest.mark.parametrize("H,Hkv,hd,dtype", [(2, 2, 16, "bf16"), (3, 1, 16, "f32")])
@pytest.mark.parametrize("n", [3, 17, 100])
def test_flash_prefill(rng, n, H, Hkv, hd, dtype):
    """T = 3 queries at positions n - 3, n - 2, n - 1 (causal: each sees one key more)."""
    check_flash(rng, 3, H, Hkv, hd, n, dtype)


@pytest.mark.parametrize("H,Hkv,hd,n,page_size", [
    (4, 2, 40, 60, 16),  # five 8-element groups per row: one lane per key, pages of 16
    (2, 1, 256, 20, 4),  # the largest head_dim: a warp per key
    (8, 1, 24, 37, 5),  # the largest group, odd sizes
])
def test_flash_shapes(rng, H, Hkv, hd, n, page_size):
    check_flash(rng, 2, H, Hkv, hd, n, "f32", page_size)


@pytest.mark.parametrize("chunks", [pa.SEQUENCE_CHUNKS, pa.BATCH_CHUNKS])
def test_flash_chunks(chunks):
    """The chunk rule: whole steps of a block, at most chunk_target chunks, and a function of n alone (no T); a
    chunk's blocks (a block per query head for a sequence, per KV head for a batch's rows) in one wave of the GPU."""
    for H, Hkv in ((1, 1), (3, 1), (9, 3), (32, 8)):
        blocks = H if chunks.per_query_head else Hkv
        for hd in (8, 24, 64, 128):
            target, unit = pa.chunk_target(H, Hkv, chunks, sms=132), pa.chunk_unit(hd, chunks)
            assert target * blocks <= pa.BLOCKS_PER_SM * 132 < (target + 1) * blocks
            for n in (1, 15, 16, 17, 100, 1000, 4096, 100_000):
                length, count = pa.chunks_for(n, H, Hkv, hd, sms=132, chunks=chunks)
                assert length % unit == 0 and count <= target
                assert (count - 1) * length < n <= count * length  # no empty chunk
                assert count == 1 or n > pa.ONE_CHUNK_KEYS
    assert pa.chunks_for(pa.chunk_unit(64, chunks), 9, 3, 64, sms=132, chunks=chunks)[1] == 1  # short: one chunk
    if chunks.per_query_head:  # SmolLM2 at 4k: a wave of a block per query head and chunk, not three
        assert pa.chunks_for(4096, 9, 3, 64, sms=132)[1] * 9 in range(132, pa.BLOCKS_PER_SM * 132 + 1)


def test_short_queries_take_one_chunk(monkeypatch):
    """Up to ONE_CHUNK_KEYS keys a query reads its keys in one chunk of whole block steps, however many chunks the
    GPU could hold; past it the count rule as before (the GPU's constant here: the simulator's is 0)."""
    monkeypatch.setattr(pa, "ONE_CHUNK_KEYS", 256)
    unit = pa.chunk_unit(64)
    for n in (1, unit, unit + 1, 200, 256):
        assert pa.chunks_for(n, 9, 3, 64, sms=132) == (-(-n // unit) * unit, 1)
    assert pa.chunks_for(257, 9, 3, 64, sms=132)[1] == -(-257 // unit)  # chunks of one step again
    monkeypatch.setattr(pa, "ONE_CHUNK_KEYS", 0)
    assert pa.chunks_for(200, 9, 3, 64, sms=132)[1] == -(-200 // unit)


@pytest.mark.parametrize("hd", [16, 40])
def test_merge_many_chunks(rng, hd):
    """merge_chunks alone, on more chunks than its threads take at once (several loads of MERGE_UNROLL per
    thread): against the float64 merge. Each weighted term carries a few roundings (exp, the product) and each
    sum at most C additions: |error| <= (C + 8) U32 (sum |w o| / sum w l + |out|)."""
    T, H, C = 2, 3, 2 * pa.MERGE_UNROLL + 5  # each component's thread loads MERGE_UNROLL chunks three times
    o, m = randn(rng, T, H, C, hd), randn(rng, T, H, C, scale=4.0)
    l = rng.uniform(0.5, 2.0, (T, H, C)).astype(np.float32)  # noqa: E741
    unit = pa.ONE_CHUNK_KEYS // (C // 2 + 1) + 1  # so that both queries see more keys than one chunk takes
    counts = np.array([C, C // 2 + 1])
    positions = (counts * unit - 1).astype(np.int32)  # target C: chunks of one unit, C and C // 2 + 1 of them
    out = poisoned((T, H, hd))
    pa.merge_chunks[(H, T), pa.MERGE_THREADS](dev(o), dev(m), dev(l), dev(positions), C, unit, out)
    got = out.copy_to_host()
    for t, n in enumerate(counts):
        w = np.exp(m[t, :, :n].astype(np.float64) - m[t, :, :n].max(axis=1, keepdims=True))
        num, den = (w[..., None] * o[t, :, :n]).sum(axis=1), (w * l[t, :, :n]).sum(axis=1)[:, None]
        want = num / den
        tol = (C + 8) * U32 * ((w[..., None] * np.abs(o[t, :, :n])).sum(axis=1) / den + np.abs(want))
        check(got[t], want, tol, f"query {t}, {n} chunks")


def test_flash_query_alone_equals_query_in_prefill(rng):
    """A query's output does not depend on the other queries of the pass (nor on max_len): bit for bit."""
    H, Hkv, hd, page_size = 3, 1, 16, 4
    unit = pa.tile_keys(hd)
    n = 3 * unit + 12
    q, k, v, page_table, positions, _, _ = paged_case(rng, 3, H, Hkv, hd, n, "f32", page_size)
    positions = np.array([unit - 4, n - 2, n - 1], np.int32)  # one chunk (alone: no merge), then several
    assert pa.chunks_for(unit - 3, H, Hkv, hd)[1] == 1 < pa.chunks_for(n - 1, H, Hkv, hd)[1]
    prefill = run_flash(q, k, v, page_table, positions, page_size, max_len=n)
    for t in range(3):
        alone = run_flash(q[t:t + 1], k, v, page_table, positions[t:t + 1], page_size, max_len=int(positions[t]) + 1)
        np.testing.assert_array_equal(alone[0].view(np.uint32), prefill[t].view(np.uint32), f"query {t}")
    again = run_flash(q[:1], k, v, page_table, positions[:1], page_size)  # max_len read back: same bits
    np.testing.assert_array_equal(again.view(np.uint32), prefill[:1].view(np.uint32))


def test_flash_through_the_cache(rng):
    """PagedKVCache + write_rows + flash_attention: two sequences grown in turns (their pages interleave), a
    prefill then decodes, bf16 tables; each checked against the reference on its own keys."""
    config = ModelConfig("llama", vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64,
                         max_seq_len=64, name="tiny-gqa")
    cache = PagedKVCache(config, pages=12, page_size=4, dtype="bf16")
    hd, keys, values = config.head_dim, {}, {}
    for step, (seq, n_new) in enumerate([("a", 3), ("b", 7), ("a", 2), ("b", 1), ("a", 11)]):
        if seq not in cache:
            cache.add(seq)
            keys[seq], values[seq] = [], []
        k_new, v_new = randn(rng, n_new, 1, hd), randn(rng, n_new, 1, hd)
        slots = dev(cache.slots(seq, n_new))
        pa.write_rows(dev(k_new), cache.k[0], slots)
        pa.write_rows(dev(v_new), cache.v[0], slots)
        keys[seq].append(bf16_to_f32(f32_to_bf16(k_new)))
        values[seq].append(bf16_to_f32(f32_to_bf16(v_new)))
        n = cache.length(seq)
        q = randn(rng, n_new, 2, hd)
        positions = np.arange(n - n_new, n, dtype=np.int32)
        out = dev(np.full(q.shape, np.nan, np.float32))
        got = pa.flash_attention(dev(q), cache.k[0], cache.v[0], dev(cache.page_table(seq, 6)), dev(positions),
                                 cache.page_size, max_len=n, out=out).copy_to_host()
        k_all, v_all = np.concatenate(keys[seq]), np.concatenate(values[seq])
        want = R.attention(q.astype(np.float64), k_all.astype(np.float64), v_all.astype(np.float64), positions)
        check(got, want, flash_tolerance(q, k_all, v_all, positions, rescales(n, 2, 1, hd)), f"step {step} ({seq})")
    assert cache.page_table("a", 6).tolist() == [0, 3, 4, 5, -1, -1]  # b took pages 1 and 2 in between


def test_flash_rejects_bad_shapes(rng):
    q, k = dev(randn(rng, 1, 3, 8)), dev(randn(rng, 8, 2, 8))
    pt, pos = dev(np.arange(2, dtype=np.int32)), dev(np.zeros(1, np.int32))
    with pytest.raises(ValueError):
        pa.flash_attention(q, k, k, pt, pos, 4, 1)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError):
        pa.flash_attention(dev(randn(rng, 1, 2, 8)), k, k, pt, pos, 4, 9)  # max_len past the page table
    k12 = dev(randn(rng, 8, 2, 12))
    with pytest.raises(ValueError, match="multiple of 8"):
        pa.flash_attention(dev(randn(rng, 1, 2, 12)), k12, k12, pt, pos, 4, 1)  # head_dim 12: no 16-byte groups
    k256 = dev(randn(rng, 8, 1, 256))
    with pytest.raises(ValueError, match="x hd <="):  # 8 query heads of 256: the warps' sums overflow shared memory
        pa.flash_attention(dev(randn(rng, 1, 8, 256)), k256, k256, pt, pos, 4, 1)


# ---- real shapes (GPU only) ----

PAGED_REAL_MODELS = REAL_MODELS + [pytest.param(LLAMA_31_8B, id="Llama-3.1-8B")]


@real_shapes
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 100, 1000, 4096])
@pytest.mark.parametrize("config", PAGED_REAL_MODELS)
def test_flash_real(rng, config, n, dtype):
    for T in (1, min(n, 7)):
        check_flash(rng, T, config.n_heads, config.n_kv_heads, config.head_dim, n, dtype, page_size=16)


@real_shapes
@pytest.mark.parametrize("config", PAGED_REAL_MODELS)
def test_flash_real_query_alone_equals_prefill(rng, config):
    H, Hkv, hd, n = config.n_heads, config.n_kv_heads, config.head_dim, 4096
    q, k, v, page_table, _, _, _ = paged_case(rng, 4, H, Hkv, hd, n, "bf16", 16)
    positions = np.array([40, 1000, 3000, 4095], np.int32)
    prefill = run_flash(q, k, v, page_table, positions, 16, max_len=n)
    for t in range(4):
        alone = run_flash(q[t:t + 1], k, v, page_table, positions[t:t + 1], 16, max_len=int(positions[t]) + 1)
        np.testing.assert_array_equal(alone[0].view(np.uint32), prefill[t].view(np.uint32), f"query {t}")
