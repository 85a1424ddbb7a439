"""Read a llama.cpp GGUF file: metadata, and tensors dequantized to float32 in Hugging Face names and layout."""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from .config import ModelConfig

# GGUF tensor names -> Hugging Face names ({i} is the layer index).
_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _hf_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        key = ".".join(["blk", "{i}"] + parts[2:])
        hf = _GGUF_TO_HF.get(key)
        return hf.format(i=parts[1]) if hf else None
    return _GGUF_TO_HF.get(gguf_name)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K projection rows.

    For RoPE on adjacent pairs, llama.cpp's converter interleaves each head's rows: HF row j of the first half
    and row j of the second half become rows 2j and 2j+1. w [n_heads*hd, ...] in GGUF order -> HF order.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The converter's reordering (HF order -> GGUF order); the inverse of unpermute_rope_rows."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str, progress: bool = True) -> tuple[ModelConfig, dict, dict[str, np.ndarray]]:
    """-> (config, metadata {key: value}, tensors {hf_name: float32 array in HF layout})."""
    import gguf  # imported here: only GGUF loading needs it

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception:  # a field of a type we do not use (gguf raises varied errors on exotic ones)
            continue
    try:
        vocab_size = len(meta["tokenizer.ggml.tokens"])
        config = ModelConfig.from_gguf_fields(meta, vocab_size, name=str(meta.get("general.name", "")))
    except KeyError as e:
        raise ValueError(f"{path}: GGUF metadata lacks {e}") from None
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        if name is None:
            if t.name == "rope_freqs.weight":
                raise ValueError(f"{path}: RoPE frequency scaling (rope_freqs) is not supported")
            continue
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        arr = arr.reshape([int(n) for n in reversed(t.shape)]) if arr.ndim != len(t.shape) else arr
        if t.name.endswith(("attn_q.weight", "attn_q.bias")) and config.arch == "llama":
            arr = unpermute_rope_rows(arr, config.n_heads)
        elif t.name.endswith(("attn_k.weight", "attn_k.bias")) and config.arch == "llama":
            arr = unpermute_rope_rows(arr, config.n_kv_heads)
        tensors[name] = arr
    tied = "lm_head.weight" not in tensors
    if not tied:
        from dataclasses import replace

        config = replace(config, tied_embeddings=False)
    return config, meta, tensors
