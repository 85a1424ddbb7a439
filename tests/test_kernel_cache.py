"""Kernels compiled once per machine (course_lib.kernels._disk_cache): every process finds the same cache key for
the same kernel, a second process loads what the first compiled, and an edit of any kernel source compiles again.
The keys are checked everywhere (the kernels built for the GPU target, not compiled); the cache itself on a GPU:
the simulator compiles nothing."""

import os
import subprocess
import sys

import numpy as np
import pytest

from course_lib.kernels import SIMULATOR, compiled_once, cuda

on_gpu = pytest.mark.skipif(SIMULATOR, reason="the simulator compiles nothing to cache")

KEYS = """
import hashlib, importlib.util, sys
spec = importlib.util.spec_from_file_location("course_lib.device", "course_lib/device.py")
device = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device)
device.gpu_available = lambda: True  # the kernels of the GPU target, built (not compiled) without a GPU
sys.modules["course_lib.device"] = device
from course_lib.kernels import _disk_cache, elementwise, matmul, narrow, paged_attention
kernels = {**{f"rms_norm {k}": v for k, v in elementwise._RMS_NORM.items()},
           **{f"matmul {k}": v for k, v in matmul._MATMUL.items()},
           **{f"write_rows {k}": v for k, v in paged_attention._WRITE_ROWS.items()}}
for kind in ("f32", "bf16", "f32x8", "bf16x8"):
    for rows in (1, 4):
        kernels[f"split_k {kind} {rows}"] = narrow.kernel_for("split_k", kind, rows)
        kernels[f"split_k add {kind} {rows}"] = narrow.kernel_for("split_k", kind, rows, "f32", True)
        kernels[f"transposed {kind} {rows}"] = narrow.kernel_for("transposed", kind, rows)
for name, kernel in kernels.items():
    closure = repr(tuple(_disk_cache.describe(c.cell_contents) for c in kernel.py_func.__closure__ or ()))
    print(name, "|", kernel.py_func.__qualname__, hashlib.sha256(closure.encode()).hexdigest())
"""


def closure_keys() -> dict[str, str]:
    """{kernel: its qualified name and closure hash}, computed in a fresh process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", KEYS], cwd=root, env=env, capture_output=True, text=True, check=True)
    return dict(line.split(" | ") for line in out.stdout.splitlines())


FILES = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("course_lib.device", "course_lib/device.py")
device = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device)
device.gpu_available = lambda: True
sys.modules["course_lib.device"] = device
from course_lib.kernels import _disk_cache
path, base = sys.argv[1], "kernel-12.py311"
first, second = (_disk_cache._KeyedCacheFile(path, base, "stamp") for _ in range(2))
first.save(("sig a",), "cubin a")
second.save(("sig b",), "cubin b")  # another process: its file has a name of its own
print(first.load(("sig a",)), "|", first.load(("sig b",)), "|", first.load(("sig c",)))
index = first._load_index()
index[("sig a",)] = index[("sig b",)]  # an index pointing at another kernel's file
first._save_index(index)
print(first.load(("sig a",)), "|", _disk_cache._KeyedCacheFile(path, base, "edited").load(("sig b",)))
import os
os.environ["COURSE_LIB_KERNEL_CACHE"] = path
from numba.cuda import types
from course_lib.kernels import copy, cuda
class Codegen:  # stands for the GPU's code generator: its magic tuple names the target
    def magic_tuple(self):
        return ("nvptx64-nvidia-cuda", "sm_90", "")
kernel = _disk_cache.compiled_once(cuda.jit(copy.read_grid_stride.py_func))
cache = kernel._cache
sig = (types.Array(types.uint32, 1, "C"), types.Array(types.float32, 1, "C"))
key = cache._index_key(sig, Codegen())
cache._cache_file.save(key, "the cubin")
other = cache._index_key(sig[::-1], Codegen())
print(type(cache).__name__, cache._cache_file.load(key), "|", cache._cache_file.load(other))
print(_disk_cache.compiled_once(kernel) is kernel and kernel._cache is cache)
"""


def test_each_compiled_kernel_has_a_file_of_its_own(tmp_path):
    """Files named by their key and holding it: a kernel is never loaded from another kernel's file, and an edit
    of the sources (a new stamp) finds nothing; a course kernel gets the cache, once (built for the GPU target
    without a GPU: the compiled code is stood in for by a string)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", FILES, str(tmp_path)], cwd=root, env=env, capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out == ["cubin a | cubin b | None", "None | None", "KernelsCache the cubin | None", "True"]


def test_cache_keys_are_the_same_in_every_process():
    """Numba's own key pickles the closure, and a device function that calls an intrinsic pickles with a random
    UUID: the narrow matmuls would be compiled again by every process. describe() names device functions instead;
    kernels of one factory with different closures still get different keys."""
    first, second = closure_keys(), closure_keys()
    assert first == second
    assert len(set(first.values())) == len(first)  # no two kernels share a key


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


@on_gpu
def test_a_fresh_dispatcher_loads_what_another_compiled(tmp_path, monkeypatch):
    from course_lib.kernels import _disk_cache, copy

    monkeypatch.setenv("COURSE_LIB_KERNEL_CACHE", str(tmp_path))
    assert compile_once(fresh(copy.read_grid_stride)) == (0, 1)
    assert any(p.suffix == ".nbi" for p in tmp_path.rglob("*")), "no index written"
    assert compile_once(fresh(copy.read_grid_stride)) == (1, 0)
    # an edit anywhere in course_lib.kernels (here: a new stamp) invalidates every entry
    monkeypatch.setattr(_disk_cache, "source_stamp", lambda: "edited")
    assert compile_once(fresh(copy.read_grid_stride)) == (0, 1)


@on_gpu
def test_cached_kernel_still_computes(tmp_path, monkeypatch):
    from course_lib.kernels import copy

    monkeypatch.setenv("COURSE_LIB_KERNEL_CACHE", str(tmp_path))
    x = np.random.default_rng(0).standard_normal(8 * 1024).astype(np.float32)
    for _ in range(2):  # compiled, then loaded from the cache
        kernel = fresh(copy.read_grid_stride)
        out = cuda.to_device(np.full(64, np.nan, np.float32))
        kernel[8, 8](cuda.to_device(x.view(np.uint32)), out)
        np.testing.assert_allclose(out.copy_to_host().sum(), x.sum(dtype=np.float64), rtol=1e-4)


@on_gpu
def test_kernels_outside_course_lib_are_left_alone():
    @cuda.jit
    def local(a):
        a[0] = 1

    assert compiled_once(local)._cache.__class__.__name__ == "NullCache"
