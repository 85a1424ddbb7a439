"""Tokenizer built with the `tokenizers` library, from GGUF metadata or a Hugging Face tokenizer.json,
plus the model's chat template rendered with jinja2."""

from __future__ import annotations

import json

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# Names of the tokens that end a turn or a document in the families we support.
END_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")

# llama.cpp pre-tokenizer names -> the pre-tokenization they stand for.
# "smollm": each digit on its own, then the GPT-2 byte-level split.
_GGUF_PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    ),
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False),
}
_GGUF_CONTROL = 3  # llama.cpp token type of special tokens


class Tokenizer:
    """encode(text) -> list of ids; decode(ids) -> text; apply_chat_template(messages) -> text.

    `stop_ids` are the ids that end generation (the model's end-of-turn/end-of-text tokens). `vocab_size` is one
    more than the largest id, the rows an embedding table needs (the number of tokens, unless the ids have gaps).
    """

    def __init__(self, tok: HFTokenizer, chat_template: str | None, bos_id: int | None, eos_id: int | None,
                 add_bos: bool = False):
        self._tok = tok
        self.chat_template = chat_template
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        ends = {tok.token_to_id(t) for t in END_TOKENS} | {eos_id}
        self.stop_ids = frozenset(i for i in ends if i is not None)

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] + ids) if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; call generate(..., chat=False)")
        # Rendered the way Hugging Face renders chat templates: sandboxed, trim_blocks, lstrip_blocks.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        bos = self.token_text(self.bos_id) if self.bos_id is not None else ""
        eos = self.token_text(self.eos_id) if self.eos_id is not None else ""
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
        )

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer:
        """Build from GGUF metadata: tokenizer.ggml.{model, pre, tokens, token_type, merges, *_token_id}."""
        if fields.get("tokenizer.ggml.model") != "gpt2":
            model = fields.get("tokenizer.ggml.model")
            raise ValueError(f"GGUF tokenizer model {model!r} is not supported (need gpt2 BPE)")
        pre = fields.get("tokenizer.ggml.pre", "gpt2")
        if pre not in _GGUF_PRE_TOKENIZERS:
            known = ", ".join(_GGUF_PRE_TOKENIZERS)
            raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {known})")
        tokens = fields["tokenizer.ggml.tokens"]
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _GGUF_PRE_TOKENIZERS[pre]()
        tok.decoder = decoders.ByteLevel()
        types = fields.get("tokenizer.ggml.token_type") or [0] * len(tokens)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types, strict=True) if ty == _GGUF_CONTROL])
        return cls(tok, fields.get("tokenizer.chat_template"), fields.get("tokenizer.ggml.bos_token_id"),
                   fields.get("tokenizer.ggml.eos_token_id"), bool(fields.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_hf_dir(cls, tokenizer_json: str, tokenizer_config: dict | None = None,
                    generation_eos: int | None = None) -> Tokenizer:
        """Build from tokenizer.json (+ tokenizer_config.json for the chat template and special tokens)."""
        tok = HFTokenizer.from_file(tokenizer_json)
        cfg = tokenizer_config or {}

        def token_id(key):
            t = cfg.get(key)
            if isinstance(t, dict):
                t = t.get("content")
            return tok.token_to_id(t) if t else None

        eos = generation_eos if generation_eos is not None else token_id("eos_token")
        add_bos = bool(cfg.get("add_bos_token", False))
        # tokenizer.json may carry a post-processor that adds BOS itself; we add it explicitly instead.
        tok.post_processor = None
        return cls(tok, cfg.get("chat_template"), token_id("bos_token"), eos, add_bos)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def load_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
