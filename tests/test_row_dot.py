"""The one-pass projections (kernels/row_dot.py) against float64 references, with bounds derived from the arithmetic:
the norm, the dot products (a warp's sum of K products, in its own order), RoPE and SwiGLU on top. Fresh random
inputs, poisoned outputs; a row's bits do not depend on the rows launched with it. In the simulator on the tiny
model's shapes and a long row (two chunks of weight loads); on a GPU on the real models' shapes too."""

import numpy as np
import pytest
from checks import REAL_MODELS, U32, check, dev, poisoned, randn

from course_lib.kernels import SIMULATOR
from course_lib.kernels import row_dot as rd
from course_lib.model.safetensors_io import bf16_to_f32, f32_to_bf16

EPS = 1e-5
SMALL = [pytest.param(dict(d=64, H=4, Hkv=2, hd=16, F=160), id="tiny")]
SHAPES = SMALL if SIMULATOR else SMALL + [pytest.param(dict(d=c.d_model, H=c.n_heads, Hkv=c.n_kv_heads,
                                                            hd=c.head_dim, F=c.d_ff), id=p.id)
                                          for p in REAL_MODELS for c in p.values]


def weights(rng, K, N, dtype):
    """(stored [K, N], its float64 values): float32, or bf16 bits and the values they hold."""
    w = randn(rng, K, N, scale=K ** -0.5)
    if dtype == "f32":
        return w, w.astype(np.float64)
    bits = f32_to_bf16(w)
    return bits, bf16_to_f32(bits).astype(np.float64)


def normed64(x, gamma):
    """RMSNorm in float64: x / sqrt(mean(x^2) + eps) * gamma."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * gamma


def projection_bound(h, w):
    """|kernel - exact| for h @ w with h = x gamma / rms(x): a float32 sum of K products errs by at most K u of
    sum |h_k w_k| (the gamma_K bound), the products x gamma by u each, and the division by the RMS (a sum of K
    squares, a mean, a square root, a division: K + 8 u) multiplies the whole: (2 K + 8) u sum |h_k w_k|, doubled
    for safety of the bound's first-order form."""
    return 2 * (2 * h.shape[-1] + 8) * U32 * (np.abs(h) @ np.abs(w))


PROJECT_CASES = (  # (K, N, T, weights, normed); T = 6: two chunks of ROWS rows; K = 2112: two chunks of weight loads
    [(64, 160, 1, "bf16", True), (64, 40, 6, "f32", False), (2112, 6, 6, "bf16", True), (2112, 6, 1, "f32", False)]
    if SIMULATOR else [(K, N, T, dtype, normed) for K, N in ((576, 576), (1536, 576), (2048, 2048), (8192, 2048))
                       for T in (1, 3, 6) for dtype, normed in (("bf16", True), ("f32", False))])


@pytest.mark.parametrize("K,N,T,dtype,normed", PROJECT_CASES)
def test_project_matches_float64(rng, K, N, T, dtype, normed):
    """out = h @ W.T, and out += h @ W.T (the residual); each row's bits equal to the row launched alone."""
    x, gamma = randn(rng, T, K), 1 + randn(rng, K, scale=0.1)
    x[0] *= 3e-3  # a row whose mean square is about eps: the norm's eps then moves it by a third
    stored, w64 = weights(rng, K, N, dtype)
    rows = dev(rd.output_rows(stored))
    norm = (dev(gamma), EPS) if normed else None
    h = normed64(x, gamma) if normed else x.astype(np.float64)
    got = rd.project(dev(x), rows, poisoned((T, N)), norm).copy_to_host()
    check(got, h @ w64, projection_bound(h, w64), "project")
    alone = rd.project(dev(x[-1:]), rows, poisoned((1, N)), norm).copy_to_host()
    np.testing.assert_array_equal(got[-1:].view(np.uint32), alone.view(np.uint32), "a row alone")
    residual = randn(rng, T, N)
    added = rd.project(dev(x), rows, dev(residual), norm, accumulate=True).copy_to_host()
    want = residual + h @ w64
    check(added, want, projection_bound(h, w64) + 2 * U32 * np.abs(want), "project, accumulate")


def rope64(a, b, c, s):
    return a * c - b * s, b * c + a * s


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T,dtype,bias,kv", [(1, "bf16", False, np.uint16), (3, "bf16", True, np.uint16),
                                             (5, "f32", True, np.float32)])
def test_qkv_rope_matches_float64(rng, shape, T, dtype, bias, kv):
    """RMSNorm, [q | k | v] = h @ W (+ bias), RoPE on the q and k heads at each row's position, q stored, k and v
    into their cache rows (one slot skipped: its row keeps its poison, as every row nobody writes)."""
    d, H, Hkv, hd = shape["d"], shape["H"], shape["Hkv"], shape["hd"]
    N, half = (H + 2 * Hkv) * hd, hd // 2
    x, gamma = randn(rng, T, d), 1 + randn(rng, d, scale=0.1)
    stored, w64 = weights(rng, d, N, dtype)
    b = randn(rng, N) if bias else np.zeros(N, np.float32)
    cos, sin = randn(rng, 64, half), randn(rng, 64, half)
    positions = rng.integers(0, 64, T).astype(np.int32)
    slots = rng.permutation(40)[:T].astype(np.int32)
    slots[0] = -1
    k_table, v_table = poisoned((40, Hkv, hd), kv), poisoned((40, Hkv, hd), kv)
    q = rd.qkv_rope(dev(x), dev(rd.paired_qkv(stored, hd)), dev(rd.paired_qkv(b, hd)) if bias else None,
                    (dev(gamma), EPS), dev(cos), dev(sin), dev(positions), dev(slots), poisoned((T, H * hd)), k_table,
                    v_table).copy_to_host()

    h = normed64(x, gamma)
    y = (h @ w64 + b).reshape(T, H + 2 * Hkv, hd)
    tol = (projection_bound(h, np.abs(w64)) + 2 * U32 * np.abs(b)).reshape(y.shape)  # each output's sum, + bias
    c, s = cos[positions][:, None].astype(np.float64), sin[positions][:, None].astype(np.float64)
    rotated = slice(0, H + Hkv)  # the q and k heads; an output of a pair carries both inputs' errors, times |c| + |s|
    a, b_ = y[:, rotated, :half], y[:, rotated, half:]
    spread = (np.abs(c) + np.abs(s)) * (tol[:, rotated, :half] + tol[:, rotated, half:] + 4 * U32 * (np.abs(a) +
                                                                                                   np.abs(b_)))
    y[:, rotated] = np.concatenate(rope64(a, b_, c, s), axis=-1)
    tol[:, rotated] = np.concatenate([spread, spread], axis=-1)
    if kv == np.uint16:  # bf16 in the cache: half a bf16 ulp, 2^-9 relative, more
        tol[:, H:] += 2.0 ** -8 * np.abs(y[:, H:])
    check(q, y[:, :H].reshape(T, H * hd), tol[:, :H].reshape(T, H * hd), "q")
    for name, table, part in (("k", k_table, y[:, H:H + Hkv]), ("v", v_table, y[:, H + Hkv:])):
        got = table.copy_to_host()
        got = bf16_to_f32(got) if kv == np.uint16 else got
        if T > 1:
            check(got[slots[1:]], part[1:], tol[1:, H:H + Hkv] if name == "k" else tol[1:, H + Hkv:], f"{name} cache")
        untouched = np.setdiff1d(np.arange(40), slots[1:])
        assert np.isnan(got[untouched]).all(), f"{name} cache: a row nobody writes was written"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T,dtype", [(1, "bf16"), (6, "f32")])
def test_gate_up_swiglu_matches_float64(rng, shape, T, dtype):
    """out = silu(h @ Wg) * (h @ Wu) on the paired rows; each row's bits equal to the row launched alone."""
    d, F = shape["d"], shape["F"] if T == 1 or not SIMULATOR else 40  # (the simulator runs each thread in Python)
    x, gamma = randn(rng, T, d), 1 + randn(rng, d, scale=0.1)
    (g_st, g64), (u_st, u64) = weights(rng, d, F, dtype), weights(rng, d, F, dtype)
    rows, norm = dev(rd.paired_gate_up(g_st, u_st)), (dev(gamma), EPS)
    got = rd.gate_up_swiglu(dev(x), rows, norm, poisoned((T, F))).copy_to_host()
    h = normed64(x, gamma)
    g, u = h @ g64, h @ u64
    silu = g / (1 + np.exp(-g))
    # d silu / dg is within [-0.1, 1.1]; d (silu u) / du = silu; then exp, add, divide, multiply: 16 u
    tol = 1.1 * np.abs(u) * projection_bound(h, g64) + np.abs(silu) * projection_bound(h, u64) + 16 * U32 * np.abs(
        silu * u)
    check(got, silu * u, tol, "silu(gate) * up")
    alone = rd.gate_up_swiglu(dev(x[-1:]), rows, norm, poisoned((1, F))).copy_to_host()
    np.testing.assert_array_equal(got[-1:].view(np.uint32), alone.view(np.uint32), "a row alone")


def test_weight_layouts():
    """paired_qkv: rows 2p, 2p + 1 are outputs i and i + hd / 2 of head p // (hd / 2); a bias likewise.
    paired_gate_up: gate j then up j. output_rows: the transpose."""
    K, hd, heads = 3, 4, 3
    w = np.arange(K * hd * heads).reshape(K, hd * heads)
    rows = rd.paired_qkv(w, hd)
    order = [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11]
    np.testing.assert_array_equal(rows, w.T[order])
    np.testing.assert_array_equal(rd.paired_qkv(w[0], hd), w[0][order])
    gate, up = np.arange(6).reshape(3, 2), -np.arange(6).reshape(3, 2)
    np.testing.assert_array_equal(rd.paired_gate_up(gate, up), [gate[:, 0], up[:, 0], gate[:, 1], up[:, 1]])
    np.testing.assert_array_equal(rd.output_rows(gate), gate.T)
    with pytest.raises(ValueError, match="whole heads"):
        rd.paired_qkv(w[:, :-1], hd)


def test_bad_shapes_are_refused(rng):
    rows = dev(rd.output_rows(randn(rng, 64, 8)))
    with pytest.raises(ValueError, match="multiple of 8"):
        rd.project(dev(randn(rng, 1, 60)), dev(randn(rng, 8, 60)), poisoned((1, 8)))
    with pytest.raises(ValueError, match="expected"):
        rd.project(dev(randn(rng, 1, 64)), rows, poisoned((1, 9)))
    with pytest.raises(ValueError, match="norm's weights"):
        rd.project(dev(randn(rng, 1, 64)), rows, poisoned((1, 8)), (dev(randn(rng, 32)), EPS))
    hd, table = 8, dev(np.zeros((4, 1, 8), np.float32))  # 2 query heads and 1 KV head of 8: 32 outputs
    full = dev(randn(rng, 4, hd))  # cos and sin as wide as a head, not half of it: the pairs' angles
    with pytest.raises(ValueError, match="hd / 2"):
        rd.qkv_rope(dev(randn(rng, 1, 64)), dev(rd.paired_qkv(randn(rng, 64, 32), hd)), None, None, full, full,
                    dev(np.zeros(1, np.int32)), dev(np.zeros(1, np.int32)), poisoned((1, 16)), table, table)
