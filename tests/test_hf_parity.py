"""The NumPy reference against Hugging Face transformers (PyTorch, CPU, float32): the ground truth's ground truth.

Tolerance on logits. Both sides compute the same float32 operations, in different summation orders. A dot
product of length K rounded in float32 carries a relative error of order sqrt(K) * u (u = 2**-24, errors of
random sign), and a forward pass chains 2 * n_layers + 1 such stages in sequence (attention and MLP of each
layer, then the logits), each adding its own independent error: a relative error of order
sqrt(2L + 1) * sqrt(K_max) * u on the logit scale max|logit|. We allow 8 times that.
For SmolLM2 (L = 30, K_max = d_ff = 1536, max|logit| ~ 30) that is ~1e-2; the differences seen are ~1e-4.
"""


import numpy as np
import pytest
import torch
from checks import logit_tolerance
from transformers import AutoModelForCausalLM

from course_lib import generate, reference
from course_lib.model.loading import fetch_default_gguf, save_hf_dir
from course_lib.model.weights import to_hf_tensors

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
CHAT = "What is the capital of France? Answer in one sentence."


def our_logits(model, ids):
    cache = reference.KVCache(model.config, len(ids))
    rope = reference.rope_tables(model.config, len(ids))
    return reference.forward(model.weights, model.config, np.asarray(ids), cache, rope, all_logits=True)


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(hf, ids, n):
    """n greedy tokens with transformers' own KV cache, ignoring end tokens."""
    out = []
    with torch.no_grad():
        step = hf(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            token = int(torch.argmax(step.logits[0, -1]))
            out.append(token)
            step = hf(torch.tensor([[token]]), cache=step.cache, use_cache=True)
    return out


def assert_logits_close(ours, theirs, config):
    assert np.all(np.isfinite(ours))
    tol = logit_tolerance(config, float(np.abs(theirs).max()))
    diff = float(np.abs(ours - theirs).max())
    assert diff <= tol, f"max |logit difference| {diff:.3g} > tolerance {tol:.3g}"
    return diff, tol


@pytest.fixture(scope="module")
def hf_smollm():
    """transformers' own reading of the same GGUF: an independent dequantization and Q/K un-permutation."""
    path = fetch_default_gguf(progress=False)
    directory, name = path.rsplit("/", 1)
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()


def test_weights_match_transformers_gguf_reader(smollm, hf_smollm):
    theirs = hf_smollm.state_dict()
    for name, ours in to_hf_tensors(smollm.weights).items():
        np.testing.assert_array_equal(ours, theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("prompt", PROMPTS + ["chat"])
def test_smollm_logits_match(smollm, hf_smollm, prompt):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT}]) if prompt == "chat" else prompt
    ids = smollm.tokenizer.encode(text)
    diff, tol = assert_logits_close(our_logits(smollm, ids), hf_logits(hf_smollm, ids), smollm.config)
    print(f"{len(ids)} positions: max |diff| {diff:.3g} (tolerance {tol:.3g})")


@pytest.mark.parametrize("prompt", PROMPTS + ["chat"])
def test_smollm_32_greedy_tokens_match(smollm, hf_smollm, prompt):
    chat = prompt == "chat"
    ours = generate(smollm, CHAT if chat else prompt, chat=chat, max_new_tokens=32, stop=False, backend="numpy")
    assert ours.token_ids == hf_greedy(hf_smollm, ours.prompt_ids, 32)


@pytest.mark.parametrize("flavour", ["llama-tied", "qwen2-untied-bias"])
def test_tiny_checkpoints_match_transformers(tmp_path, tiny, tiny_qwen, flavour):
    """Our HF writer + transformers' loader + forward == our reference, for both architectures we support."""
    model = tiny if flavour == "llama-tied" else tiny_qwen
    save_hf_dir(model, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, 40).tolist()
    assert_logits_close(our_logits(model, ids), hf_logits(hf, ids), model.config)
    ours = generate(model, ids, max_new_tokens=24, stop=False, backend="numpy")
    assert ours.token_ids == hf_greedy(hf, ids, 24)
