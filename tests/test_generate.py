"""The generator: sampling, stop tokens, streaming, errors; and the command line."""

import numpy as np
import pytest

import course_lib
from course_lib import generate
from course_lib.__main__ import main
from course_lib.kernels.sampling import sample
from course_lib.model.loading import save_hf_dir


class Scripted:
    """A backend that makes the model 'say' a fixed sequence of token ids (any object with the engine's backend
    interface can drive generate)."""

    name = "scripted"

    def __init__(self, model, script):
        self.vocab, self.script, self.capacity = model.config.vocab_size, script, model.config.max_seq_len

    def reset(self):
        self.i = 0

    def _next(self):
        logits = np.zeros(self.vocab, np.float32)
        logits[self.script[min(self.i, len(self.script) - 1)]] = 10.0
        self.i += 1
        return logits

    def prefill(self, ids):
        return self._next()

    def decode(self, token):
        return self._next()


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert sample(logits, 0.0, None, None, seed=0, position=0) == 1


def draws(logits, n, temperature=1.0, top_k=None, top_p=None, seed=1):
    """n draws of the sampler, one per position (the generator is keyed by (seed, position))."""
    return np.array([sample(logits, temperature, top_k, top_p, seed, position) for position in range(n)])


def test_sampling_distribution_and_filters():
    """On fixed logits, the frequencies of 20,000 draws match the softmax (chi-square, 3 degrees of freedom: 16.27
    is exceeded with probability 0.001 by a correct sampler), and top-k / top-p never pick outside their set."""
    p = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(p).astype(np.float32)
    n = 20_000
    counts = np.bincount(draws(logits, n), minlength=4)
    assert ((counts - n * p) ** 2 / (n * p)).sum() < 16.27, counts
    assert set(draws(logits, 300, top_k=2)) == {0, 1}  # top-k keeps 2 tokens
    assert set(draws(logits, 300, top_p=0.75)) == {0, 1}  # 0.5 + 0.3 reaches 0.75
    assert set(draws(logits, 100, top_p=0.5)) == {0}  # 0.5 alone reaches 0.5
    assert set(draws(logits, 50, top_k=1)) == {0}  # top_k=1 is greedy
    assert np.mean(draws(logits, 500, temperature=0.2) == 0) > 0.85  # a low temperature sharpens the distribution


def test_top_k_and_top_p_keep_ties_together():
    logits = np.log(np.array([0.4, 0.2, 0.2, 0.2])).astype(np.float32)
    assert set(draws(logits, 400, top_k=2)) == {0, 1, 2, 3}  # the 2nd largest is tied three ways: all stay
    assert set(draws(logits, 400, top_p=0.5)) == {0, 1, 2, 3}  # 0.4 + 0.2 reaches 0.5, and its ties come along
    assert sample(np.array([1.0, np.nan], np.float32), 1.0, None, None, 0, 0) == -1  # NaN: no token


def test_seeded_sampling_is_reproducible(tiny):
    kw = dict(max_new_tokens=20, temperature=1.0, top_p=0.95, stop=False, backend="numpy")
    a = generate(tiny, "Hello", seed=3, **kw)
    assert a.token_ids == generate(tiny, "Hello", seed=3, **kw).token_ids
    assert a.token_ids != generate(tiny, "Hello", seed=4, **kw).token_ids


def test_stops_on_end_token_and_excludes_it_from_text(tiny):
    tok = tiny.tokenizer
    scripted = Scripted(tiny, tok.encode("ok") + [tok.eos_id] + tok.encode("never"))
    out = generate(tiny, "Hi", max_new_tokens=10, backend=scripted)
    assert out.stop_reason == "stop_token"
    assert out.token_ids == tok.encode("ok") + [tok.eos_id]
    assert out.text == "ok"
    full = generate(tiny, "Hi", max_new_tokens=6, backend=scripted, stop=False)
    assert full.stop_reason == "max_new_tokens" and len(full.token_ids) == 6


def test_streaming_emits_whole_characters(tiny):
    text = "héllo 🙂 wörld"
    scripted = Scripted(tiny, tiny.tokenizer.encode(text) + [tiny.tokenizer.eos_id])
    pieces = []
    out = generate(tiny, "Hi", max_new_tokens=40, backend=scripted, stream=pieces.append)
    assert "".join(pieces) == out.text == text
    assert all("\ufffd" not in p for p in pieces)


def test_chat_prompt_uses_template(tiny):
    out = generate(tiny, "Hi", chat=True, max_new_tokens=2, backend="numpy")
    assert tiny.tokenizer.decode(out.prompt_ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_timing_fields(tiny):
    out = generate(tiny, "Hello", max_new_tokens=8, stop=False, backend="numpy")
    assert len(out.step_s) == 7 and out.decode_s > 0 and out.tokens_per_s > 0 and out.decode_tokens_per_s > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 9999]), "out of range"),
    (dict(prompt=[-1]), "out of range"),
    (dict(prompt=[1] * 250, max_new_tokens=10), "exceed the model's context of 256"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(backend="tpu"), "unknown backend"),
    (dict(prompt=[1, 2], chat=True), "chat=True needs a text prompt"),
])
def test_bad_input_is_a_clear_error(tiny, kwargs, match):
    args = dict(prompt="Hello", max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(tiny, args.pop("prompt"), **args)


@pytest.mark.skipif(course_lib.gpu_available(), reason="the simulator's limit: without a GPU only")
def test_a_real_model_in_the_simulator_is_a_clear_error(tiny, monkeypatch):
    """backend='cuda' without a GPU is the simulator: a model above device.SIMULATOR_MAX_PARAMS is refused at once,
    saying what to use instead (SmolLM2 there ran for more than ten minutes without a word); the tiny model runs."""
    from course_lib import device
    from course_lib.engine import Engine

    assert generate(tiny, "Hi", max_new_tokens=1, backend="cuda").token_ids
    monkeypatch.setattr(device, "SIMULATOR_MAX_PARAMS", tiny.config.n_params() - 1)
    for run in (lambda: Engine(tiny, backend="cuda"),
                lambda: course_lib.generate_batch(tiny, ["Hi", "Ho"], max_new_tokens=1, backend="cuda")):
        with pytest.raises(ValueError, match=r"would take hours per token there\. Use backend='numpy'"):
            run()
    assert generate(tiny, "Hi", max_new_tokens=1, backend="auto").token_ids  # the NumPy reference


def test_cli_generate_and_info(tmp_path, tiny, capsys):
    save_hf_dir(tiny, str(tmp_path))
    assert main(["generate", "Hello", "--model", str(tmp_path), "--max-new-tokens", "5", "--backend", "numpy"]) == 0
    out = capsys.readouterr()
    assert "tokens/s" in out.out and "numpy backend" in out.out
    assert main(["generate", "Hello", "--model", str(tmp_path), "--max-new-tokens", "1", "--backend", "numpy"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]  # one token: no decode step, so no decode rate
    assert summary.startswith("[1 token, ") and "decode" not in summary and "nan" not in summary
    assert main(["info", "--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"mode: {course_lib.mode()}" in out and f"parameters: {tiny.config.n_params():,}" in out


def test_cli_reports_errors(tmp_path, capsys):
    assert main(["generate", "Hello", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "error:" in capsys.readouterr().err


def test_param_count_matches_the_weights(tiny, tiny_qwen, smollm):
    for model in (tiny, tiny_qwen, smollm):
        assert model.config.n_params() == sum(a.size for _, a in model.weights.arrays())
    assert smollm.config.n_params() == 134_515_008


def test_accounting_constants_match_the_real_model(smollm):
    from course_lib.measure.accounting import decode_cost, matmul_params, tokens_per_s_bound
    from course_lib.model.config import SMOLLM2_135M

    real = smollm.config
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "rope_theta"):
        assert getattr(SMOLLM2_135M, field) == getattr(real, field)
    # tied embeddings: every parameter but the norms takes part in a matmul for each token
    norms = (2 * real.n_layers + 1) * real.d_model
    assert matmul_params(real) == real.n_params() - norms
    cost = decode_cost(real, context=0, weight_bytes=2)
    assert cost.flops == 2 * matmul_params(real)
    assert 0.99 < cost.intensity < 1.01  # ~2 FLOPs per 2-byte weight: about one FLOP per byte
    assert 15_000 < tokens_per_s_bound(real, 4.27e12, context=0, weight_bytes=2) < 16_500


def test_default_model_names_in_any_case(monkeypatch):
    """The default model's name is accepted in any case and with its Hugging Face organization."""
    from course_lib.model import loading

    seen = []
    monkeypatch.setattr(loading, "fetch_default_gguf", lambda progress=True: seen.append(1) or "x.gguf")
    monkeypatch.setattr(loading, "load_gguf", lambda path, progress=True: path)
    for name in ("SmolLM2-135M-Instruct", "smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert loading.load_model(name) == "x.gguf"
    assert len(seen) == 3
    with pytest.raises(FileNotFoundError, match="neither"):
        loading.load_model("SmolLM2-360M")


def test_cli_output_into_a_closed_pipe(tmp_path, tiny, monkeypatch):
    """`python -m course_lib info | head -1`: when the reader has gone, the command ends quietly (status 0)
    instead of with a BrokenPipeError traceback."""
    import sys

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            pass

    save_hf_dir(tiny, str(tmp_path))
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["info", "--model", str(tmp_path)]) == 0
