"""The generator: prefill the prompt, then decode one token at a time, on a backend.

A backend holds one sequence's state and exposes prefill(ids) -> logits [V] of the last prompt token and
decode(id) -> logits [V] of the next position. Sampling happens here, on the host, in float64.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from . import reference
from .model import Model


@dataclass
class Generation:
    """The result of generate(): new token ids (a final stop token included), their text (without it), timing."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: str  # "stop_token" or "max_new_tokens"
    prefill_s: float
    decode_s: float
    backend: str
    step_s: list[float] = field(default_factory=list, repr=False)  # wall time of each decode step

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of generation (prefill included)."""
        return len(self.token_ids) / max(self.prefill_s + self.decode_s, 1e-12)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode rate: tokens after the first one, per second of decode steps."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


class NumpyBackend:
    """The reference forward pass (course_lib.reference) as a backend."""

    name = "numpy"

    def __init__(self, model: Model, capacity: int):
        self.model = model
        self.cache = reference.KVCache(model.config, capacity)
        self.rope = reference.rope_tables(model.config, capacity)

    def prefill(self, ids: list[int]) -> np.ndarray:
        return reference.forward(self.model.weights, self.model.config, np.asarray(ids), self.cache, self.rope)

    def decode(self, token: int) -> np.ndarray:
        return reference.forward(self.model.weights, self.model.config, np.asarray([token]), self.cache, self.rope)


def _cuda_backend(model: Model, capacity: int):
    from .cuda_backend import CudaBackend  # imported on demand: it loads Numba's CUDA support

    return CudaBackend(model, capacity)


BACKENDS = {"numpy": NumpyBackend, "cuda": _cuda_backend}


def _backend_class(name: str):
    if name == "auto":
        from .device import gpu_available

        name = "cuda" if gpu_available() else "numpy"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (available: auto, {', '.join(BACKENDS)})")
    return BACKENDS[name]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def sample(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None,
           rng: np.random.Generator) -> int:
    """Pick the next token. temperature 0 -> argmax (lowest id on ties); else softmax(logits / temperature),
    restricted to the top_k most likely tokens, then to the smallest set whose probability reaches top_p."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k is not None:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p is not None:
        keep = int(np.searchsorted(np.cumsum(p), top_p)) + 1  # first index where the cumulative sum reaches top_p
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


def prompt_ids(model: Model, prompt: str | list[int], chat: bool) -> list[int]:
    """Tokenize (applying the chat template if asked) and check the ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        text = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = model.tokenizer.encode(text)
    else:
        if chat:
            raise ValueError("chat=True needs a text prompt, not token ids")
        ids = [int(i) for i in prompt]
        bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {model.config.vocab_size}): {bad[:5]}")
    if not ids:
        raise ValueError("the prompt is empty")
    return ids


def generate(model: Model, prompt: str | list[int], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None, chat: bool = False,
             backend: str = "auto", stream=None, stop: bool = True) -> Generation:
    """Generate up to max_new_tokens after the prompt.

    stream: called with each new piece of text as soon as it is complete (whole UTF-8 characters).
    stop=False ignores the model's end tokens (useful to compare long continuations).
    """
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    ids = prompt_ids(model, prompt, chat)
    limit = model.config.max_seq_len
    if len(ids) + max_new_tokens > limit:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the model's "
                         f"context of {limit} positions")
    rng = np.random.default_rng(seed)
    engine = _backend_class(backend)(model, len(ids) + max_new_tokens)
    tok = model.tokenizer

    t0 = time.perf_counter()
    logits = engine.prefill(ids)
    token = sample(logits, temperature, top_k, top_p, rng)
    prefill_s = time.perf_counter() - t0
    out, steps, emitted, reason = [token], [], "", "max_new_tokens"
    while True:
        if stop and token in tok.stop_ids:
            reason = "stop_token"
            break
        if stream is not None:
            text = tok.decode(out)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                stream(text[len(emitted):])
                emitted = text
        if len(out) == max_new_tokens:
            break
        t = time.perf_counter()
        token = sample(engine.decode(token), temperature, top_k, top_p, rng)
        steps.append(time.perf_counter() - t)
        out.append(token)
    body = out[:-1] if reason == "stop_token" else out
    text = tok.decode(body)
    if stream is not None and len(text) > len(emitted):
        stream(text[len(emitted):])
    return Generation(ids, out, text, reason, prefill_s, sum(steps), engine.name, steps)
