"""Kernels compiled once per machine (course_lib.kernels._disk_cache): a second process loads what the first
compiled, and an edit of any kernel source compiles again. On a GPU only: the simulator compiles nothing."""

import numpy as np
import pytest

from course_lib.kernels import SIMULATOR, compiled_once, cuda

pytestmark = pytest.mark.skipif(SIMULATOR, reason="the simulator compiles nothing to cache")


def fresh(kernel):
    """A new dispatcher of the same Python function: what a new process starts with (nothing compiled)."""
    return compiled_once(cuda.jit(kernel.py_func))


def compile_once(kernel):
    """Compile kernel for (uint32[:], float32[:]) -> (cache hits, cache misses) of that compile."""
    from numba.cuda import types

    sig = (types.Array(types.uint32, 1, "C"), types.Array(types.float32, 1, "C"))
    kernel.compile(sig)
    stats = kernel.stats
    return sum(stats.cache_hits.values()), sum(stats.cache_misses.values())


def test_second_process_loads_what_the_first_compiled(tmp_path, monkeypatch):
    from course_lib.kernels import _disk_cache, copy

    monkeypatch.setenv("COURSE_LIB_KERNEL_CACHE", str(tmp_path))
    assert compile_once(fresh(copy.read_grid_stride)) == (0, 1)
    assert any(p.suffix == ".nbi" for p in tmp_path.rglob("*")), "no index written"
    assert compile_once(fresh(copy.read_grid_stride)) == (1, 0)
    # an edit anywhere in course_lib.kernels (here: a new stamp) invalidates every entry
    monkeypatch.setattr(_disk_cache, "source_stamp", lambda: "edited")
    assert compile_once(fresh(copy.read_grid_stride)) == (0, 1)


def test_cached_kernel_still_computes(tmp_path, monkeypatch):
    from course_lib.kernels import copy

    monkeypatch.setenv("COURSE_LIB_KERNEL_CACHE", str(tmp_path))
    x = np.random.default_rng(0).standard_normal(8 * 1024).astype(np.float32)
    for _ in range(2):  # compiled, then loaded from the cache
        kernel = fresh(copy.read_grid_stride)
        out = cuda.to_device(np.full(64, np.nan, np.float32))
        kernel[8, 8](cuda.to_device(x.view(np.uint32)), out)
        np.testing.assert_allclose(out.copy_to_host().sum(), x.sum(dtype=np.float64), rtol=1e-4)


def test_kernels_outside_course_lib_are_left_alone():
    @cuda.jit
    def local(a):
        a[0] = 1

    assert compiled_once(local)._cache.__class__.__name__ == "NullCache"
