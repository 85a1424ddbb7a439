"""Many sequences at once (course_lib.batch): each sequence's tokens are those it gets alone, whatever it is batched
with, however tight the cache (preempted and recomputed), greedy and seeded; bad prompts named before anything
runs; the command line's --prompts-file. On the tiny model with the NumPy backend (fast everywhere)."""

import copy
import dataclasses
import json

import numpy as np
import pytest
from checks import as_computed

from course_lib import __main__ as cli
from course_lib import generate, generate_batch
from course_lib.batch import PAGE_SIZE, NumpyBatch, PagedSequence, Scheduler, Sequence
from course_lib.engine import NumpyBackend
from course_lib.gpu.kv_cache import PagedKVCache
from course_lib.kernels import SIMULATOR

PROMPTS = ["Hi", "the cat", list(range(5, 22)), "x"]  # 17 ids: more than a page
GREEDY = dict(max_new_tokens=40, stop=False)
SEEDED = dict(max_new_tokens=30, temperature=1.0, stop=False)


def alone(model, prompts, **kw):
    return [generate(model, p, backend="numpy", **kw).token_ids for p in prompts]


@pytest.mark.parametrize("pages,max_running", [(None, 64), (6, 64), (4, 2), (None, 1)],
                         ids=["roomy", "tight", "tighter", "one-at-a-time"])
@pytest.mark.parametrize("kw", [GREEDY, SEEDED | {"seed": 4}], ids=["greedy", "seeded"])
def test_tokens_are_those_of_each_prompt_alone(tiny, kw, pages, max_running):
    """(The tiny model's greedy text repeats tokens: a position off by one could hide there, not in sampled text,
    whose draws are keyed by position.)"""
    outs = generate_batch(tiny, PROMPTS, backend="numpy", pages=pages, max_running=max_running, **kw)
    assert [o.token_ids for o in outs] == alone(tiny, PROMPTS, **kw)
    assert all(o.stop_reason == "max_new_tokens" and o.text == tiny.tokenizer.decode(o.token_ids) for o in outs)
    if pages is not None:  # too few pages for all at once: sequences were preempted and recomputed
        assert sum(o.preemptions for o in outs) > 0


def test_seeded_tokens_do_not_depend_on_the_batch(tiny):
    first = generate_batch(tiny, PROMPTS[:2], backend="numpy", seed=[5, 6], **SEEDED)
    other = generate_batch(tiny, [PROMPTS[0], PROMPTS[2], PROMPTS[3]], backend="numpy", seed=[5, 9, 1], pages=5,
                           max_running=2, **SEEDED)
    assert first[0].token_ids == other[0].token_ids == alone(tiny, PROMPTS[:1], seed=5, **SEEDED)[0]
    assert first[1].token_ids == alone(tiny, PROMPTS[1:2], seed=6, **SEEDED)[0]
    same_seed = generate_batch(tiny, PROMPTS[:2], backend="numpy", seed=5, **SEEDED)
    assert same_seed[1].token_ids == alone(tiny, PROMPTS[1:2], seed=5, **SEEDED)[0]


def test_recomputed_sequence_has_the_bits_it_had(tiny, rng):
    """A preempted sequence comes back through NumpyBatch.recompute: the logits of its last position are those it
    had, bit for bit (its prompt in one pass, then its tokens one step at a time, as first computed)."""
    prompt, tokens = PROMPTS[2], rng.integers(0, tiny.config.vocab_size, 9).tolist()
    backend = NumpyBackend(tiny, 64)
    logits = backend.prefill(prompt)
    for token in tokens[:-1]:
        logits = backend.decode(token)
    runner = NumpyBatch(tiny, pages=4, max_len=64)
    seq = Sequence(0, prompt, 16, (0.0, None, None, 0), frozenset(), tokens=tokens)
    seq.kv = PagedSequence(runner.cache, 0, 64)
    np.testing.assert_array_equal(runner.recompute(seq), logits[None])
    np.testing.assert_array_equal(runner.forward(seq, tokens[-1:]), backend.decode(tokens[-1])[None])


@pytest.mark.parametrize("max_running", [1, 2])
def test_sequences_that_end_at_their_prefill(tiny, max_running):
    """One token each: every sequence ends at its prefill, and the next ones are admitted (none left waiting)."""
    outs = generate_batch(tiny, PROMPTS, backend="numpy", max_new_tokens=1, max_running=max_running, stop=False)
    assert [o.token_ids for o in outs] == [a[:1] for a in alone(tiny, PROMPTS, max_new_tokens=1, stop=False)]


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the simulator's NaN arithmetic
@pytest.mark.parametrize("backend", ["numpy", "cuda"])
def test_nan_logits_end_one_sequence_in_error(tiny_qwen, backend):
    """A sequence whose logits are NaN (a NaN row of the embedding table, read for its tokens only: the output
    head is untied) ends with an error; the others go on (on the GPU: the batch's sampler gives that row NO_TOKEN,
    the other row its token)."""
    weights = copy.deepcopy(tiny_qwen.weights)
    weights.embed[250] = np.nan
    model = dataclasses.replace(tiny_qwen, weights=weights)
    outs = generate_batch(model, ["Hi", [250, 250]], backend=backend, max_new_tokens=3, stop=False)
    assert outs[1].stop_reason.startswith("error: NaN") and outs[1].token_ids == []
    reference = tiny_qwen if backend == "numpy" else as_computed(tiny_qwen, "bf16")
    assert outs[0].token_ids == generate(reference, "Hi", backend="numpy", max_new_tokens=3, stop=False).token_ids


def test_each_sequence_reported_as_it_ends(tiny):
    ended = []
    outs = generate_batch(tiny, PROMPTS, backend="numpy", max_new_tokens=3, on_finish=lambda i, o: ended.append((i, o)))
    assert sorted(i for i, _ in ended) == [0, 1, 2, 3]
    assert all(outs[i] is o for i, o in ended)


@pytest.mark.parametrize("backend", ["numpy", "cuda"])
def test_stop_tokens_end_a_sequence(tiny, backend):
    """A sequence that meets an end token stops there, the token kept in its ids and out of its text; the other
    goes on. The steps are pipelined: the ending sequence's row of the step queued after its end token was
    computed for nothing, and thrown away (on the GPU: each row of a step fed, on the device, the token its
    sequence's row of the step before chose)."""
    greedy = alone(tiny if backend == "numpy" else as_computed(tiny, "bf16"), PROMPTS[:2], max_new_tokens=8,
                   stop=False)
    end = next((t for i, t in enumerate(greedy[0]) if i >= 2 and t not in greedy[0][:i]), None)
    assert end is not None, f"no token first met at the second decode step or later in {greedy[0]}"
    tokenizer = copy.copy(tiny.tokenizer)
    tokenizer.stop_ids = frozenset([end])
    outs = generate_batch(dataclasses.replace(tiny, tokenizer=tokenizer), PROMPTS[:2], backend=backend,
                          max_new_tokens=8)
    assert outs[0].token_ids == greedy[0][:greedy[0].index(end) + 1] and outs[0].stop_reason == "stop_token"
    assert outs[0].text == tiny.tokenizer.decode(outs[0].token_ids[:-1])
    other = greedy[1][:greedy[1].index(end) + 1] if end in greedy[1] else greedy[1]
    assert outs[1].token_ids == other


def test_scheduler_admits_by_free_pages_and_gives_them_back(tiny):
    cache = PagedKVCache(tiny.config, 4, PAGE_SIZE, host=True)
    scheduler = Scheduler(cache, max_running=8)
    seqs = [Sequence(i, [1] * n, 8, (0.0, None, None, 0), frozenset()) for i, n in enumerate([20, 40, 5])]
    scheduler.waiting.extend(seqs)
    assert scheduler.admit() == seqs[:1]  # 2 pages; the next needs 3 of the 2 left: it waits, and so does the third
    assert [s.index for s in scheduler.waiting] == [1, 2]
    scheduler.finish(_prefilled(cache, seqs[0]))
    assert cache.free_pages == 4 and scheduler.admit() == seqs[1:]  # 3 + 1 pages


def test_scheduler_preempts_the_last_admitted_first(tiny):
    """Three running sequences, each with its pages full (a prompt of PAGE_SIZE - 1 tokens and the next position
    reserved), one page free: each needs a new page for its next position, so the last admitted gives its pages back
    and waits first in line; the two others go on."""
    cache = PagedKVCache(tiny.config, 4, PAGE_SIZE, host=True)
    scheduler = Scheduler(cache, max_running=8)
    seqs = [_prefilled(cache, Sequence(i, [1] * (PAGE_SIZE - 1), 8, (0.0, None, None, 0), frozenset()))
            for i in range(3)]
    scheduler.running.extend(seqs)
    assert cache.free_pages == 1 and scheduler.short_of_pages()
    assert scheduler.make_room() == seqs[2:]
    assert scheduler.running == seqs[:2] and list(scheduler.waiting) == seqs[2:]
    assert seqs[2].kv is None and seqs[2].preemptions == 1 and cache.free_pages == 2
    assert not scheduler.short_of_pages()


def test_a_batch_that_cannot_go_on_is_an_error_not_a_hang(tiny, monkeypatch):
    """If pages were never given back (a bug), a waiting sequence could wait forever with nothing running: the loop
    says so instead."""
    monkeypatch.setattr(Scheduler, "finish", lambda self, seq: self.running.remove(seq))  # the pages kept
    with pytest.raises(RuntimeError, match=r"the batch cannot go on: prompt \d needs \d pages, 0 of \d are free"):
        generate_batch(tiny, PROMPTS[:3], backend="numpy", max_new_tokens=3, stop=False, max_running=1)


def test_each_step_reports_the_sequences_it_decodes(tiny):
    """on_step: the running set of each decode step. With one running at a time, every sequence runs alone, in
    order, for max_new_tokens - 1 steps (its first token comes from its prefill); with room for all, they run
    together until they end."""
    steps = []
    generate_batch(tiny, PROMPTS[:3], backend="numpy", max_new_tokens=3, stop=False, max_running=1,
                   on_step=steps.append)
    assert steps == [[0], [0], [1], [1], [2], [2]]
    steps.clear()
    generate_batch(tiny, PROMPTS[:3], backend="numpy", max_new_tokens=3, stop=False, on_step=steps.append)
    assert steps == [[0, 1, 2], [0, 1, 2]]


def test_stats_time_each_step_of_the_loop(tiny):
    """stats: one queuing time per decode step (as many as on_step reports) and one wait per step collected (every
    one: the last in the loop's last pass, which starts none), all non-negative seconds."""
    steps, stats = [], {}
    generate_batch(tiny, PROMPTS[:3], backend="numpy", max_new_tokens=4, stop=False, on_step=steps.append,
                   stats=stats)
    assert len(stats["queue"]) == len(steps) == 3 and len(stats["wait"]) == len(steps)
    assert min(stats["queue"] + stats["wait"]) >= 0


def _prefilled(cache, seq):
    """seq given its pages, as the prefill takes them."""
    seq.kv = PagedSequence(cache, seq.index, 64)
    seq.kv.reserve(len(seq.prompt_ids) + 1)
    return seq


@pytest.mark.parametrize("prompts,kw,match", [
    (["Hi", ""], {}, r"prompt 1 \(''\): the prompt is empty"),
    (["Hi", 5], {}, "prompt 1 \\(5\\)"),
    (["Hi", [1, 10**6]], {}, "prompt 1 .*out of range"),
    (["Hi", "x" * 3], {"max_new_tokens": 10**6}, "prompt 0 .*context"),
    (["Hi", list(range(1, 60))], {"pages": 2}, "prompt 1 .*cache's 2 pages"),
    ("Hi", {}, "list of prompts"),
    ([], {}, "list of prompts"),
    (["Hi", "x"], {"seed": [1]}, "1 seeds for 2 prompts"),
    (["Hi"], {"max_running": 0}, "max_running"),
    (["Hi"], {"backend": "tpu"}, "unknown backend"),
])
def test_bad_input_is_a_clear_error(tiny, prompts, kw, match):
    with pytest.raises(ValueError, match=match):
        generate_batch(tiny, prompts, **({"max_new_tokens": 4, "backend": "numpy"} | kw))


def test_cli_prompts_file(tmp_path, tiny, monkeypatch, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text("Hi\n\n" + json.dumps({"prompt": "the cat"}) + "\n" + json.dumps("x") + "\n")
    assert cli.read_prompts(str(path)) == {1: "Hi", 3: "the cat", 4: "x"}
    quoted = tmp_path / "quoted.txt"
    quoted.write_text('"To be or not to be" - who said it?\n')
    assert cli.read_prompts(str(quoted)) == {1: '"To be or not to be" - who said it?'}
    monkeypatch.setattr("course_lib.load_model", lambda name: tiny)
    assert cli.main(["generate", "--prompts-file", str(path), "--max-new-tokens", "3", "--backend", "numpy"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert sorted(line.split("]")[0] for line in out if line.startswith("[line ")) == ["[line 1", "[line 3", "[line 4"]
    assert out[-1].startswith("[3 sequences, ")


@pytest.mark.parametrize("text, args, says", [
    ('{"text": "no prompt key"}\n', [], "line 1: expected a JSON string"),
    ('Hi\n{"prompt": "broken\n', [], "line 2: not a JSON object"),  # a JSON line cut short: not taken as text
    ("Hi\n\n" + "x " * 300 + "\n", ["--max-new-tokens", "10000"], "line 3 ('x x x"),  # the file's line, not index
    ("Hi\n", ["--recipe", "graph"], "--recipe chooses the step of one sequence"),
    ("Hi\n", ["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
], ids=["no prompt key", "JSON cut short", "too long", "recipe", "max-new-tokens"])
def test_cli_prompts_file_errors(tmp_path, tiny, monkeypatch, capsys, text, args, says):
    """Each a one-line error (status 2) that names the file's line, printed with no progress bar across it."""
    path = tmp_path / "prompts.txt"
    path.write_text(text)
    monkeypatch.setattr("course_lib.load_model", lambda name: tiny)
    assert cli.main(["generate", "--prompts-file", str(path), "--backend", "numpy", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "error:" in err and "sequences:" not in err


def test_cli_errors_on_files(tmp_path, capsys):
    assert cli.main(["generate", "--prompts-file", str(tmp_path)]) == 2  # a directory: an error, no traceback
    assert "error:" in capsys.readouterr().err
    assert cli.main(["generate", "--prompts-file", str(tmp_path / "missing.txt")]) == 2
    assert "No such file" in capsys.readouterr().err
    assert cli.main(["generate"]) == 2


def test_bad_prompts_are_listed_by_index():
    """generate_batch's error keeps each refused prompt's index and what is wrong (the CLI names file lines)."""
    from course_lib.batch import BadPromptsError, _excerpt

    e = BadPromptsError([(1, "(''): the prompt is empty"), (4, "('x'): too long")])
    assert e.problems[1][0] == 4 and str(e).splitlines()[1:] == ["  prompt 1 (''): the prompt is empty",
                                                                   "  prompt 4 ('x'): too long"]
    assert _excerpt("a" * 100) == repr("a" * 35) + "..." and _excerpt("short") == "'short'"
    assert _excerpt(list(range(20))) == "[0, 1, 2, 3, 4, 5, 6, 7, ...]" and _excerpt([1, 2]) == "[1, 2]"


def test_cuda_batch_gives_each_prompt_its_tokens_through_a_preemption(tiny, monkeypatch):
    """The fused step over three sequences sharing the cache's three pages: they start in the plan of four rows
    (gpu.plan.BUCKETS; the padding row feeds the padding slot, its token never read); at the second step the long
    one needs a second page, the one admitted last is preempted, waits, and is recomputed, the others going on in
    the plan of two. Each gets the reference's greedy tokens (the batched rows have the bits they have alone: the
    split-K kernels sum a row the same way whatever the number of rows, and every pass chunks the keys alike)."""
    from course_lib.batch import CudaBatch
    from course_lib.kernels import paged_attention as pa

    steps, chunked = [], []
    start, attention = CudaBatch.start, pa.flash_attention
    monkeypatch.setattr(CudaBatch, "start", lambda self, seqs, feeds: (start(self, seqs, feeds),
                                                                       steps.append((len(seqs), max(self.plans))))[0])
    monkeypatch.setattr(pa, "flash_attention", lambda *a, chunks=pa.SEQUENCE_CHUNKS, **kw: (
        chunked.append(chunks), attention(*a, chunks=chunks, **kw))[1])
    prompts, kw = [list(range(1, 16)), "Hi", [7]], dict(max_new_tokens=3, stop=False)
    outs = generate_batch(tiny, prompts, backend="cuda", pages=3, **kw)
    assert steps[0] == (3, 4) and outs[2].preemptions == 1 and "continuous batching" in outs[0].backend
    expected = [generate(as_computed(tiny, "bf16"), p, backend="numpy", **kw).token_ids for p in prompts]
    assert [o.token_ids for o in outs] == expected
    # every pass (prefills, the recompute, the steps of both buckets' plans) chunks the keys alike: a batch's chunks
    assert chunked and set(chunked) == {pa.BATCH_CHUNKS}


@pytest.mark.skipif(SIMULATOR, reason="the real model: a GPU test")
def test_cuda_backend_gives_each_prompt_its_own_tokens(smollm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    kw = dict(max_new_tokens=16, stop=False, temperature=0.8, seed=3)
    outs = generate_batch(smollm, prompts, backend="cuda", **kw)
    assert [o.token_ids for o in outs] == [generate(smollm, p, backend="cuda", **kw).token_ids for p in prompts]
