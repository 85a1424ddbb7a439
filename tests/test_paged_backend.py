"""The CUDA backend with the paged cache (notebook 03): no allocation per step, a full cache is an error; the runtime
that recycles its arrays. (That the cache changes the work, not the result: tests/test_cache_equality.py.)
"""

import numpy as np
import pytest

from course_lib.gpu.backend import PAGED, CudaBackend
from course_lib.kernels import SIMULATOR
from course_lib.measure.profiler import _without_holds, profile_decode


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


def test_profile_pauses_the_garbage_collector(tiny_one_layer):
    """profile_decode queues its step with Python's garbage collector off (a full collection in a big process can
    outlast a hold) and gives it back as it found it, on or off, even when the step fails."""
    import gc

    backend = CudaBackend(tiny_one_layer, 16, weights="bf16", ops=PAGED)
    backend.prefill([1, 2])
    seen, decode = [], backend.decode

    def watched(token):
        seen.append(gc.isenabled())
        return decode(token)

    backend.decode = watched
    for on in (True, False):
        (gc.enable if on else gc.disable)()
        try:
            step = profile_decode(backend, 3)
            assert gc.isenabled() is on and step.launches > 0
        finally:
            gc.enable()
    assert seen == [False, False]
    backend.decode = lambda token: 1 / 0
    with pytest.raises(ZeroDivisionError):
        profile_decode(backend, 3)
    assert gc.isenabled()


def test_holds_taken_out_of_a_queued_timeline():
    """A queued profile's timeline without its holds: the kernel after each hold (every `every` launches) starts
    where the previous one ended, and everything after it moves by the same amount; durations are unchanged."""
    kernels = [("a", 0.0, 1.0), ("b", 1.5, 2.0), ("c", 50.0, 51.0), ("d", 51.5, 52.0), ("e", 90.0, 90.5)]
    got = _without_holds(kernels, every=2)
    assert got == [("a", 0.0, 1.0), ("b", 1.5, 2.0), ("c", 2.0, 3.0), ("d", 3.5, 4.0), ("e", 4.0, 4.5)]
    assert _without_holds(kernels, every=len(kernels)) == kernels  # no hold inside the step
