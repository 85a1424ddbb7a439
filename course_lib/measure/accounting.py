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


def decode_cost(c: ModelConfig, context: int, weight_bytes: int = 2, kv_bytes: int = 4) -> Cost:
    """One decode step at a context of `context` positions (batch 1): weights + KV cache read once."""
    flops = 2 * matmul_params(c) + 4 * context * c.d_model * c.n_layers
    moved = weight_bytes_per_token(c, weight_bytes) + (context + 1) * c.kv_bytes_per_position(kv_bytes)
    return Cost(flops, moved)


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
