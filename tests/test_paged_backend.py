"""The CUDA backend with the paged cache (notebook 03): no allocation per step, a full cache is an error, and the
cache changes the work, not the result (bit for bit against recomputation); the runtime that recycles its arrays.
"""

import numpy as np
import pytest

from course_lib.gpu.backend import PAGED, ROW_DOT, CudaBackend
from course_lib.kernels import SIMULATOR
from course_lib.kernels.sampling import sample
from course_lib.measure.profiler import _without_holds, profile_decode

N_NO_CACHE = 5 if SIMULATOR else 150  # tokens generated with and without the cache (on a GPU: past 128 keys, two
# chunks and their merge; 300 took 5.6 minutes, the longest test of the GPU suite)


def test_paged_step_allocates_nothing(tiny):
    """With the paged cache, a decode step in steady state allocates no device memory and uploads once (steps
    recorded, not run: the counts are the host's)."""
    backend = CudaBackend(tiny, 40, weights="f32", ops=PAGED)
    backend.rt.record(lambda: backend.prefill([1, 2, 3]))
    backend.rt.record(lambda: backend.decode(4))  # the first step of this shape fills the runtime's pool
    allocations, transfers = backend.rt.allocations, backend.rt.transfers
    launches = backend.rt.record(lambda: backend.decode(5))
    assert backend.rt.allocations == allocations and backend.rt.transfers == transfers + 1
    # per layer: norm, q, k, v, 2 rope, 2 cache writes, flash-decoding (40 keys, one chunk: no merge), o, add,
    # norm, gate, up, silu_mul, down, add; then embedding, final norm, logits
    assert len(launches) == 17 * tiny.config.n_layers + 3
    baseline = CudaBackend(tiny, 40, weights="f32")
    baseline.rt.record(lambda: baseline.prefill([1, 2, 3]))
    allocations = baseline.rt.allocations
    baseline.rt.record(lambda: baseline.decode(4))
    assert baseline.rt.allocations - allocations > 2 * tiny.config.n_layers


def test_paged_cache_full_is_an_error(tiny):
    backend = CudaBackend(tiny, 20, weights="f32", ops=PAGED)
    backend.prefill(list(range(1, 19)))
    with pytest.raises(ValueError, match="do not fit"):
        backend.prefill([1, 2, 3])
    backend.decode(5)  # still usable
    backend.reset()
    assert backend.length == 0
    backend.prefill([7])
    assert backend.cache.free_pages == backend.cache.pages - 1  # the old pages came back


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_cache_equals_no_cache(request, temperature):
    """Generation with the paged cache gives the same logits, bit for bit, and so the same tokens, as recomputing
    the whole sequence every token (reset, then prefill): the cache changes the work, not the result."""
    if SIMULATOR and temperature == 0:
        pytest.skip("simulator time: the bits do not depend on how the tokens were chosen (seeded covers it)")
    model = request.getfixturevalue("tiny_one_layer" if SIMULATOR else "smollm")
    prompt = model.tokenizer.encode("Hi" if SIMULATOR else "The capital of France is")
    capacity = len(prompt) + N_NO_CACHE
    cached, fresh = (CudaBackend(model, capacity, weights="bf16", ops=ROW_DOT) for _ in range(2))  # the default's
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
    if SIMULATOR and temperature == 0:
        pytest.skip("simulator time: the bits do not depend on how the tokens were chosen (seeded covers it)")
    model = request.getfixturevalue("tiny_one_layer" if SIMULATOR else "smollm")
    prompt = model.tokenizer.encode("Hi" if SIMULATOR else "The capital of France is")
    capacity = len(prompt) + N_FULL_PREFILL
    cached, fresh = (CudaBackend(model, capacity, weights="bf16", ops=ROW_DOT) for _ in range(2))  # the default's
    ids, steps = list(prompt), [cached.prefill(prompt)]
    while len(ids) < capacity:
        ids.append(sample(steps[-1], temperature, None, 0.95 if temperature else None, seed=11, position=len(ids)))
        if len(ids) < capacity:
            steps.append(cached.decode(ids[-1]))
    rows = fresh.prefill(ids[:-1], all_logits=True)[len(prompt) - 1:]
    assert len(steps) == N_FULL_PREFILL == rows.shape[0]
    np.testing.assert_array_equal(np.array(steps).view(np.uint32), rows.view(np.uint32))


def test_recycled_arrays_do_not_pile_up():
    """Runtime(reuse=True) keeps one array per call of a pass: the same one while the shape holds, a replacement
    when it changes (a prompt of another length), never both."""
    from course_lib.gpu.runtime import Runtime

    rt = Runtime(reuse=True)
    first = []
    for length in (3, 3, 5, 5, 4):
        rt.begin_pass()
        first.append(rt.empty((length, 8)))
        rt.empty(16, np.int32)
    assert first[0] is first[1] and first[2] is first[3] and first[1] is not first[2] and first[4].shape == (4, 8)
    assert rt.allocations == 4 and len(rt._pool) == 2  # (3, 8), (5, 8), (4, 8) and the int32 array once


def test_uploads_arrive_intact():
    """Runtime.to_device with reuse: the device gets the array as it was at the call (on a GPU through a pinned
    buffer, asynchronously), even when the caller changes its array at once, pass after pass."""
    from course_lib.gpu.runtime import Runtime

    rt = Runtime(reuse=True)
    for i in range(4):
        rt.begin_pass()
        data = np.arange(10, dtype=np.int32) + i
        got = rt.to_device(data)
        data[:] = -1
        np.testing.assert_array_equal(got.copy_to_host(), np.arange(10) + i)


@pytest.mark.skipif(SIMULATOR, reason="a queued profile needs a GPU")
def test_queued_profile_never_waits_for_the_host(tiny):
    """profile_decode(queued=True) queues the whole paged step behind the hold: nothing in the step waits for the
    GPU (uploads are asynchronous), so kernels run back to back and no warning is raised."""
    import warnings

    backend = CudaBackend(tiny, 40, weights="bf16", ops=PAGED)
    backend.prefill([1, 2, 3])
    backend.decode(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = profile_decode(backend, 5, queued=True)
    gaps = [s - e for (_, _, e), (_, s, _) in zip(step.kernels, step.kernels[1:], strict=False)]
    assert step.transfers == 1 and max(gaps) < 0.02, max(gaps)


def test_holds_taken_out_of_a_queued_timeline():
    """A queued profile's timeline without its holds: the kernel after each hold (every `every` launches) starts
    where the previous one ended, and everything after it moves by the same amount; durations are unchanged."""
    kernels = [("a", 0.0, 1.0), ("b", 1.5, 2.0), ("c", 50.0, 51.0), ("d", 51.5, 52.0), ("e", 90.0, 90.5)]
    got = _without_holds(kernels, every=2)
    assert got == [("a", 0.0, 1.0), ("b", 1.5, 2.0), ("c", 2.0, 3.0), ("d", 3.5, 4.0), ("e", 4.0, 4.5)]
    assert _without_holds(kernels, every=len(kernels)) == kernels  # no hold inside the step
