"""The fused kernels (kernels/fused.py, flash_decode) give the bits of the unfused kernels they replace, which
test_kernels and test_paged check against the NumPy reference: the same float32 operations in the same order,
so equality is exact (on fresh random inputs, into poisoned outputs). In the simulator on small shapes; on a GPU
on the real models' shapes too."""

import numpy as np
import pytest
from checks import REAL_MODELS, dev, poisoned, randn
from test_paged import paged_case, run_flash

from course_lib.kernels import SIMULATOR, fused, narrow
from course_lib.kernels import elementwise as ew
from course_lib.kernels import paged_attention as pa
from course_lib.model.config import SMOLLM2_135M
from course_lib.model.safetensors_io import f32_to_bf16

EPS = 1e-5
SMALL = [pytest.param(dict(d=64, H=4, Hkv=2, hd=16, F=160), id="tiny")]  # the tiny model's shapes
SHAPES = SMALL if SIMULATOR else SMALL + [pytest.param(dict(d=c.d_model, H=c.n_heads, Hkv=c.n_kv_heads,
                                                            hd=c.head_dim, F=c.d_ff), id=p.id)
                                          for p in REAL_MODELS for c in p.values]


def stored(w, dtype):
    return f32_to_bf16(w) if dtype == "bf16" else w


def same_bits(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), what)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T,dtype,bias,kv", [(1, "bf16", False, np.float32), (5, "f32", True, np.uint16),
                                             (3, "bf16", True, np.float32)])
def test_qkv_rope_equals_its_kernels(rng, shape, T, dtype, bias, kv):
    """RMSNorm, three matmuls (+ bias), RoPE on q and k, k and v written to the cache (one slot skipped) ==
    qkv_rope; the cache rows it must not touch keep their poison."""
    d, H, Hkv, hd = shape["d"], shape["H"], shape["Hkv"], shape["hd"]
    if len({narrow.split_k(d, n, 256, narrow.sm_count()) for n in ((H + 2 * Hkv) * hd, H * hd, Hkv * hd)}) > 1:
        pytest.skip("the three matmuls split K differently from the fused one: other roundings (see kernels/fused)")
    x, gamma = randn(rng, T, d), 1 + randn(rng, d, scale=0.1)
    ws = [randn(rng, d, n, scale=d ** -0.5) for n in (H * hd, Hkv * hd, Hkv * hd)]
    bs = [randn(rng, n) if bias else None for n in (H * hd, Hkv * hd, Hkv * hd)]
    cos, sin = randn(rng, 64, hd // 2), randn(rng, 64, hd // 2)
    positions = rng.integers(0, 64, T).astype(np.int32)
    slots = rng.permutation(40)[:T].astype(np.int32)
    slots[0] = -1
    x_d, g_d, cos_d, sin_d, pos_d, slots_d = map(dev, (x, gamma, cos, sin, positions, slots))

    h = ew.rms_norm(x_d, g_d, EPS)
    q, k, v = (narrow.matmul_narrow(h, dev(stored(w, dtype)), None if b is None else dev(b)).reshape(T, -1, hd)
               for w, b in zip(ws, bs, strict=True))
    ew.rope(q, cos_d, sin_d, pos_d)
    ew.rope(k, cos_d, sin_d, pos_d)
    tables = [poisoned((40, Hkv, hd), kv) for _ in range(4)]
    pa.write_rows(k, tables[0], slots_d)
    pa.write_rows(v, tables[1], slots_d)

    w_qkv = dev(stored(np.concatenate(ws, axis=1), dtype))
    b_qkv = dev(np.concatenate(bs)) if bias else None
    q_fused = fused.qkv_rope(x_d, w_qkv, b_qkv, (g_d, EPS), cos_d, sin_d, pos_d, slots_d, poisoned((T, H * hd)),
                             tables[2], tables[3])
    same_bits(q_fused.copy_to_host(), q.copy_to_host().reshape(T, -1), "q")
    same_bits(tables[2].copy_to_host(), tables[0].copy_to_host(), "k cache")
    same_bits(tables[3].copy_to_host(), tables[1].copy_to_host(), "v cache")  # the poisoned rows included


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T,dtype", [(1, "bf16"), (5, "f32")])
def test_gate_up_swiglu_equals_its_kernels(rng, shape, T, dtype):
    """RMSNorm, gate and up matmuls, silu(gate) * up == gate_up_swiglu on the interleaved weights."""
    d, F = shape["d"], shape["F"]
    x, gamma = randn(rng, T, d), 1 + randn(rng, d, scale=0.1)
    w_gate, w_up = randn(rng, d, F, scale=d ** -0.5), randn(rng, d, F, scale=d ** -0.5)
    x_d, g_d = dev(x), dev(gamma)
    h = ew.rms_norm(x_d, g_d, EPS)
    want = ew.silu_mul(narrow.matmul_narrow(h, dev(stored(w_gate, dtype))),
                       narrow.matmul_narrow(h, dev(stored(w_up, dtype)))).copy_to_host()
    w_gu = dev(stored(fused.interleave_gate_up(w_gate, w_up), dtype))
    got = fused.gate_up_swiglu(x_d, w_gu, (g_d, EPS), poisoned((T, F))).copy_to_host()
    same_bits(got, want, "silu(gate) * up")


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_rows_of_a_batch_have_the_bits_of_each_row_alone(rng, shape):
    """qkv_rope and gate_up_swiglu on the rows of a batch (rms_norm first, then the tile kernels: the slices' sums of
    tiles of rows and columns, the epilogue in each tile's last block; two launches, of LAUNCH_ROWS rows and of the
    rest) give every row the bits it gets in a launch of its own (the split-K block of one row, the norm inside): the
    same additions in the same order."""
    d, H, Hkv, hd, F = shape["d"], shape["H"], shape["Hkv"], shape["hd"], shape["F"]
    T, n = narrow.LAUNCH_ROWS + narrow.KERNEL_ROWS + 3, (H + 2 * Hkv) * hd  # two tile launches
    x, gamma = randn(rng, T, d), 1 + randn(rng, d, scale=0.1)
    w_qkv, b_qkv = dev(f32_to_bf16(randn(rng, d, n, scale=d ** -0.5))), dev(randn(rng, n))
    w_gu = dev(f32_to_bf16(fused.interleave_gate_up(randn(rng, d, F, scale=d ** -0.5),
                                                    randn(rng, d, F, scale=d ** -0.5))))
    cos, sin = dev(randn(rng, 64, hd // 2)), dev(randn(rng, 64, hd // 2))
    positions, slots = rng.integers(0, 64, T).astype(np.int32), rng.permutation(2 * T)[:T].astype(np.int32)

    def run(rows):
        x_d, norm = dev(x[rows]), (dev(gamma), EPS)
        k_table, v_table = poisoned((2 * T, Hkv, hd)), poisoned((2 * T, Hkv, hd))
        q = fused.qkv_rope(x_d, w_qkv, b_qkv, norm, cos, sin, dev(positions[rows]), dev(slots[rows]),
                           poisoned((len(rows), H * hd)), k_table, v_table)
        act = fused.gate_up_swiglu(x_d, w_gu, norm, poisoned((len(rows), F)))
        k_rows, v_rows = (t.copy_to_host()[slots[rows]] for t in (k_table, v_table))
        return q.copy_to_host(), k_rows, v_rows, act.copy_to_host()

    batch = run(np.arange(T))
    for r in (0, narrow.tile_rows(narrow.TILES[0]) - 1, narrow.LAUNCH_ROWS, T - 1):  # the first tile's first and
        # last rows, the second launch's first and last
        for what, got, alone in zip(("q", "k", "v", "act"), batch, run(np.array([r])), strict=True):
            same_bits(got[r:r + 1], alone, f"{what}, row {r}")


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("M,K,F", [(1, 40, 24), (19, 37, 40)] if SIMULATOR else [(1, 576, 1536), (200, 576, 1536),
                                                                                 (77, 2048, 8192)])
def test_tiled_swiglu_equals_its_kernels(rng, M, K, F, dtype):
    """Both tiled strategies (gate then up in each block; the interleaved columns) give the bits of two tiled
    matmuls and silu_mul, for a row alone and for partial tiles of rows and columns."""
    from course_lib.kernels import matmul as mm

    a = randn(rng, M, K)
    w_gate, w_up = (stored(randn(rng, K, F, scale=K ** -0.5), dtype) for _ in range(2))
    a_d, g_d, u_d = dev(a), dev(w_gate), dev(w_up)
    want = ew.silu_mul(mm.matmul(a_d, g_d), mm.matmul(a_d, u_d)).copy_to_host()
    two = fused.swiglu_two_passes(a_d, g_d, u_d, out=poisoned((M, F))).copy_to_host()
    same_bits(two, want, "gate then up")
    inter = fused.swiglu_interleaved(a_d, dev(fused.interleave_gate_up(w_gate, w_up)), out=poisoned((M, F)))
    same_bits(inter.copy_to_host(), want, "interleaved")


def test_interleave_gate_up():
    """Runs of PAIR columns, gate then up; the same for a bias (1-D)."""
    K, F, P = 3, 4 * fused.PAIR, fused.PAIR
    gate, up = np.arange(K * F).reshape(K, F), -np.arange(K * F).reshape(K, F)
    w = fused.interleave_gate_up(gate, up)
    assert w.shape == (K, 2 * F)
    for i in range(F // P):
        np.testing.assert_array_equal(w[:, 2 * P * i:2 * P * i + P], gate[:, P * i:P * (i + 1)])
        np.testing.assert_array_equal(w[:, 2 * P * i + P:2 * P * (i + 1)], up[:, P * i:P * (i + 1)])
    np.testing.assert_array_equal(fused.interleave_gate_up(gate[0], up[0]), w[0])
    with pytest.raises(ValueError, match="multiple of"):
        fused.interleave_gate_up(gate[:, :-1], up[:, :-1])


def test_norm_in_the_matmul_equals_norm_then_matmul(rng):
    """matmul_narrow(norm=...) == rms_norm then matmul_narrow, for 1 row and for MAX_ROWS rows."""
    K, N = 96, 264
    for T in (1, narrow.MAX_ROWS):  # on a GPU, MAX_ROWS rows are several launches of KERNEL_ROWS
        x, gamma, w = randn(rng, T, K), 1 + randn(rng, K, scale=0.1), f32_to_bf16(randn(rng, K, N, scale=0.1))
        want = narrow.matmul_narrow(ew.rms_norm(dev(x), dev(gamma), EPS), dev(w)).copy_to_host()
        got = narrow.matmul_narrow(dev(x), dev(w), out=poisoned((T, N)), norm=(dev(gamma), EPS)).copy_to_host()
        same_bits(got, want, f"T={T}")


@pytest.mark.parametrize("K", [96, 131])  # 16-byte loads, and one element per load
def test_norm_in_the_logits_equals_norm_then_logits(rng, K):
    """matmul_transposed(norm=...) (the final norm inside the tied logits) == rms_norm then matmul_transposed."""
    N = 70
    x, gamma, table = randn(rng, 1, K), 1 + randn(rng, K, scale=0.1), f32_to_bf16(randn(rng, N, K, scale=0.1))
    want = narrow.matmul_transposed(ew.rms_norm(dev(x), dev(gamma), EPS), dev(table)).copy_to_host()
    got = narrow.matmul_transposed(dev(x), dev(table), out=poisoned((1, N)), norm=(dev(gamma), EPS))
    same_bits(got.copy_to_host(), want, f"K={K}")
    with pytest.raises(ValueError, match="one row"):  # a prefill's rows: rms_norm first
        narrow.matmul_transposed(dev(randn(rng, 2, K)), dev(table), norm=(dev(gamma), EPS))


c = SMOLLM2_135M  # several chunks: decode, and a prefill of 3 or 7 queries
CASES = ([(3, 1, 16, 1, 300), (3, 1, 16, 3, 100)] if SIMULATOR else
         [(c.n_heads, c.n_kv_heads, c.head_dim, T, n) for T, n in ((1, 300), (1, 4096), (7, 4096), (1, 16384))])


@pytest.mark.parametrize("H,Hkv,hd,T,n", CASES)
def test_flash_one_launch_equals_two(rng, H, Hkv, hd, T, n):
    """flash_decode (the chunks merged by the last block of each query and KV head to finish) gives the bits of
    flash_decode_chunks then merge_chunks; twice in a row: the first launch left its counters at zero."""
    q, k, v, page_table, positions, _, _ = paged_case(rng, T, H, Hkv, hd, n, "bf16", 16)
    assert pa.chunks_for(n, H, Hkv, hd)[1] > 1
    two = run_flash(q, k, v, page_table, positions, 16, max_len=n)
    for launch in range(2):
        one = run_flash(q, k, v, page_table, positions, 16, max_len=n, one_launch=True)
        same_bits(one, two, f"launch {launch}")


@pytest.mark.parametrize("chunks", [pa.SEQUENCE_CHUNKS, pa.BATCH_CHUNKS])
def test_flash_rows_of_several_sequences_equal_each_alone(rng, chunks):
    """flash_decode_rows (a batched step: each row through its own sequence's page table, one launch) gives every
    row the bits it gets with its sequence alone, with one sequence's chunks and with a batch's;
    the sequences' pages interleave in one pair of tables."""
    H, Hkv, hd = (3, 1, 16) if SIMULATOR else (c.n_heads, c.n_kv_heads, c.head_dim)
    page, lengths = 16, [5, max(3 * pa.chunk_unit(hd, chunks), pa.ONE_CHUNK_KEYS) + 7, 40]  # the second has several
    # chunks
    assert pa.chunks_for(lengths[1], H, Hkv, hd, chunks=chunks)[1] > 1
    counts = [-(-n // page) for n in lengths]
    order = rng.permutation(sum(counts) + 2).astype(np.int32)  # two pages nobody owns
    tables = np.split(order[:sum(counts)], np.cumsum(counts)[:-1])
    page_tables = np.zeros((len(lengths), max(counts)), np.int32)
    for s, table in enumerate(tables):
        page_tables[s, :len(table)] = table
    k, v = (f32_to_bf16(randn(rng, len(order) * page, Hkv, hd)) for _ in range(2))
    seq_of_row = np.array([0, 1, 1, 2], np.int32)  # the second sequence has two new rows (a prefill's end)
    positions = np.array([lengths[0] - 1, lengths[1] - 2, lengths[1] - 1, lengths[2] - 1], np.int32)
    q = randn(rng, len(positions), H, hd)
    batch = pa.flash_attention(dev(q), dev(k), dev(v), dev(page_tables), dev(positions), page, max_len=max(lengths),
                               out=poisoned(q.shape), seq_of_row=dev(seq_of_row), chunks=chunks).copy_to_host()
    for s, table in enumerate(tables):
        rows = seq_of_row == s
        alone = pa.flash_attention(dev(q[rows]), dev(k), dev(v), dev(table), dev(positions[rows]), page,
                                   max_len=lengths[s], out=poisoned(q[rows].shape), chunks=chunks)
        same_bits(batch[rows], alone.copy_to_host(), f"sequence {s}")
