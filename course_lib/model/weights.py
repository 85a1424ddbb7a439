"""Model weights in the layout the course computes with, and their Hugging Face names.

Every projection is stored as w[in, out] so that a layer reads like the math: y = x @ w (+ b).
Hugging Face stores nn.Linear weights as [out, in]; we transpose once when loading.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .config import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [d]
    wq: np.ndarray  # [d, d]
    wk: np.ndarray  # [d, d_kv]
    wv: np.ndarray  # [d, d_kv]
    wo: np.ndarray  # [d, d]
    mlp_norm: np.ndarray  # [d]
    w_gate: np.ndarray  # [d, d_ff]
    w_up: np.ndarray  # [d, d_ff]
    w_down: np.ndarray  # [d_ff, d]
    bq: np.ndarray | None = None  # [d]     (Qwen2)
    bk: np.ndarray | None = None  # [d_kv]  (Qwen2)
    bv: np.ndarray | None = None  # [d_kv]  (Qwen2)


@dataclass
class Weights:
    embed: np.ndarray  # [vocab, d]
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [d]
    lm_head: np.ndarray | None  # [d, vocab], None when tied: logits = x @ embed.T

    def arrays(self):
        """Yield (hf_name, array in our layout) for every tensor."""
        yield "model.embed_tokens.weight", self.embed
        yield "model.norm.weight", self.final_norm
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head
        for i, layer in enumerate(self.layers):
            for f in fields(LayerWeights):
                value = getattr(layer, f.name)
                if value is not None:
                    yield f"model.layers.{i}.{_HF_LAYER_NAMES[f.name]}", value


_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
}


def _is_matrix(our_name: str) -> bool:
    return our_name.startswith("w")


def to_hf_tensors(w: Weights) -> dict[str, np.ndarray]:
    """Hugging Face names and layout ([out, in] for projections)."""
    out = {}
    for name, arr in w.arrays():
        is_proj = arr.ndim == 2 and name != "model.embed_tokens.weight"
        out[name] = np.ascontiguousarray(arr.T) if is_proj else arr
    return out


def from_hf_tensors(tensors: dict[str, np.ndarray], config: ModelConfig) -> Weights:
    """Our layout from Hugging Face tensors; checks that every expected tensor is there with its shape."""

    def get(name, shape, transpose=False):
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name}")
        arr = tensors[name]
        expected = shape[::-1] if transpose else shape
        if tuple(arr.shape) != tuple(expected):
            raise ValueError(f"tensor {name} has shape {tuple(arr.shape)}, expected {tuple(expected)}")
        arr = arr.T if transpose else arr
        return np.ascontiguousarray(arr, dtype=np.float32)

    c = config
    shapes = {
        "attn_norm": (c.d_model,), "wq": (c.d_model, c.d_model), "wk": (c.d_model, c.d_kv),
        "wv": (c.d_model, c.d_kv), "wo": (c.d_model, c.d_model), "mlp_norm": (c.d_model,),
        "w_gate": (c.d_model, c.d_ff), "w_up": (c.d_model, c.d_ff), "w_down": (c.d_ff, c.d_model),
        "bq": (c.d_model,), "bk": (c.d_kv,), "bv": (c.d_kv,),
    }
    layers = []
    for i in range(c.n_layers):
        parts = {}
        for ours, hf in _HF_LAYER_NAMES.items():
            if ours.startswith("b") and not c.qkv_bias:
                continue
            parts[ours] = get(f"model.layers.{i}.{hf}", shapes[ours], transpose=_is_matrix(ours))
        layers.append(LayerWeights(**parts))
    lm_head = None if c.tied_embeddings else get("lm_head.weight", (c.d_model, c.vocab_size), transpose=True)
    return Weights(
        embed=get("model.embed_tokens.weight", (c.vocab_size, c.d_model)),
        layers=layers,
        final_norm=get("model.norm.weight", (c.d_model,)),
        lm_head=lm_head,
    )


def round_to_bf16(w: Weights) -> Weights:
    """The same weights rounded to bf16 (kept as float32): what a backend with bf16 weights computes with,
    so that the reference run on them is its exact counterpart. Norm weights stay float32, as on the GPU."""
    from .safetensors_io import bf16_to_f32, f32_to_bf16

    def r(a):
        return None if a is None else (a if a.ndim == 1 else bf16_to_f32(f32_to_bf16(a)))

    layers = [LayerWeights(**{f.name: r(getattr(lw, f.name)) for f in fields(LayerWeights)}) for lw in w.layers]
    return Weights(embed=r(w.embed), layers=layers, final_norm=w.final_norm, lm_head=r(w.lm_head))
