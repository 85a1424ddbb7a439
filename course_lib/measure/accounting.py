"""FLOP and byte accounting for a Llama-family model, the bandwidth bound on decoding, and a roofline plot.

Counts follow the transformer-anatomy chapter: a matmul of a [T, K] activation by a [K, N] weight costs
2*T*K*N FLOPs and reads K*N weights; attention over S cached positions costs 4*S*d FLOPs per token
(q.k and p.v for every head) and reads the cache's K and V rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.config import ModelConfig


def matmul_params(c: ModelConfig) -> int:
    """Weights that take part in a matmul for every token: all projections and the output head."""
    per_layer = c.d_model * (c.d_model + 2 * c.d_kv) + c.d_model * c.d_model + 3 * c.d_model * c.d_ff
    return c.n_layers * per_layer + c.vocab_size * c.d_model


def weight_bytes_per_token(c: ModelConfig, weight_bytes: int) -> int:
    """Bytes of weights one decode step reads: every matrix once, plus one embedding row and the norms."""
    norms = (2 * c.n_layers + 1) * c.d_model
    return (matmul_params(c) + c.d_model + norms) * weight_bytes


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes


def decode_cost(c: ModelConfig, context: int, weight_bytes: int = 2, kv_bytes: int = 4, batch: int = 1) -> Cost:
    """One decode step of `batch` sequences, each at a context of `context` positions: the weights read once for
    all of them, each sequence's KV cache read once. The intensity grows with the batch while the weights dominate
    the bytes, and stops growing once the caches do."""
    flops = batch * (2 * matmul_params(c) + 4 * context * c.d_model * c.n_layers)
    moved = weight_bytes_per_token(c, weight_bytes) + batch * (context + 1) * c.kv_bytes_per_position(kv_bytes)
    return Cost(flops, moved)


def layer_costs(c: ModelConfig, tokens: int = 1, context: int = 0, weight_bytes: int = 2,
                kv_bytes: int = 4) -> dict[str, Cost]:
    """FLOPs and bytes of each operation of one layer for `tokens` new tokens after `context` cached positions (a
    decode step: tokens = 1; a prefill: context = 0), in the order a layer runs them: the projections (a [T, K] x
    [K, N] product: 2 T K N FLOPs, the K N weights read once, float32 activations in and out) and attention (the
    scores and the weighted values, 4 d FLOPs per key a token sees, causal; the cache's keys and values read once,
    float32 queries in and out)."""
    d, T, f, act = c.d_model, tokens, c.d_ff, 4

    def proj(K: int, N: int) -> Cost:
        return Cost(2 * T * K * N, K * N * weight_bytes + T * (K + N) * act)

    seen = T * context + T * (T + 1) // 2  # keys seen, summed over the new tokens
    cache = (context + T) * 2 * c.d_kv * kv_bytes
    return {"q": proj(d, d), "k": proj(d, c.d_kv), "v": proj(d, c.d_kv), "attention": Cost(4 * d * seen,
            cache + 2 * T * d * act), "o": proj(d, d), "gate": proj(d, f), "up": proj(d, f), "down": proj(f, d)}


def attention_share(c: ModelConfig, tokens: int, causal: bool = True, mlp: bool = True) -> float:
    """The share of a prefill's layer FLOPs spent in attention's two products (scores, weighted values), for a
    prompt of `tokens` tokens. causal: each token sees the keys before it only (half the square), as a causal model
    computes it; mlp: the MLP's projections counted. Without both, attention against the attention projections
    alone over the full square: the usual headline figures (about 10% at 512 tokens for d = 4096, 50% at 4k)."""
    costs = layer_costs(c, tokens)
    attention = costs["attention"].flops if causal else 4 * c.d_model * tokens * tokens
    others = sum(cost.flops for name, cost in costs.items()
                 if name != "attention" and (mlp or name not in ("gate", "up", "down")))
    return attention / (attention + others)


def prefill_cost(c: ModelConfig, n_tokens: int, weight_bytes: int = 2, kv_bytes: int = 4) -> Cost:
    """A prefill of n_tokens: weights read once for all tokens; causal attention ~ 2*T^2*d FLOPs per layer."""
    flops = 2 * matmul_params(c) * n_tokens + 2 * n_tokens**2 * c.d_model * c.n_layers
    moved = weight_bytes_per_token(c, weight_bytes) + n_tokens * c.kv_bytes_per_position(kv_bytes)
    return Cost(flops, moved)


def tokens_per_s_bound(c: ModelConfig, bandwidth: float, context: int = 0, weight_bytes: int = 2,
                       kv_bytes: int = 4) -> float:
    """Decode tokens/s if every byte moved at `bandwidth` (bytes/s) and nothing else cost time."""
    return bandwidth / decode_cost(c, context, weight_bytes, kv_bytes).bytes


def plot_roofline(ax, peak_flops: float, bandwidth: float, points: dict[str, Cost], title: str = ""):
    """Roofline on a matplotlib Axes: attainable FLOP/s = min(peak, bandwidth * intensity), points placed on it."""
    import numpy as np

    x = np.logspace(-1, 4, 200)
    ax.loglog(x, np.minimum(peak_flops, bandwidth * x) / 1e12, "k-", lw=2, label="roofline")
    ridge = peak_flops / bandwidth
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_flops / 1e12 / 30), rotation=90, fontsize=8,
                color="gray", ha="right")
    for name, cost in points.items():
        y = min(peak_flops, bandwidth * cost.intensity) / 1e12
        ax.plot(cost.intensity, y, "o", ms=7, label=f"{name}: {cost.intensity:.1f} FLOP/B")
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    return ax
