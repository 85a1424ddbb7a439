"""The NumPy reference against Hugging Face transformers (PyTorch, CPU, float32): the ground truth's ground truth.

Two ways, so that the check runs everywhere:
  golden  our reference against data/hf_golden_smollm2.npz, outputs of transformers recorded by tests/hf_golden.py
          (logits at a few positions and vocabulary ids, 32 greedy tokens); needs neither torch nor transformers.
  live    our reference against transformers run now, and the golden file against that run (it cannot go stale);
          only where torch and transformers are installed (pip install -e ".[parity]"), skipped elsewhere.

Tolerance on logits. Both sides compute the same float32 operations, in different summation orders. A dot
product of length K rounded in float32 carries a relative error of order sqrt(K) * u (u = 2**-24, errors of
random sign), and a forward pass chains 2 * n_layers + 1 such stages in sequence (attention and MLP of each
layer, then the logits), each adding its own independent error: a relative error of order
sqrt(2L + 1) * sqrt(K_max) * u on the logit scale max|logit|. We allow 8 times that.
For SmolLM2 (L = 30, K_max = d_ff = 1536, max|logit| ~ 30) that is ~4e-3; the differences seen are ~1e-4.
"""

import hf_golden
import numpy as np
import pytest
from checks import logit_tolerance
from hf_golden import KEYS, N_GREEDY, hf_greedy, hf_logits, load_hf, prompt_ids, prompt_text, record

from course_lib import generate, reference
from course_lib.model.loading import save_hf_dir
from course_lib.model.weights import to_hf_tensors

LIVE = "live comparison with transformers: needs torch and transformers>=5.24 (pip install -e '.[parity]')"


def our_logits(model, ids):
    cache = reference.KVCache(model.config, len(ids))
    rope = reference.rope_tables(model.config, len(ids))
    return reference.forward(model.weights, model.config, np.asarray(ids), cache, rope, all_logits=True)


def assert_logits_close(ours, theirs, config, scale=None, what=""):
    """|ours - theirs| <= logit_tolerance on the scale max|logit| (default: of `theirs`)."""
    assert np.all(np.isfinite(ours))
    tol = logit_tolerance(config, float(np.abs(theirs).max()) if scale is None else float(scale))
    diff = float(np.abs(np.asarray(ours, np.float64) - theirs).max())
    assert diff <= tol, f"{what}max |logit difference| {diff:.3g} > tolerance {tol:.3g}"
    return diff, tol


def assert_rows_close(rows, key, golden, config):
    """Full logit rows at golden[key.positions] against the golden values at golden[key.vocab], and the row scale."""
    vocab, positions = golden[f"{key}.vocab"], golden[f"{key}.positions"]
    for pos, row, want, scale in zip(positions, rows, golden[f"{key}.logits"], golden[f"{key}.max_abs_logit"],
                                     strict=True):
        what = f"{key}, position {pos}: "
        diff, tol = assert_logits_close(row[vocab], want, config, scale, what)
        scale_diff = abs(float(np.abs(row).max()) - float(scale))
        assert scale_diff <= tol, f"{what}max|logit| differs by {scale_diff:.3g} > tolerance {tol:.3g}"
        print(f"{what}max |diff| {diff:.3g} on {len(vocab)} ids (tolerance {tol:.3g})")


@pytest.fixture(scope="module")
def golden():
    return hf_golden.load(hf_golden.GOLDEN_FILE)


@pytest.fixture(scope="module")
def hf_available():
    pytest.importorskip("torch", reason=LIVE)
    pytest.importorskip("transformers", minversion="5.24", reason=LIVE)


@pytest.fixture(scope="module")
def hf_smollm(hf_available):
    """transformers' own reading of the same GGUF: an independent dequantization and Q/K un-permutation."""
    return load_hf()


@pytest.fixture(scope="module")
def live(smollm, hf_smollm, golden):
    """The golden arrays recorded now from transformers, at the golden file's vocabulary ids."""
    return record(hf_smollm, smollm.tokenizer, vocab={key: golden[f"{key}.vocab"] for key in KEYS})


# --- golden: everywhere ---


@pytest.mark.parametrize("key", KEYS)
def test_smollm_logits_match_golden(smollm, golden, key):
    ids = prompt_ids(smollm.tokenizer, key)
    assert ids == golden[f"{key}.ids"].tolist(), "our tokenizer no longer gives the recorded prompt ids"
    assert_rows_close(our_logits(smollm, ids)[golden[f"{key}.positions"]], key, golden, smollm.config)


@pytest.mark.parametrize("key", KEYS)
def test_smollm_32_greedy_tokens_match_golden(smollm, golden, key):
    text, chat = prompt_text(key)
    ours = generate(smollm, text, chat=chat, max_new_tokens=N_GREEDY, stop=False, backend="numpy")
    assert ours.prompt_ids == golden[f"{key}.ids"].tolist()
    assert ours.token_ids == golden[f"{key}.greedy"].tolist()


# --- live: where torch and transformers are installed ---


def test_golden_file_matches_live_transformers(smollm, golden, live):
    """The recorded file is what transformers gives now: same prompts, ids, settings and greedy tokens, logits
    within tolerance (re-record with `python tests/hf_golden.py` after changing a prompt or a setting)."""
    assert sorted(live) == sorted(golden)
    for name in live:
        if name != "versions" and not name.endswith((".logits", ".max_abs_logit")):
            np.testing.assert_array_equal(live[name], golden[name], err_msg=name)
    for key in KEYS:
        rows = zip(golden[f"{key}.positions"], live[f"{key}.logits"], live[f"{key}.max_abs_logit"],
                   golden[f"{key}.logits"], golden[f"{key}.max_abs_logit"], strict=True)
        for pos, got, got_scale, want, scale in rows:
            assert_logits_close(np.append(got, got_scale), np.append(want, scale), smollm.config, scale,
                                f"{key}, position {pos} (logits and max|logit|): ")
    print("golden recorded with", ", ".join(golden["versions"]), "; live:", ", ".join(live["versions"]))


def test_weights_match_transformers_gguf_reader(smollm, hf_smollm):
    theirs = hf_smollm.state_dict()
    for name, ours in to_hf_tensors(smollm.weights).items():
        np.testing.assert_array_equal(ours, theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("key", KEYS)
def test_smollm_logits_match(smollm, hf_smollm, key):
    ids = prompt_ids(smollm.tokenizer, key)
    diff, tol = assert_logits_close(our_logits(smollm, ids), hf_logits(hf_smollm, ids), smollm.config)
    print(f"{len(ids)} positions: max |diff| {diff:.3g} (tolerance {tol:.3g})")


@pytest.mark.parametrize("flavour", ["llama-tied", "qwen2-untied-bias"])
def test_tiny_checkpoints_match_transformers(hf_available, tmp_path, tiny, tiny_qwen, flavour):
    """Our HF writer + transformers' loader + forward == our reference, for both architectures we support."""
    import torch
    from transformers import AutoModelForCausalLM

    model = tiny if flavour == "llama-tied" else tiny_qwen
    save_hf_dir(model, str(tmp_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, 40).tolist()
    assert_logits_close(our_logits(model, ids), hf_logits(hf, ids), model.config)
    ours = generate(model, ids, max_new_tokens=24, stop=False, backend="numpy")
    assert ours.token_ids == hf_greedy(hf, ids, 24)
