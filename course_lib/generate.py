"""The generator's front door: `generate(model, prompt, ...)`, its result, its checks and its streamed text.

The work is done by an engine (course_lib.engine) kept per model, backend and recipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .model.loading import Model


@dataclass
class Generation:
    """The result of generate(): new token ids (a final stop token included), their text (without it), timing."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: str  # "stop_token", "max_new_tokens", or in a batch "error: ..." (NaN logits; the others go on)
    prefill_s: float
    decode_s: float
    backend: str
    step_s: list[float] = field(default_factory=list, repr=False)  # wall time of each decode step
    preemptions: int = 0  # times a batch's scheduler took its pages back to recompute it later (course_lib.batch)

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of generation (prefill included)."""
        return len(self.token_ids) / max(self.prefill_s + self.decode_s, 1e-12)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode rate: tokens after the first one, per second of decode steps."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else float("nan")


def check_request(max_new_tokens, temperature, top_k, top_p, seed) -> None:
    """Clear errors for bad generation settings."""
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if seed is not None and not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")


class TextStream:
    """The text of the tokens pushed so far, handed to `callback` in pieces of whole characters as they complete.

    Only the new tokens are decoded (with the previous piece's tokens as context, as vLLM's incremental
    detokenizer does): the cost per token does not grow with the length of the output."""

    def __init__(self, tokenizer, callback=None):
        self.tokenizer, self.callback = tokenizer, callback
        self.ids: list[int] = []
        self.start = self.read = 0  # ids[start:read]: the context of the next piece; ids[read:]: not yet shown
        self.emitted = ""

    def push(self, token: int) -> None:
        self.ids.append(token)
        if self.callback is None:
            return
        before = self.tokenizer.decode(self.ids[self.start:self.read])
        now = self.tokenizer.decode(self.ids[self.start:])
        if len(now) > len(before) and not now.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            self._emit(now[len(before):])
            self.start, self.read = self.read, len(self.ids)

    def _emit(self, piece: str) -> None:
        self.emitted += piece
        self.callback(piece)

    def close(self) -> None:
        """The text of all the tokens; what is left of it is handed to the callback."""
        self.text = self.tokenizer.decode(self.ids)
        if self.callback is not None and self.text.startswith(self.emitted) and len(self.text) > len(self.emitted):
            self._emit(self.text[len(self.emitted):])


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
             backend="auto", recipe: str | None = None, stream=None, stop: bool = True) -> Generation:
    """Generate up to max_new_tokens after the prompt, on the engine kept for (model, backend, recipe)
    (course_lib.engine: the weights are uploaded at the first call only).

    temperature 0 is greedy; otherwise seeded sampling, restricted by top_k and top_p (kernels.sampling gives the
    rule); the same seed gives the same tokens in every run (None: a fresh seed). backend: "auto", "numpy",
    "cuda" or a backend object; recipe: a name of course_lib.recipes.RECIPES (CUDA; default: the fastest).
    stream: called with each new piece of text as soon as it is complete (whole UTF-8 characters).
    stop=False ignores the model's end tokens (useful to compare long continuations).
    """
    from .engine import engine_for

    check_request(max_new_tokens, temperature, top_k, top_p, seed)
    prompt_ids(model, prompt, chat)  # bad prompts are reported before an engine is built
    return engine_for(model, backend, recipe).generate(
        prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        chat=chat, stream=stream, stop=stop)
