"""The megakernel (course_lib.megakernel.kernel): one persistent launch runs whole decode steps and gives the
reference's tokens, greedy and seeded, whether the steps come in one launch or many. In the simulator one block runs
the whole program on the tiny models, and three blocks waiting on each other's counters once (their threads
interleaved: kernels.blocks_together); on a GPU a block per SM runs the real SmolLM2, against the reference and the
graph recipe."""

import dataclasses

import numpy as np
import pytest
from checks import as_computed, logit_tolerance

from course_lib import Engine, generate, reference
from course_lib.kernels import SIMULATOR
from course_lib.megakernel.kernel import SLICE_COLS
from course_lib.megakernel.runner import Megakernel, check_shapes
from course_lib.megakernel.schedule import counter_tables
from course_lib.model.config import SMOLLM2_135M

N_NEW = 4 if SIMULATOR else 32
PROMPTS = [[3, 17, 42]] if SIMULATOR else [  # the tiny tokenizer is byte-level: a sentence is ~25 steps
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module", params=["tiny_qwen"] if SIMULATOR else ["smollm"])
def mk_model(request):
    """The Qwen flavour in the simulator (QKV bias, untied head); the tiny Llama's tied head runs in the tests below."""
    return request.getfixturevalue(request.param)


def megakernel_engine(model, weights):
    return Engine(model, "cuda", recipe="megakernel", weights=weights, capacity=96)


@pytest.mark.parametrize("weights", ["f32"] if SIMULATOR else ["bf16"])
def test_megakernel_gives_the_reference_greedy_tokens(mk_model, weights):
    engine = megakernel_engine(mk_model, weights)
    for prompt in PROMPTS:
        expected = generate(as_computed(mk_model, weights), prompt, backend="numpy", max_new_tokens=N_NEW, stop=False)
        assert engine.generate(prompt, max_new_tokens=N_NEW, stop=False).token_ids == expected.token_ids, prompt
        if not SIMULATOR:  # and the graph replay of the fused step's
            fused = Engine(mk_model, "cuda", recipe="fused", weights=weights, capacity=96)
            assert engine.generate(prompt, max_new_tokens=N_NEW, stop=False).token_ids == \
                fused.generate(prompt, max_new_tokens=N_NEW, stop=False).token_ids


@pytest.mark.parametrize("cols", [SLICE_COLS, SLICE_COLS // 2] if SIMULATOR else [SLICE_COLS])
def test_megakernel_logits_match_reference(mk_model, cols):
    """Each launch's last logits (the kernel's buffer, poisoned before) against the reference's within
    checks.logit_tolerance: the tokens alone can hide an error that moves every logit a little (a greedy run that
    repeats one token). Its qkv instructions take a head's RoPE pairs in slices of cols / 2: a head whole or in two
    (the tiny models' 8 pairs in the simulator), in two (SmolLM2's 32 pairs on a GPU)."""
    weights = "f32" if SIMULATOR else "bf16"
    c, prompt = mk_model.config, PROMPTS[0]
    ids = np.asarray(prompt if SIMULATOR else mk_model.tokenizer.encode(prompt))
    mk = Megakernel(mk_model, 32, weights=weights, cols=cols)
    ref_model, cache, rope = as_computed(mk_model, weights), reference.KVCache(c, 32), reference.rope_tables(c, 32)
    poison = np.full(c.vocab_size, np.nan, np.float32)
    mk.state.logits.copy_to_device(poison)
    token, fed = mk.prefill(ids), ids
    for _ in range(2):
        ref = reference.forward(ref_model.weights, c, fed, cache, rope)
        ours = mk.state.logits.copy_to_host()
        assert np.all(np.isfinite(ours)) and np.abs(ours - ref).max() <= logit_tolerance(c, np.abs(ref).max())
        mk.state.logits.copy_to_device(poison)
        fed, token = [token], mk.decode(1)[0]


def test_megakernel_seeded_sampling_matches_reference(request):
    """The same (seed, position) draws the same token on the host and inside the megakernel."""
    mk_model = request.getfixturevalue("tiny" if SIMULATOR else "smollm")
    kw = dict(max_new_tokens=N_NEW, stop=False, temperature=0.8, top_p=0.95, seed=11)
    weights = "f32" if SIMULATOR else "bf16"
    prompt = PROMPTS[-1]
    expected = generate(as_computed(mk_model, weights), prompt, backend="numpy", **kw)
    assert megakernel_engine(mk_model, weights).generate(prompt, **kw).token_ids == expected.token_ids


def test_steps_split_across_launches_give_the_same_tokens(tiny):
    """The counters count every step: launches of 1 and 1 steps continue one sequence as one launch of 2 would, and
    a new sequence starts on counters never cleared."""
    one = Megakernel(tiny, 32, weights="bf16")
    tokens = [one.prefill([5])] + one.decode(2)
    many = Megakernel(tiny, 32, weights="bf16")
    assert [many.prefill([5])] + many.decode(1) + many.decode(1) == tokens
    assert many.epoch == 1 + 2 and many.prefill([5]) == tokens[0]  # a new sequence reuses the counters


def test_a_launch_ends_after_an_end_token(tiny):
    """decode(steps, stops): the kernel ends after the step that chose an end token (its counters count only the
    steps run), and the next launch goes on from there as if it had been asked for those steps alone."""
    sampling = (2.0, None, None, 7)  # seeded sampling, hot: the tiny model's greedy text repeats one token
    tokens = (lambda mk: [mk.prefill([5], sampling)] + mk.decode(5))(Megakernel(tiny, 32, weights="bf16"))
    k = next(k for k in range(2, 5) if tokens[k] not in tokens[1:k])  # a token first chosen by decode step k
    mk = Megakernel(tiny, 32, weights="bf16")
    mk.prefill([5], sampling)
    assert mk.decode(4, stops={tokens[k], 10**6}) == tokens[1:k + 1]
    sample = counter_tables(mk.program, tiny.config)["counter_of"][-1]  # the sample instruction's counter
    ran = int(mk.state.counters.copy_to_host()[sample])  # steps whose sample ran
    assert mk.epoch == mk.position == 1 + k and ran == 1 + k  # the prompt's step, then k steps of the 4
    assert mk.decode(5 - k) == tokens[k + 1:]


def test_grid_barrier_version_gives_the_same_tokens(tiny):
    """sync="barrier": a grid barrier between consecutive phases instead of the counters, the same tokens. In the
    simulator one block runs (it checks the barriers' counting: a target one too high never ends; the waiting between
    blocks runs on the GPU), here with the counters cleared before every launch after the first, as before int32
    would overflow."""
    counted = Megakernel(tiny, 32, weights="bf16")
    tokens = [counted.prefill([5])] + counted.decode(2)
    barrier = Megakernel(tiny, 32, weights="bf16", sync="barrier")
    barrier.per_step = 2**30  # each launch after the first would pass 2**31: the counters restart from 0
    assert [barrier.prefill([5])] + barrier.decode(1) + barrier.decode(1) == tokens
    assert barrier.epoch == 1
    with pytest.raises(ValueError, match="sync must be"):
        Megakernel(tiny, 32, sync="fence")


@pytest.mark.skipif(not SIMULATOR, reason="on a GPU every test runs a block per SM")
def test_blocks_that_wait_for_each_other_in_the_simulator(tiny):
    """Three blocks in the simulator, run at once (kernels.blocks_together: their threads interleaved, each block
    waiting on the counters of the others): the same tokens and the same logits, bit for bit, as one block, after the
    prompt and after a step (each instruction does the same arithmetic on whichever block runs it). One block alone
    never waits, so a wait for one instruction too few (a counter's target one short) or an epoch that stays that of
    a launch's first step (the prompt's three steps run in one launch) pass there and fail here."""
    runs = []
    for blocks in (1, 3):
        mk = Megakernel(tiny, 32, weights="f32", blocks=blocks)
        mk.state.logits.copy_to_device(np.full(tiny.config.vocab_size, np.nan, np.float32))
        tokens = [mk.prefill([3, 17, 42])]
        logits = [mk.state.logits.copy_to_host()]
        tokens += mk.decode(1)
        runs.append((tokens, logits + [mk.state.logits.copy_to_host()]))
    (one, one_logits), (three, three_logits) = runs
    assert three == one
    for a, b in zip(one_logits, three_logits, strict=True):
        np.testing.assert_array_equal(b.view(np.uint32), a.view(np.uint32))


def test_shapes_the_megakernel_cannot_run_are_refused(tiny):
    wide = dataclasses.replace(SMOLLM2_135M, d_model=9 * 512)  # head_dim 512: more than attention's 256
    with pytest.raises(ValueError, match="head_dim = 512"):
        check_shapes(wide)
    check_shapes(tiny.config)
    with pytest.raises(ValueError, match="an even number"):  # a pair of outputs split between two instructions
        Megakernel(tiny, 32, cols=15)


def test_the_diff_tool_names_the_first_wrong_instruction(tiny):
    """Bisecting the step with program prefixes: clean against the twin, then a weight of layer 1's gate column 20
    changed on the GPU: the first wrong instruction is the gate/up slice holding that column."""
    from course_lib.kernels import cuda
    from course_lib.megakernel import Twin, TwinState
    from course_lib.megakernel.diff import COMPARED, first_kernel_difference

    mk = Megakernel(tiny, 16, weights="f32")
    twin = Twin(tiny, 16, cols=SLICE_COLS, vocab_cols=384)
    tokens = [42]
    clean = TwinState.empty(tiny, 16)  # the twin's step alone: the scale of its buffers
    clean.token[0] = tokens[0]
    twin.run(clean, range(len(twin.program)))
    scale = max(float(np.abs(getattr(clean, name)).max()) for name in COMPARED if name != "token")
    tolerance = logit_tolerance(tiny.config, scale)  # the same float32 pass, another summation order
    assert first_kernel_difference(mk, twin, tokens, tolerance) is None
    c = tiny.config
    w_gu = mk.w["w_gu"].copy_to_host().view(np.float32)  # [L, 2 d_ff, d] flat, row 2j: gate output j
    w_gu[(1 * 2 * c.d_ff + 2 * 20) * c.d_model + 0] += 5.0
    mk.w["w_gu"] = cuda.to_device(w_gu.view(np.uint32))
    index, ins, buffer, gap = first_kernel_difference(mk, twin, tokens, tolerance)
    assert (ins.op, ins.layer, ins.start) == ("gate_up", 1, 16) and buffer == "act" and gap > tolerance
    assert first_kernel_difference(mk, twin, tokens, gap / 2)[:3] == (index, ins, buffer)  # the tolerance given


def test_a_capacity_of_part_of_a_page(tiny):
    """The cache holds whole pages of paged_attention's rows (kernel.PAGE): a capacity that is not a multiple of
    them is rounded up inside, and the tokens are the reference's."""
    from course_lib.megakernel.kernel import PAGE

    mk = Megakernel(tiny, PAGE + 4, weights="f32")
    assert mk.state.k_cache.shape[1] == 2 * PAGE
    expected = generate(tiny, [3, 17, 42], backend="numpy", max_new_tokens=3, stop=False).token_ids
    assert [mk.prefill([3, 17, 42])] + mk.decode(2) == expected
