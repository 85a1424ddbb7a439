"""The reference ops against independent float64 definitions, and the cache against recomputation."""

import numpy as np
import pytest
from checks import U32

from course_lib import reference


def test_rms_norm(rng):
    x = rng.standard_normal((5, 96)).astype(np.float32) * 3
    x[0] *= 1e-3  # a row whose mean square is about eps: where eps sits counts
    w = rng.standard_normal(96).astype(np.float32)
    x64 = x.astype(np.float64)
    expected = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(reference.rms_norm(x, w, 1e-5), expected, rtol=0, atol=64 * U32 * np.abs(expected).max())


def test_rope_tables_are_the_angles_of_the_paper():
    """angle(p, i) = p theta^(-2i / hd) for the pair (i, i + hd/2): the tables at two positions, written out."""
    from course_lib.model.config import SMOLLM2_135M as c

    cos, sin = reference.rope_tables(c, 101)
    i = np.arange(c.head_dim // 2)
    for p in (1, 100):
        angle = p * c.rope_theta ** (-2.0 * i / c.head_dim)
        np.testing.assert_allclose(cos[p], np.cos(angle), rtol=0, atol=2 * U32)
        np.testing.assert_allclose(sin[p], np.sin(angle), rtol=0, atol=2 * U32)


def test_rope_is_a_rotation_that_encodes_relative_position(tiny, rng):
    c = tiny.config
    cos, sin = reference.rope_tables(c, 64)
    q = rng.standard_normal((1, 1, c.head_dim)).astype(np.float32)
    k = rng.standard_normal((1, 1, c.head_dim)).astype(np.float32)
    np.testing.assert_array_equal(reference.rope(q, cos[:1], sin[:1]), q)  # position 0: identity

    def at(x, p):
        return reference.rope(x, cos[p:p + 1], sin[p:p + 1])

    def dot_at(m, n):
        return float(np.sum(at(q, m) * at(k, n)))

    assert dot_at(10, 3) == pytest.approx(dot_at(40, 33), rel=1e-5)  # depends on m - n only
    rotated = reference.rope(q, cos[17:18], sin[17:18])
    assert np.linalg.norm(rotated) == pytest.approx(np.linalg.norm(q), rel=1e-6)
    e0 = np.zeros_like(q)
    e0[0, 0, 0] = 1  # component 0 turns toward component hd/2 by +angle (the angle of pair 0 at position 1 is 1)
    np.testing.assert_array_equal(at(e0, 1)[0, 0, [0, c.head_dim // 2]], [cos[1, 0], sin[1, 0]])
    assert sin[1, 0] > 0


def naive_attention(q, k, v, positions):
    """Loop over queries and heads in float64."""
    T, H, hd = q.shape
    group = H // k.shape[1]
    out = np.zeros((T, H, hd))
    for t in range(T):
        for h in range(H):
            keys, values = k[: positions[t] + 1, h // group], v[: positions[t] + 1, h // group]
            s = keys.astype(np.float64) @ q[t, h] / np.sqrt(hd)
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ values
    return out


@pytest.mark.parametrize("T,S,H,Hkv", [(1, 1, 4, 4), (1, 37, 6, 2), (5, 5, 4, 1), (3, 20, 9, 3)])
def test_attention(rng, T, S, H, Hkv):
    hd = 16
    q = rng.standard_normal((T, H, hd)).astype(np.float32)
    k = rng.standard_normal((S, Hkv, hd)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, hd)).astype(np.float32)
    positions = np.arange(S - T, S)
    expected = naive_attention(q, k, v, positions)
    np.testing.assert_allclose(reference.attention(q, k, v, positions), expected, rtol=0, atol=1e-5)


def test_swiglu_and_linear(rng):
    g, u = rng.standard_normal((2, 3, 10)).astype(np.float32)
    np.testing.assert_allclose(reference.swiglu(g, u), g / (1 + np.exp(-g.astype(np.float64))) * u, rtol=1e-6)
    x, w, b = rng.standard_normal((2, 5)), rng.standard_normal((5, 3)), rng.standard_normal(3)
    np.testing.assert_allclose(reference.linear(x, w, b), x @ w + b)


@pytest.mark.parametrize("flavour", ["tiny", "tiny_qwen"])
def test_decoding_with_cache_equals_prefill(request, flavour, rng):
    """Logits of token-by-token decoding == logits of one prefill over the whole sequence."""
    model = request.getfixturevalue(flavour)
    c = model.config
    ids = rng.integers(0, c.vocab_size, 30)
    rope = reference.rope_tables(c, 30)
    full = reference.forward(model.weights, c, ids, reference.KVCache(c, 30), rope, all_logits=True)
    cache = reference.KVCache(c, 30)
    steps = [reference.forward(model.weights, c, ids[:10], cache, rope)]
    steps += [reference.forward(model.weights, c, ids[i:i + 1], cache, rope) for i in range(10, 30)]
    np.testing.assert_allclose(np.stack(steps), full[9:], rtol=0, atol=1e-4 * np.abs(full).max())
    assert np.all(np.isfinite(full))


def test_cache_overflow_is_an_error(tiny):
    c = tiny.config
    cache = reference.KVCache(c, 4)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        reference.forward(tiny.weights, c, np.arange(5), cache, reference.rope_tables(c, 8))
