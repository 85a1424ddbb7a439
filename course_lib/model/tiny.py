"""A tiny model of the same architecture, built by course_lib itself: seeded random weights and a byte-level
tokenizer. It runs in milliseconds on NumPy and fits the CUDA simulator; tests and notebooks use it."""

from __future__ import annotations

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .config import ModelConfig
from .loading import Model
from .tokenizer import Tokenizer
from .weights import LayerWeights, Weights

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def tiny_config(arch: str = "llama", tied: bool = True, **overrides) -> ModelConfig:
    """2 layers, d=64, 4 query heads sharing 2 KV heads (GQA), d_ff=160, 262 tokens (256 bytes + specials)."""
    base = dict(arch=arch, vocab_size=262, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160,
                max_seq_len=256, rope_theta=10000.0, rms_eps=1e-5, tied_embeddings=tied,
                qkv_bias=arch == "qwen2", name=f"tiny-{arch}")
    return ModelConfig(**(base | overrides))


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte, then the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    return Tokenizer(tok, CHAT_TEMPLATE, bos_id=im_start, eos_id=im_end)


def tiny_weights(config: ModelConfig, seed: int = 0) -> Weights:
    """Seeded random weights scaled like a trained model's: projections ~ N(0, 1/fan_in), norms ~ 1."""
    rng = np.random.default_rng(seed)
    c = config

    def mat(n_in, n_out):
        return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)

    def vec(n, center=1.0, spread=0.1):
        return (center + spread * rng.standard_normal(n)).astype(np.float32)

    layers = []
    for _ in range(c.n_layers):
        bias = c.qkv_bias
        layers.append(LayerWeights(
            attn_norm=vec(c.d_model), wq=mat(c.d_model, c.d_model), wk=mat(c.d_model, c.d_kv),
            wv=mat(c.d_model, c.d_kv), wo=mat(c.d_model, c.d_model), mlp_norm=vec(c.d_model),
            w_gate=mat(c.d_model, c.d_ff), w_up=mat(c.d_model, c.d_ff), w_down=mat(c.d_ff, c.d_model),
            bq=vec(c.d_model, 0, 0.5) if bias else None, bk=vec(c.d_kv, 0, 0.5) if bias else None,
            bv=vec(c.d_kv, 0, 0.5) if bias else None,
        ))
    embed = (0.3 * rng.standard_normal((c.vocab_size, c.d_model))).astype(np.float32)  # logits of std ~2
    lm_head = None if c.tied_embeddings else mat(c.d_model, c.vocab_size)
    return Weights(embed=embed, layers=layers, final_norm=vec(c.d_model), lm_head=lm_head)


def tiny_model(arch: str = "llama", tied: bool = True, seed: int = 0, **overrides) -> Model:
    """The tiny model: tiny_model() is Llama-like with tied embeddings; tiny_model('qwen2', tied=False) adds
    QKV bias and an untied head."""
    config = tiny_config(arch, tied, **overrides)
    return Model(config, byte_tokenizer(), tiny_weights(config, seed), source=f"tiny({arch}, seed={seed})")


def random_model(config: ModelConfig, seed: int = 0) -> Model:
    """A model of config's shapes (e.g. config.LLAMA_32_1B) with seeded random weights (`tiny_weights`) and the byte
    tokenizer: speed measured at a real model's shapes without its weights (`bench --model random:NAME`); its
    tokens mean nothing."""
    return Model(config, byte_tokenizer(), tiny_weights(config, seed), source=f"random({config.name}, seed={seed})")
