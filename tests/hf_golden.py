"""Golden outputs of Hugging Face transformers (PyTorch, CPU, float32) on the real SmolLM2-135M-Instruct, read from
the course's default GGUF: what the NumPy reference is checked against where torch is not installed.

`python tests/hf_golden.py` (needs the `parity` extra: torch, transformers, accelerate) records data/GOLDEN_FILE;
tests/test_hf_parity.py checks our reference against it on every run, and, where torch and transformers are
installed, checks that a live transformers run still gives the recorded values (the file cannot go stale).

For each prompt (PROMPTS, then the chat prompt CHAT under the chat template, tokenized by our tokenizer):
  <key>.ids            the prompt's token ids
  <key>.positions      the positions whose logits are kept: first, middle (n // 2), last
  <key>.vocab          the vocabulary ids kept, ascending: the N_RANDOM ids drawn once from
                       np.random.default_rng(VOCAB_SEED) (vocab.random below), plus the TOP_K largest logits of
                       each kept position
  <key>.logits         float32 [len(positions), len(vocab)]: the logits at those positions and ids
  <key>.max_abs_logit  float32 [len(positions)]: max |logit| over the whole row (the scale of the tolerance)
  <key>.greedy         N_GREEDY greedy tokens after the prompt (transformers' KV cache, end tokens ignored)
and prompt (the texts), vocab.random, settings ([N_GREEDY, N_RANDOM, VOCAB_SEED, TOP_K]) and versions
(transformers, torch, numpy of the recording).

This module imports torch and transformers only inside the functions that run transformers.
"""

from __future__ import annotations

import os
import sys

import numpy as np

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
CHAT = "What is the capital of France? Answer in one sentence."
KEYS = [f"p{i}" for i in range(len(PROMPTS))] + ["chat"]  # "chat": CHAT under the chat template

GOLDEN_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                           "hf_golden_smollm2.npz")
N_GREEDY = 32
N_RANDOM = 256
VOCAB_SEED = 20261129
TOP_K = 32


def prompt_text(key: str) -> tuple[str, bool]:
    """The text of prompt `key` and whether it goes under the chat template (as course_lib.generate's chat=)."""
    return (CHAT, True) if key == "chat" else (PROMPTS[KEYS.index(key)], False)


def prompt_ids(tokenizer, key: str) -> list[int]:
    """The token ids of prompt `key` by our tokenizer, as course_lib.generate tokenizes them."""
    text, chat = prompt_text(key)
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]) if chat else text)


def kept_positions(n: int) -> np.ndarray:
    """First, middle and last positions of an n-token prompt (fewer if they coincide)."""
    return np.unique(np.array([0, n // 2, n - 1], dtype=np.int64))


def random_vocab(vocab_size: int) -> np.ndarray:
    return np.sort(np.random.default_rng(VOCAB_SEED).choice(vocab_size, N_RANDOM, replace=False)).astype(np.int64)


def load_hf():
    """transformers' own reading of the default GGUF: an independent dequantization and Q/K un-permutation."""
    import torch
    from transformers import AutoModelForCausalLM

    from course_lib.model.loading import fetch_default_gguf

    path = fetch_default_gguf(progress=False)
    directory, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def hf_logits(hf, ids) -> np.ndarray:
    """float32 [len(ids), vocab]: transformers' logits at every position."""
    import torch

    with torch.no_grad():
        return hf(torch.tensor([list(ids)])).logits[0].numpy()


def hf_greedy(hf, ids, n) -> list[int]:
    """n greedy tokens with transformers' own KV cache, ignoring end tokens."""
    import torch

    out = []
    with torch.no_grad():
        step = hf(torch.tensor([list(ids)]), use_cache=True)
        for _ in range(n):
            token = int(torch.argmax(step.logits[0, -1]))
            out.append(token)
            step = hf(torch.tensor([[token]]), cache=step.cache, use_cache=True)
    return out


def record(hf, tokenizer, vocab: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The golden arrays (module docstring) from a live transformers model `hf`, prompts tokenized by `tokenizer`.
    vocab: {key: ids} to keep these ids instead of choosing them (to compare a live run with a recorded file)."""
    import torch
    import transformers

    size = hf.config.vocab_size
    out = {"prompt": np.array([prompt_text(k)[0] for k in KEYS]), "vocab.random": random_vocab(size),
           "settings": np.array([N_GREEDY, N_RANDOM, VOCAB_SEED, TOP_K], dtype=np.int64),
           "versions": np.array([f"transformers {transformers.__version__}", f"torch {torch.__version__}",
                                 f"numpy {np.__version__}"])}
    for key in KEYS:
        ids = prompt_ids(tokenizer, key)
        positions = kept_positions(len(ids))
        rows = hf_logits(hf, ids)[positions]
        if vocab is None:
            top = np.argpartition(rows, -TOP_K, axis=1)[:, -TOP_K:]
            keep = np.union1d(out["vocab.random"], top.ravel()).astype(np.int64)
        else:
            keep = np.asarray(vocab[key], dtype=np.int64)
        out[f"{key}.ids"] = np.array(ids, dtype=np.int64)
        out[f"{key}.positions"] = positions
        out[f"{key}.vocab"] = keep
        out[f"{key}.logits"] = rows[:, keep].astype(np.float32)
        out[f"{key}.max_abs_logit"] = np.abs(rows).max(axis=1).astype(np.float32)
        out[f"{key}.greedy"] = np.array(hf_greedy(hf, ids, N_GREEDY), dtype=np.int64)
    return out


def load(path: str = GOLDEN_FILE) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as f:
        return dict(f)


def save(golden: dict[str, np.ndarray], path: str = GOLDEN_FILE) -> None:
    np.savez_compressed(path, **golden)


def main() -> None:
    from course_lib.model.loading import load_model

    path = sys.argv[1] if len(sys.argv) > 1 else GOLDEN_FILE
    golden = record(load_hf(), load_model(progress=False).tokenizer)
    save(golden, path)
    print(f"{path}: {os.path.getsize(path)} bytes; {', '.join(golden['versions'])}")
    for key in KEYS:
        print(f"  {key}: {len(golden[key + '.ids'])} prompt tokens, positions {golden[key + '.positions'].tolist()}, "
              f"{len(golden[key + '.vocab'])} vocabulary ids, max|logit| {golden[key + '.max_abs_logit'].tolist()}")


if __name__ == "__main__":
    main()
