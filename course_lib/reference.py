"""The NumPy definition of every operation and of the whole forward pass: the ground truth of the course.

All activations are float32. Shapes: T tokens in the pass, d = d_model, H query heads, Hkv key/value heads,
hd = head_dim, S positions in the cache, V vocabulary.
"""

from __future__ import annotations

import numpy as np

from .model.config import ModelConfig
from .model.weights import LayerWeights, Weights


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table [V, d], ids [T] -> [T, d]: one row of the table per token."""
    return table[ids].astype(np.float32)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [T, d], w [d] -> x / sqrt(mean(x^2) + eps) * w, row by row."""
    ms = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(ms + np.float32(eps))) * w


def linear(x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """x [T, in], w [in, out], b [out] or None -> x @ w + b, [T, out]."""
    y = x @ w
    return y + b if b is not None else y


def rope_tables(config: ModelConfig, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [n_positions, hd/2] (float32): angle(p, i) = p * theta^(-2i/hd), computed in float64."""
    hd = config.head_dim
    inv_freq = config.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    angles = np.arange(n_positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd], cos/sin [T, hd/2] -> x rotated by position.

    Hugging Face's layout: component i is paired with component i + hd/2 (not with i + 1), and each pair
    (a, b) becomes (a cos - b sin, a sin + b cos).
    """
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax: exp(x - max) / sum(exp(x - max))."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention over a KV cache.

    q [T, H, hd] at absolute positions [T]; k, v [S, Hkv, hd] hold the cache rows 0..S-1 (the new tokens
    included). Query t sees keys 0..positions[t]. Query head h uses KV head h // (H / Hkv). -> [T, H, hd]
    """
    T, H, hd = q.shape
    S, Hkv, _ = k.shape
    group = H // Hkv
    qg = q.reshape(T, Hkv, group, hd)
    scores = np.einsum("tkgd,skd->kgts", qg, k) / np.float32(np.sqrt(hd))  # [Hkv, group, T, S]
    visible = np.arange(S)[None, :] <= positions[:, None]  # [T, S]
    scores = np.where(visible, scores, -np.inf)
    out = np.einsum("kgts,skd->tkgd", softmax(scores), v)
    return out.reshape(T, H, hd).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [T, d_ff] -> silu(gate) * up."""
    return silu(gate) * up


def logits(x: np.ndarray, w: Weights) -> np.ndarray:
    """x [T, d] (final-normed) -> [T, V]: x @ embed.T when embeddings are tied, else x @ lm_head."""
    return x @ w.embed.T if w.lm_head is None else x @ w.lm_head


class KVCache:
    """Keys and values of every layer for one sequence: k[layer], v[layer] are [capacity, Hkv, hd].

    What `block` asks of a cache: write(layer, positions, k, v) and read(layer, end) (the rows of positions
    0 .. end - 1); `forward` also reads and sets `length` and reads `capacity`. The batched generator's paged
    cache (course_lib.batch) offers the same."""

    def __init__(self, config: ModelConfig, capacity: int):
        shape = (config.n_layers, capacity, config.n_kv_heads, config.head_dim)
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.capacity = capacity
        self.length = 0  # positions filled

    def write(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """k, v [T, Hkv, hd] become the keys and values of `positions` [T]."""
        self.k[layer, positions] = k
        self.v[layer, positions] = v

    def read(self, layer: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) [end, Hkv, hd] of positions 0 .. end - 1."""
        return self.k[layer, :end], self.v[layer, :end]


def block(x: np.ndarray, lw: LayerWeights, config: ModelConfig, layer: int, cache: KVCache,
          positions: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """One transformer layer. x [T, d] -> [T, d]; writes this pass's K and V rows into the cache."""
    T, c = x.shape[0], config
    h = rms_norm(x, lw.attn_norm, c.rms_eps)
    q = linear(h, lw.wq, lw.bq).reshape(T, c.n_heads, c.head_dim)
    k = linear(h, lw.wk, lw.bk).reshape(T, c.n_kv_heads, c.head_dim)
    v = linear(h, lw.wv, lw.bv).reshape(T, c.n_kv_heads, c.head_dim)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    cache.write(layer, positions, k, v)
    a = attention(q, *cache.read(layer, positions[-1] + 1), positions)
    x = x + linear(a.reshape(T, c.d_model), lw.wo)
    h = rms_norm(x, lw.mlp_norm, c.rms_eps)
    return x + linear(swiglu(linear(h, lw.w_gate), linear(h, lw.w_up)), lw.w_down)


def forward(weights: Weights, config: ModelConfig, ids: np.ndarray, cache: KVCache,
            rope_cs: tuple[np.ndarray, np.ndarray], all_logits: bool = False) -> np.ndarray:
    """Run T new tokens (prefill: T = prompt length; decode: T = 1) after the cache's current contents.

    ids [T] -> logits [V] of the last token, or [T, V] with all_logits=True.
    """
    ids = np.asarray(ids)
    start, T = cache.length, len(ids)
    if start + T > cache.capacity:
        raise ValueError(f"the KV cache holds {cache.capacity} positions; {start} used + {T} new do not fit")
    positions = np.arange(start, start + T)
    cos, sin = rope_cs[0][positions], rope_cs[1][positions]
    x = embedding(weights.embed, ids)
    for i, lw in enumerate(weights.layers):
        x = block(x, lw, config, i, cache, positions, cos, sin)
    cache.length = start + T
    x = rms_norm(x if all_logits else x[-1:], weights.final_norm, config.rms_eps)
    out = logits(x, weights)
    return out if all_logits else out[0]
