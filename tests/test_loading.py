"""Loading checkpoints: clear errors on bad input (truncated or malformed files, weights that are not finite, a
tokenizer that does not fit the model's vocabulary), Hugging Face directory and GGUF round trips (llama.cpp's RoPE
row permutation undone), the bf16 safetensors codec, and the converted-GGUF cache."""

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest

import course_lib
from course_lib import UnsupportedModelError, load_model
from course_lib.model import loading
from course_lib.model.gguf_io import permute_rope_rows, unpermute_rope_rows
from course_lib.model.loading import load_gguf, load_hf_dir, save_hf_dir
from course_lib.model.safetensors_io import bf16_to_f32, f32_to_bf16, read_safetensors, write_safetensors
from course_lib.model.tiny import CHAT_TEMPLATE, tiny_model
from course_lib.model.weights import to_hf_tensors

FLAVOURS = {"llama": dict(arch="llama"), "qwen2_untied": dict(arch="qwen2", tied=False, seed=1)}


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Conversions of test GGUFs go to a per-test cache, never the user's."""
    monkeypatch.setenv("COURSE_LIB_CACHE", str(tmp_path / "cache"))


def assert_same_weights(a, b):
    ta, tb = to_hf_tensors(a.weights), to_hf_tensors(b.weights)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype == np.float32
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)


# ---------------------------------------------------------------- a tiny GGUF written like llama.cpp's converter

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he"]


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


def write_tiny_gguf(path, model, arch=None, description="", eos_id=None):
    """F32 tensors; Llama's Q and K rows in llama.cpp's permuted order; a byte-level BPE vocabulary with 3 merges.
    262 tokens = 256 bytes + 3 merged tokens + 3 specials, the tiny model's vocab_size. EOS is <|im_end|> unless
    `eos_id` says otherwise."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import pre_tokenizers

    c = model.config
    arch = arch or c.arch
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("tiny-gguf")
    if description:
        w.add_description(description)
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.d_model)
    w.add_feed_forward_length(c.d_ff)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_freq_base(c.rope_theta)
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"] + TINY_SPECIALS
    assert len(tokens) == c.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    w.add_token_merges(TINY_MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>") if eos_id is None else eos_id)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, arr in to_hf_tensors(model.weights).items():
        if arch == "llama" and ".q_proj." in name:
            arr = permute_rope_rows(arr, c.n_heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = permute_rope_rows(arr, c.n_kv_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path):
    return write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model())


# ---------------------------------------------------------------- errors


def test_missing_path():
    with pytest.raises(FileNotFoundError, match="no such path"):
        load_model("/nonexistent/model-dir")


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"expected a \.gguf file"):
        load_model(str(tmp_path / "weights.bin"))


def test_random_bytes_gguf(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(str(path))


@pytest.mark.parametrize("keep", [0.0001, 0.005, 0.02, 0.5, 0.9999])
def test_truncated_gguf(tmp_path, tiny_gguf, keep):
    """Cut in the header, the metadata, the tensor infos and the tensor data."""
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(4, int(len(data) * keep))])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(str(cut), progress=False)


def test_unsupported_gguf_architecture(tmp_path):
    path = write_tiny_gguf(tmp_path / "gpt2.gguf", tiny_model(), arch="gpt2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(str(path), progress=False)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))


@pytest.fixture
def hf_dir(tmp_path):
    path = tmp_path / "hf"
    save_hf_dir(tiny_model(), str(path))
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | changes))


@pytest.mark.parametrize("model_type", ["gpt2", "mistral", ""])
def test_unsupported_model_type(hf_dir, model_type):
    _edit_config(hf_dir, model_type=model_type)
    assert issubclass(UnsupportedModelError, ValueError)
    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}'.*is not supported"):
        load_model(str(hf_dir))


def test_unsupported_rope_scaling(hf_dir):
    _edit_config(hf_dir, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling"):
        load_model(str(hf_dir))


def _rewrite_weights(path, edit):
    file = str(path / "model.safetensors")
    tensors = {k: np.array(v) for k, v in read_safetensors(file).items()}
    edit(tensors)
    write_safetensors(file, tensors)


def test_missing_tensor(hf_dir):
    _rewrite_weights(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor model.layers.1.mlp.up_proj.weight"):
        load_model(str(hf_dir))


def test_wrong_shape(hf_dir):
    def edit(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1]

    _rewrite_weights(hf_dir, edit)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(63,\), expected \(64,\)"):
        load_model(str(hf_dir))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_tensor(hf_dir, bad):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"][3, 5] = bad

    _rewrite_weights(hf_dir, edit)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_proj.weight holds NaN or infinite") as e:
        load_model(str(hf_dir))
    assert str(e.value).startswith(f"{hf_dir}: ")


@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_non_finite_tensor_in_gguf(tmp_path, bad):
    """Caught before the conversion is cached: the error names the GGUF file and no cache entry is left."""
    model = tiny_model()
    model.weights.layers[1].w_down[7, 2] = bad
    path = write_tiny_gguf(tmp_path / "nan.gguf", model)
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight holds NaN or infinite") as e:
        load_model(str(path), progress=False)
    assert str(e.value).startswith(f"{path}: ")
    assert not os.path.exists(tmp_path / "cache" / "converted")


def test_missing_weights_file(hf_dir):
    os.remove(hf_dir / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="missing weights file model.safetensors"):
        load_model(str(hf_dir))


# The tiny model's byte tokenizer has 259 ids (256 bytes, then <|endoftext|> 256, <|im_start|> 257, <|im_end|> 258);
# its embedding table has 262 rows, padded as real checkpoints often are.


def _tiny_hf_dir(tmp_path, **overrides):
    path = tmp_path / "hf"
    save_hf_dir(tiny_model(**overrides), str(path))
    return path


@pytest.mark.parametrize("vocab_size", [259, 262, 320])
def test_embedding_table_padded_beyond_the_tokenizer(tmp_path, vocab_size):
    model = load_model(str(_tiny_hf_dir(tmp_path, vocab_size=vocab_size)))
    assert model.tokenizer.vocab_size == 259 and model.config.vocab_size == vocab_size
    assert model.weights.embed.shape == (vocab_size, 64)


@pytest.mark.parametrize("vocab_size", [258, 100])
def test_tokenizer_larger_than_the_embedding_table(tmp_path, vocab_size):
    path = _tiny_hf_dir(tmp_path, vocab_size=vocab_size)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: the tokenizer has 259 ids .* the model's "
                                         f"vocab_size is {vocab_size} "):
        load_model(str(path))


def test_tokenizer_id_past_the_embedding_table(hf_dir):
    """Ids with a gap: 259 tokens, but one of them has id 300, past the 262 rows. Counting tokens would miss it."""
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok["model"]["vocab"]["b"] = 300
    (hf_dir / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"the tokenizer has 301 ids \(0 to 300\) but the model's vocab_size is 262"):
        load_model(str(hf_dir))


@pytest.mark.parametrize("eos, kind", [(262, "EOS"), (-1, "EOS"), ([258, 262], "end-of-generation")])
def test_end_token_id_out_of_range(hf_dir, eos, kind):
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    bad = eos if isinstance(eos, int) else eos[1]
    with pytest.raises(ValueError, match=f"^{re.escape(str(hf_dir))}: the {kind} token id {bad} is out of range for "
                                         "the model's vocab_size 262 \\(the tokenizer has 259 ids\\)"):
        load_model(str(hf_dir))


def test_end_token_id_out_of_range_in_gguf(tmp_path):
    path = write_tiny_gguf(tmp_path / "eos.gguf", tiny_model(), eos_id=262)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: the EOS token id 262 is out of range for the "
                                         "model's vocab_size 262"):
        load_model(str(path), progress=False)
    assert not os.path.exists(tmp_path / "cache" / "converted")


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda data: data[:8] + b"\xff" * 16 + data[24:], "corrupt safetensors header"),
        (lambda data: np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not a safetensors"),
    ],
    ids=["garbled_header", "random_bytes"],
)
def test_corrupt_safetensors(hf_dir, corrupt, match):
    file = hf_dir / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.raises(ValueError, match=match):
        load_model(str(hf_dir))


# Where a file is cut, as a function of its header length n and size: inside the 8-byte header length, inside the
# JSON header, and inside the data.
TRUNCATIONS = {
    "empty": (lambda n, size: 0, "too short"),
    "in_header_length": (lambda n, size: 5, "too short"),
    "after_header_length": (lambda n, size: 8, "header length .* exceeds file size"),
    "in_json": (lambda n, size: 8 + n // 2, "header length .* exceeds file size"),
    "json_less_one_byte": (lambda n, size: 8 + n - 1, "header length .* exceeds file size"),
    "no_data": (lambda n, size: 8 + n, "runs past the end of the file"),
    "one_data_byte": (lambda n, size: 8 + n + 1, "runs past the end of the file"),
    "mid_data": (lambda n, size: (8 + n + size) // 2, "runs past the end of the file"),
    "last_byte_missing": (lambda n, size: size - 1, "runs past the end of the file"),
}


@pytest.mark.parametrize("where", TRUNCATIONS)
def test_truncated_safetensors(hf_dir, where):
    """A cut file gives a ValueError naming it and saying it looks truncated (not a NumPy reshape error, nor a
    short tensor)."""
    file = hf_dir / "model.safetensors"
    data = file.read_bytes()
    cut, match = TRUNCATIONS[where]
    file.write_bytes(data[: cut(int.from_bytes(data[:8], "little"), len(data))])
    with pytest.raises(ValueError, match=f"^{re.escape(str(file))}: .*{match}.*truncated") as e:
        load_model(str(hf_dir))
    assert e.type is ValueError


def test_every_prefix_of_a_safetensors_file_is_refused(tmp_path):
    """Every cut point of a small file, from 0 bytes to all but the last: ValueError naming the file."""
    path = tmp_path / "small.safetensors"
    tensors = {"a": np.ones((2, 3), np.float32), "b": np.float32([1.0]), "c": np.zeros(5, np.float32)}
    write_safetensors(str(path), tensors)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    for size in range(len(data)):
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"^{re.escape(str(cut))}: "):
            read_safetensors(str(cut))
    cut.write_bytes(data)
    assert read_safetensors(str(cut)).keys() == {"a", "b", "c"}


def _f32(shape, offsets, dtype="F32"):
    return {"a": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}


@pytest.mark.parametrize("header", [[1, 2], {"a": {"dtype": "F32", "shape": [2]}}, {"a": [0, 8]},
                                    _f32([4], [0, 8]), _f32([2], [-8, 0]), _f32([2], [8, 0]), _f32([2], [0.0, 8.0]),
                                    _f32([-1, -2], [0, 8]), _f32([2.0], [0, 8]), _f32([2], [0, 8], ["F32"]),
                                    _f32([2], [0, 8], "I8"), _f32([2**32, 2**32], [0, 0])],
                         ids=["not_a_dict", "no_data_offsets", "entry_not_a_dict", "shape_disagrees_with_offsets",
                              "negative_offset", "backwards_offsets", "float_offsets", "negative_dims",
                              "float_dim", "dtype_not_a_string", "unsupported_dtype", "shape_overflows_int64"])
def test_malformed_safetensors_header(tmp_path, header):
    head = json.dumps(header).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(head).to_bytes(8, "little") + head + bytes(8))
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: ") as e:
        read_safetensors(str(path))
    assert e.type is ValueError


# ---------------------------------------------------------------- Hugging Face directory round trip


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_hf_dir_round_trip(tmp_path, flavour):
    model = tiny_model(**FLAVOURS[flavour])
    save_hf_dir(model, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "tokenizer.json",
                                            "tokenizer_config.json"]
    loaded = load_hf_dir(str(tmp_path))
    assert loaded.config == model.config
    assert_same_weights(loaded, model)
    assert (loaded.weights.lm_head is None) == model.config.tied_embeddings
    tok, ref = loaded.tokenizer, model.tokenizer
    text = "<|im_start|>user\nHéllo 42 🙂<|im_end|>"
    assert tok.encode(text) == ref.encode(text) and tok.decode(tok.encode(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.chat_template, tok.add_bos) == (ref.bos_id, ref.eos_id, ref.chat_template,
                                                                        ref.add_bos)
    assert tok.stop_ids == ref.stop_ids


def test_bf16_checkpoint(hf_dir):
    """Checkpoints are mostly published in bf16: loaded, their tensors are the bf16 values widened to float32."""
    source = to_hf_tensors(tiny_model().weights)
    write_safetensors(str(hf_dir / "model.safetensors"), source, bf16=True)
    loaded = to_hf_tensors(load_model(str(hf_dir)).weights)
    assert loaded.keys() == source.keys()
    for name, arr in source.items():
        assert loaded[name].dtype == np.float32
        np.testing.assert_array_equal(loaded[name], bf16_to_f32(f32_to_bf16(arr)), err_msg=name)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_transformers_loads_our_directory(tmp_path, flavour):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = tiny_model(**FLAVOURS[flavour])
    save_hf_dir(model, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    ours = to_hf_tensors(model.weights)
    if model.config.tied_embeddings:
        ours["lm_head.weight"] = ours["model.embed_tokens.weight"]
    assert state.keys() == ours.keys()
    for name, arr in ours.items():
        np.testing.assert_array_equal(state[name], arr, err_msg=name)


# ---------------------------------------------------------------- GGUF


def test_rope_permutation():
    rng = np.random.default_rng(0)
    # llama.cpp's converter: within each head, HF row j of the first half -> row 2j, of the second half -> 2j+1.
    assert permute_rope_rows(np.arange(8), 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert permute_rope_rows(np.arange(8), 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    for shape, heads in [((8,), 2), ((64, 16), 4), ((32, 64), 2), ((576, 3), 9), ((12, 5), 1)]:
        w = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, heads), heads), w)
        np.testing.assert_array_equal(permute_rope_rows(unpermute_rope_rows(w, heads), heads), w)
        assert not np.array_equal(permute_rope_rows(w, heads), w)


@pytest.mark.parametrize("flavour", ["llama", "llama_untied", "qwen2_untied"])
def test_gguf_loads_the_source_weights(tmp_path, flavour):
    kwargs = {"llama": {}, "llama_untied": dict(tied=False, seed=2), "qwen2_untied": FLAVOURS["qwen2_untied"]}
    source = tiny_model(**kwargs[flavour])
    path = write_tiny_gguf(tmp_path / f"{flavour}.gguf", source)
    loaded = load_model(str(path), progress=False)
    assert loaded.source == str(path)
    assert_same_weights(loaded, source)  # the un-permuted Q and K equal the originals
    c = loaded.config
    # GGUF stores rms_eps as float32.
    assert dataclasses.replace(c, name=source.config.name, rms_eps=source.config.rms_eps) == source.config
    assert c.name == "tiny-gguf" and c.rms_eps == pytest.approx(source.config.rms_eps, rel=1e-7)
    tok = loaded.tokenizer
    assert tok.encode(" the then") == [258, 258, tok.encode("n")[0]]
    assert tok.encode("<|im_start|>x<|im_end|>") == [260, tok.encode("x")[0], 261]
    assert (tok.bos_id, tok.eos_id, tok.chat_template) == (260, 261, CHAT_TEMPLATE)
    assert {259, 261} <= tok.stop_ids
    assert tok.decode(tok.encode("the 1234 théâtre")) == "the 1234 théâtre"


def test_gguf_q_k_are_really_permuted_in_the_file(tiny_gguf):
    """Guards the test above: the file holds permuted rows, so loading without un-permuting would differ."""
    gguf = pytest.importorskip("gguf")
    source = to_hf_tensors(tiny_model().weights)
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    for hf_name, gguf_name in [("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
                               ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight")]:
        assert tensors[gguf_name].shape == source[hf_name].shape
        assert not np.array_equal(tensors[gguf_name], source[hf_name])
    np.testing.assert_array_equal(tensors["blk.0.attn_v.weight"], source["model.layers.0.self_attn.v_proj.weight"])


def test_converted_cache_is_reused(tmp_path, tiny_gguf, monkeypatch):
    first = load_gguf(str(tiny_gguf), progress=False)
    converted = os.listdir(tmp_path / "cache" / "converted")
    assert len(converted) == 1
    assert os.path.isfile(tmp_path / "cache" / "converted" / converted[0] / "model.safetensors")

    def no_reading(*args, **kwargs):
        raise AssertionError("read_gguf called although the converted cache exists")

    monkeypatch.setattr(course_lib.model.gguf_io, "read_gguf", no_reading)
    second = load_gguf(str(tiny_gguf), progress=False)
    assert second.config == first.config
    assert_same_weights(second, first)
    assert second.tokenizer.encode(" the<|im_end|>") == first.tokenizer.encode(" the<|im_end|>")
    # A copy of the file (same name and content) elsewhere hits the same cache entry.
    os.makedirs(tmp_path / "elsewhere")
    copy = shutil.copy(tiny_gguf, tmp_path / "elsewhere" / tiny_gguf.name)
    assert_same_weights(load_gguf(str(copy), progress=False), first)


def test_incomplete_conversion_is_redone(tmp_path, tiny_gguf):
    """A conversion interrupted before model.safetensors was written does not count as cached."""
    load_gguf(str(tiny_gguf), progress=False)
    (entry,) = (tmp_path / "cache" / "converted").iterdir()
    os.remove(entry / "model.safetensors")
    (entry / "config.json").write_text("{garbage")
    assert_same_weights(load_gguf(str(tiny_gguf), progress=False), tiny_model())


def test_cache_tells_apart_files_that_differ_after_the_first_mib(tmp_path):
    paths = []
    for sub, seed in (("a", 0), ("b", 1)):
        os.makedirs(tmp_path / sub)
        paths.append(write_tiny_gguf(tmp_path / sub / "model.gguf", tiny_model(seed=seed), description="x" * (1 << 20)))
    assert os.path.getsize(paths[0]) == os.path.getsize(paths[1])
    load_model(str(paths[0]), progress=False)
    assert_same_weights(load_model(str(paths[1]), progress=False), tiny_model(seed=1))


# ---------------------------------------------------------------- safetensors_io


def _bits(values):
    return f32_to_bf16(np.array(values, dtype=np.float32)).tolist()


def test_bf16_rounds_to_nearest_ties_to_even():
    ulp = 2.0**-7  # bf16 keeps 7 mantissa bits: its spacing just above 1.0
    assert _bits([1.0, -1.0, 0.0, -0.0, 2.0]) == [0x3F80, 0xBF80, 0x0000, 0x8000, 0x4000]
    assert _bits([1 + ulp / 2]) == [0x3F80]  # tie: to the even mantissa (1.0), down
    assert _bits([1 + 3 * ulp / 2]) == [0x3F82]  # tie: to the even mantissa (1 + 2 ulp), up
    assert _bits([-(1 + ulp / 2), -(1 + 3 * ulp / 2)]) == [0xBF80, 0xBF82]
    assert _bits([1 + ulp / 2 + 2.0**-20]) == [0x3F81]  # just above the tie: up
    assert _bits([1 + ulp / 2 - 2.0**-20]) == [0x3F80]  # just below: down
    assert _bits([np.inf, -np.inf]) == [0x7F80, 0xFF80]
    assert _bits([np.finfo(np.float32).max]) == [0x7F80]  # rounds up to infinity, like torch
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * 10.0 ** np.arange(-20, 20, 4).repeat(1000)
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(f32_to_bf16(x), expected)


def test_bf16_round_trip_error_and_nan():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(-30, 30, 100_000))).astype(np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    assert back.dtype == np.float32
    # bf16 has 8 significant bits: rounding to nearest errs by at most half a spacing, 2**-8 * 2**floor(log2|x|),
    # so by at most 2**-8 relative (reached just above powers of two: 2.0078 -> 2.0).
    err = np.abs(back.astype(np.float64) - x)
    assert np.all(err <= 2.0**-8 * 2.0 ** np.floor(np.log2(np.abs(x))))
    assert np.max(err / np.abs(x)) <= 2.0**-8
    # NaNs of every payload and sign stay NaN (a naive rounding carries some into infinity or zero).
    nan_bits = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001], dtype=np.uint32)
    assert np.all(np.isnan(bf16_to_f32(f32_to_bf16(nan_bits.view(np.float32)))))
    assert np.all(np.isinf(bf16_to_f32(f32_to_bf16(np.array([np.inf, -np.inf], np.float32)))))


@pytest.mark.parametrize("bf16", [False, True])
def test_safetensors_write_read_round_trip(tmp_path, bf16):
    rng = np.random.default_rng(2)
    tensors = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32), "b": np.float32([1.5, -2.0, 3.25]),
               "one": np.float32([7.0]), "empty": np.zeros((0, 4), np.float32),
               "big": rng.standard_normal((17, 9, 2)).astype(np.float32)}
    path = str(tmp_path / "t.safetensors")
    write_safetensors(path, tensors, bf16=bf16)
    assert not os.path.exists(path + ".part")
    back = read_safetensors(path)
    assert list(back) == list(tensors)
    for name, arr in tensors.items():
        expected = bf16_to_f32(f32_to_bf16(arr)) if bf16 else arr
        assert back[name].dtype == np.float32 and back[name].shape == arr.shape
        np.testing.assert_array_equal(back[name], expected, err_msg=name)
    header_len = int.from_bytes(open(path, "rb").read(8), "little")
    assert header_len % 8 == 0
    safetensors = pytest.importorskip("safetensors.numpy")
    if not bf16:  # the reference reader (no bf16 in NumPy) agrees with ours
        for name, arr in safetensors.load_file(path).items():
            np.testing.assert_array_equal(arr, tensors[name])


# ---------------------------------------------------------------- the real model


def test_smollm_loads(smollm):
    c = smollm.config
    assert (c.arch, c.vocab_size, c.d_model, c.n_layers, c.n_heads, c.n_kv_heads, c.d_ff) == (
        "llama", 49152, 576, 30, 9, 3, 1536)
    assert c.tied_embeddings and smollm.weights.lm_head is None and c.rope_theta == 100000.0
    assert smollm.weights.embed.shape == (49152, 576) and smollm.weights.embed.dtype == np.float32
    assert smollm.source.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_concurrent_conversions_never_share_a_file(tmp_path, tiny_gguf):
    """Processes converting the same GGUF at once (test workers, notebooks) each write a private directory and
    rename it into place: four at once all load the model, and no partial file is left behind."""
    import subprocess
    import sys

    code = ("from course_lib.model.loading import load_gguf; import sys; "
            "m = load_gguf(sys.argv[1], progress=False); print(m.config.n_layers)")
    env = os.environ | {"COURSE_LIB_CACHE": str(tmp_path / "shared")}
    runs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_gguf)], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(4)]
    outs = [r.communicate()[0].strip() for r in runs]
    assert [r.returncode for r in runs] == [0] * 4 and len(set(outs)) == 1, outs
    converted = os.listdir(tmp_path / "shared" / "converted")
    assert len(converted) == 1 and ".part" not in converted[0], converted


def test_an_incomplete_cache_is_replaced(tmp_path, tiny_gguf):
    """A cache directory without model.safetensors (a crash mid-write) is converted again."""
    out = loading._gguf_cache_path(str(tiny_gguf))
    os.makedirs(out)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write("{truncated")
    assert load_gguf(str(tiny_gguf), progress=False).config.n_layers == tiny_model().config.n_layers
