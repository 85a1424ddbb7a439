"""The paged cache changes the work, not the result (notebook 03): the default recipe's logits with the cache equal,
bit for bit, those of recomputing the sequence. The longest tests of the simulator's run (each decode step of the
one-pass kernels runs thread by thread there), in a file of their own so that they start first and a worker of
their own takes them (conftest.LONGEST_FIRST)."""

import numpy as np
import pytest

from course_lib.gpu.backend import FIVE, CudaBackend
from course_lib.kernels import SIMULATOR
from course_lib.kernels.sampling import sample

N_NO_CACHE = 3 if SIMULATOR else 150  # tokens generated with and without the cache (on a GPU: past 128 keys, two
# chunks merged by the last block of each head; 300 took 5.6 minutes, the longest test of the GPU suite; in the
# simulator each token is a prefill and a decode step of several seconds each, and the test below checks 18 tokens at
# a lower cost)


def _prompt_and_two_backends(request, temperature, tokens):
    """(prompt ids, capacity, two backends of the default's ops for the prompt and `tokens` more): the tiny one-layer
    model in the simulator (greedy skipped there: seeded covers the same bits), the real SmolLM2 on a GPU."""
    if SIMULATOR and temperature == 0:
        pytest.skip("simulator time: the bits do not depend on how the tokens were chosen (seeded covers it)")
    model = request.getfixturevalue("tiny_one_layer" if SIMULATOR else "smollm")
    prompt = model.tokenizer.encode("Hi" if SIMULATOR else "The capital of France is")
    capacity = len(prompt) + tokens
    return prompt, capacity, *(CudaBackend(model, capacity, weights="bf16", ops=FIVE) for _ in range(2))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_cache_equals_no_cache(request, temperature):
    """Generation with the paged cache gives the same logits, bit for bit, and so the same tokens, as recomputing
    the whole sequence every token (reset, then prefill): the cache changes the work, not the result."""
    prompt, capacity, cached, fresh = _prompt_and_two_backends(request, temperature, N_NO_CACHE)
    ids = list(prompt)
    logits = cached.prefill(ids)
    for _ in range(N_NO_CACHE):
        fresh.reset()
        again = fresh.prefill(ids)
        np.testing.assert_array_equal(logits.view(np.uint32), again.view(np.uint32))
        token = sample(logits, temperature, None, 0.95 if temperature else None, seed=7, position=len(ids))
        assert token == sample(again, temperature, None, 0.95 if temperature else None, seed=7, position=len(ids))
        ids.append(token)
        if len(ids) < capacity:
            logits = cached.decode(token)


N_FULL_PREFILL = 18 if SIMULATOR else 300  # tokens checked against one prefill of the whole sequence (> 16: two
# pages and two 16-row slices of the prefill)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_cache_equals_one_full_prefill(request, temperature):
    """The same check over more tokens, affordable in the simulator: the logits of every cached step equal, bit for
    bit, the row of that position in ONE prefill of the whole final sequence without a cache (all_logits). A row of
    the paged forward pass does not depend on the other rows of its pass (see test_cache_equals_no_cache, which
    recomputes every prefix), so that row is what recomputing the prefix alone gives; then, step by step, the
    uncached generation would have chosen the same tokens."""
    prompt, capacity, cached, fresh = _prompt_and_two_backends(request, temperature, N_FULL_PREFILL)
    ids, steps = list(prompt), [cached.prefill(prompt)]
    while len(ids) < capacity:
        ids.append(sample(steps[-1], temperature, None, 0.95 if temperature else None, seed=11, position=len(ids)))
        if len(ids) < capacity:
            steps.append(cached.decode(ids[-1]))
    rows = fresh.prefill(ids[:-1], all_logits=True)[len(prompt) - 1:]
    assert len(steps) == N_FULL_PREFILL == rows.shape[0]
    np.testing.assert_array_equal(np.array(steps).view(np.uint32), rows.view(np.uint32))
