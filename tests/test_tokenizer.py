"""The tokenizer built from GGUF metadata must encode exactly like SmolLM2's own tokenizer.

SmolLM2's GGUF names its pre-tokenizer `smollm`: every digit is split off on its own, then the GPT-2 byte-level
regex split applies; no BOS is added. transformers' GGUF loader does not know `smollm` (it splits "\\n\\n42" as
"\\n", "\\n", "4", "2" where the model's tokenizer has "\\n\\n", "4", "2"), so it is the reference only for text
without digits. The strongest check is an independent pure-Python byte-level BPE (below) fed with the GGUF's own
token list and merges.
"""

import random
import unicodedata
from itertools import pairwise

import pytest
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from course_lib.model.loading import fetch_default_gguf
from course_lib.model.tiny import byte_tokenizer
from course_lib.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, Ångström, Straße",
    "e\u0301 a\u0308 n\u0303 (combining marks)",
    "日本語のテキストと中文字符",
    "emoji 🙂🚀👩‍💻 and flags 🇫🇷",
    "3.14159",
    "2026-11-29",
    "x = 1234567",
    "\n\n42",
    "E = mc² and ½ cup, Arabic-Indic ٣٤",
    "def f(x):\n    if x:\n        return {'a': [1, 2]}\n    return None\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "spaces    and\ttabs\t\tmixed  \t end  ",
    "trailing newline\n",
    "line one\nline two\r\nline three",
    "I'm sure they'll say it's what we've done, isn't it? YOU'RE",
    " ",
    "   ",
    "\t",
    "\n",
    "",
]
WITH_DIGITS = [t for t in TEXTS if any(unicodedata.category(ch)[0] == "N" for ch in t)]
WITHOUT_DIGITS = [t for t in TEXTS if t not in WITH_DIGITS]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}],
]


def _is_number_char(ch: str) -> bool:
    return unicodedata.category(ch)[0] == "N"  # Nd, Nl, No: what \p{N} and Rust's char::is_numeric match


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gguf_meta():
    """Tokenizer metadata read straight from the GGUF with the gguf package (not through course_lib)."""
    import gguf

    reader = gguf.GGUFReader(fetch_default_gguf(progress=False))
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


@pytest.fixture(scope="module", params=["loaded", "from_gguf_fields"])
def tok(request, smollm, gguf_meta):
    """Both ways course_lib builds the tokenizer: load_model() (through the converted tokenizer.json) and
    Tokenizer.from_gguf_fields on the GGUF metadata."""
    if request.param == "loaded":
        return smollm.tokenizer
    return Tokenizer.from_gguf_fields(gguf_meta)


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    import os

    path = fetch_default_gguf(progress=False)
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture(scope="module")
def ref_bpe(gguf_meta):
    return RefBPE(gguf_meta["tokenizer.ggml.tokens"], gguf_meta["tokenizer.ggml.merges"],
                  gguf_meta["tokenizer.ggml.token_type"])


# ---------------------------------------------------------------- independent reference


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


class RefBPE:
    """The `smollm` rule by hand: split off special tokens, then every number character on its own, then the
    GPT-2 regex; map bytes to GPT-2 characters; merge the lowest-ranked adjacent pair until none is in the list."""

    GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, tokens, merges, token_types):
        self.re = pytest.importorskip("regex", reason="the independent BPE needs the `regex` package (\\p{L})")
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.specials = {t for t, ty in zip(tokens, token_types, strict=True) if ty == 3}
        alternatives = "|".join(self.re.escape(t) for t in sorted(self.specials, key=len, reverse=True))
        self.special_split = self.re.compile(f"({alternatives})")
        self.digit_split = self.re.compile(r"\p{N}|[^\p{N}]+")
        self.word_split = self.re.compile(self.GPT2)
        self.byte_char = bytes_to_unicode()

    def bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            rank, i = min((self.ranks.get(pair, float("inf")), i) for i, pair in enumerate(pairwise(parts)))
            if rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def pieces(self, text: str) -> list[str]:
        out = []
        for chunk in self.special_split.split(text):
            if chunk in self.specials:
                out.append(chunk)
                continue
            for run in self.digit_split.findall(chunk):
                out.extend(self.word_split.findall(run))
        return out

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pieces(text):
            if piece in self.specials:
                ids.append(self.vocab[piece])
            else:
                ids.extend(self.vocab[p] for p in self.bpe("".join(self.byte_char[b] for b in piece.encode())))
        return ids


def test_reference_bpe_sanity(ref_bpe):
    assert len(set(bytes_to_unicode().values())) == 256 and bytes_to_unicode()[ord(" ")] == "Ġ"
    assert ref_bpe.pieces("x = 12ab\n\n42") == ["x", " =", " ", "1", "2", "ab", "\n\n", "4", "2"]
    assert ref_bpe.encode("<|im_start|>") == [1]


# ---------------------------------------------------------------- course_lib's tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", WITH_DIGITS)
def test_every_digit_is_its_own_token(tok, text):
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    for i, piece in zip(ids, pieces, strict=True):
        if any(_is_number_char(ch) for ch in piece):
            assert len(piece) == 1, f"token {i} {tok.token_text(i)!r} holds a digit and more in {text!r}: {pieces}"
    # Token boundaries in bytes: every number character starts and ends on one (a multi-byte one like "²" may
    # span several byte tokens, but never shares a token with a neighbour).
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    token_bytes = [bytes(byte_of[c] for c in tok.token_text(i)) for i in ids]
    assert b"".join(token_bytes) == text.encode()
    bounds, pos = {0}, 0
    for tb in token_bytes:
        pos += len(tb)
        bounds.add(pos)
    pos = 0
    for ch in text:
        n = len(ch.encode())
        if _is_number_char(ch):
            assert pos in bounds and pos + n in bounds, f"{ch!r} at byte {pos} shares a token in {text!r}: {pieces}"
        pos += n
    ascii_digits = sum(ch in "0123456789" for ch in text)
    assert sum(p in "0123456789" and len(p) == 1 for p in pieces) == ascii_digits


@pytest.mark.parametrize("text", TEXTS)
def test_matches_independent_bpe(tok, ref_bpe, text):
    assert tok.encode(text) == ref_bpe.encode(text)


def test_matches_independent_bpe_on_random_text(tok, ref_bpe):
    rng = random.Random(0)
    alphabet = "abcXYZ 0123456789\n\t.,'-_()éß日本🙂\u0301<|>"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert tok.encode(text) == ref_bpe.encode(text), repr(text)


@pytest.mark.parametrize("text", WITHOUT_DIGITS)
def test_matches_transformers_without_digits(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert tok.token_text(1) == "<|im_start|>" and tok.token_text(2) == "<|im_end|>"
    assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"
    assert tok.encode("<|endoftext|>") == [0]


def test_no_bos_and_stop_ids(tok):
    assert not tok.add_bos
    assert tok.bos_id == 1 and tok.eos_id == 2
    for text in ("Hello", "Hi there", " ", "1"):
        assert tok.encode(text)[0] != tok.bos_id
    assert {0, 2} <= tok.stop_ids
    assert tok.vocab_size == 49152


def test_the_models_eos_stops_even_if_no_known_end_token():
    """stop_ids: the known end tokens the vocabulary holds, and the model's own eos token whatever its text."""
    vocab = {"a": 0, "<eos>": 1, "<|endoftext|>": 2, "b": 3}
    tok = Tokenizer(HFTokenizer(models.BPE(vocab=vocab, merges=[])), None, bos_id=None, eos_id=1)
    assert tok.stop_ids == {1, 2}


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi_turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_default_system_prompt_and_generation_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    own = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert own.startswith("<|im_start|>system\nS<|im_end|>\n") and own.count("<|im_start|>system") == 1


# ---------------------------------------------------------------- the tiny model's byte tokenizer


def test_tiny_byte_tokenizer_round_trips_any_text():
    tok = byte_tokenizer()
    rng = random.Random(1)
    for _ in range(200):
        chars = [chr(rng.randrange(0x110000)) for _ in range(rng.randint(0, 20))]
        text = "".join(ch for ch in chars if not 0xD800 <= ord(ch) <= 0xDFFF)  # no lone surrogates
        ids = tok.encode(text)
        assert len(ids) == len(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_tiny_byte_tokenizer_one_id_per_ascii_byte():
    tok = byte_tokenizer()
    ids = [tok.encode(chr(b)) for b in range(128)]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == 128
    text = "Hello, world!\n\tdef f(x): return 42"
    assert tok.encode(text) == [tok.encode(ch)[0] for ch in text]
    assert tok.encode("<|im_end|>") == [tok.eos_id] and tok.eos_id in tok.stop_ids


def test_vocab_size_is_one_past_the_largest_id():
    """vocab_size is the rows an embedding table needs: one more than the largest id, even where the ids have a gap
    (load_model checks it against the model's vocab_size)."""
    assert byte_tokenizer().vocab_size == 259
    hf = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1, "c": 40}, merges=[]))
    hf.add_special_tokens([AddedToken("<|im_end|>", special=True)])  # takes id 3
    tok = Tokenizer(hf, None, bos_id=None, eos_id=None)
    assert hf.get_vocab_size(with_added_tokens=True) == 4 and tok.vocab_size == 41
    assert tok.stop_ids == {3}
