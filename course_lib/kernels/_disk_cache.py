"""Kernels compiled once per machine: Numba's on-disk cache, kept in course_lib's cache directory.

Compiling the kernels of a decode step takes seconds of Numba and NVVM before the first token; the cache keeps
each compiled kernel (its cubin and launch metadata) in `$COURSE_LIB_KERNEL_CACHE`, else
`$COURSE_LIB_CACHE/kernels`, else `~/.cache/course_lib/kernels`, so that a second run loads them instead.

Numba stamps a cache entry with the modification time of the one file that defines the kernel, and keys it by
the kernel's bytecode. A kernel also calls device functions defined in other files (the weight readers of
`kernels/__init__.py`, for one): edit one of those and Numba would load a stale kernel. Here every entry is
stamped with a hash of all the source files of `course_lib.kernels` instead, so an edit anywhere recompiles every
kernel once. Kernels defined elsewhere (in a notebook) are left to Numba as they are.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os

from numba.cuda.core.caching import _CacheLocator
from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))


def cache_dir() -> str:
    """Where compiled kernels live: $COURSE_LIB_KERNEL_CACHE, else $COURSE_LIB_CACHE/kernels, else
    ~/.cache/course_lib/kernels."""
    if os.environ.get("COURSE_LIB_KERNEL_CACHE"):
        return os.environ["COURSE_LIB_KERNEL_CACHE"]
    root = os.environ.get("COURSE_LIB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "course_lib")
    return os.path.join(root, "kernels")


@functools.cache
def source_stamp() -> str:
    """SHA-256 of every source file of course_lib.kernels (names and contents, in name order)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(KERNELS_DIR)):
        if name.endswith(".py"):
            h.update(name.encode())
            with open(os.path.join(KERNELS_DIR, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


class _KernelsLocator(_CacheLocator):
    """Cache entries of one kernel file under cache_dir(), stamped with the hash of all kernel sources."""

    def __init__(self, py_func, py_file):
        self._lineno = py_func.__code__.co_firstlineno
        self._path = os.path.join(cache_dir(), os.path.splitext(os.path.basename(py_file))[0])

    def get_cache_path(self):
        return self._path

    def get_source_stamp(self):
        return source_stamp()

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        locator = cls(py_func, py_file)
        try:
            locator.ensure_cache_path()
        except OSError:  # not writable: compile every run, as without a cache
            return None
        return locator


class _KernelsCacheImpl(CUDACacheImpl):
    _locator_classes = [_KernelsLocator]


def describe(value):
    """A description of a kernel's closure variable that is the same in every process: a device function by its
    name and, recursively, its own closure (its code is in source_stamp); other values as they are. Numba
    pickles the closure instead, and the pickle of a device function that calls an intrinsic (`vector.load16`)
    carries a random UUID: the kernels of factories (the narrow matmuls, flash-decoding) would never be found."""
    py_func = getattr(value, "py_func", None)
    if py_func is not None:
        cells = py_func.__closure__ or ()
        return (py_func.__module__, py_func.__qualname__, tuple(describe(c.cell_contents) for c in cells))
    if isinstance(value, (tuple, list)):
        return tuple(describe(v) for v in value)
    return value


class KernelsCache(CUDACache):
    _impl_class = _KernelsCacheImpl

    def _index_key(self, sig, codegen):
        """Numba's key (signature, target, numba-cuda version, (bytecode hash, closure hash), launch config) with
        the closure hashed from `describe`."""
        key = super()._index_key(sig, codegen)
        cells = self._py_func.__closure__ or ()
        closure = repr(tuple(describe(c.cell_contents) for c in cells))
        return key[:3] + ((key[3][0], hashlib.sha256(closure.encode()).hexdigest()),) + key[4:]


def compiled_once(kernel):
    """Give a course_lib kernel (a CUDA dispatcher, not yet launched) the on-disk cache; other kernels, and the
    simulator's fake kernels, are returned untouched. Idempotent."""
    cache = getattr(kernel, "_cache", None)
    if cache is None or isinstance(cache, CUDACache):  # the simulator, or already cached
        return kernel
    if os.path.dirname(os.path.abspath(inspect.getfile(kernel.py_func))) != KERNELS_DIR:
        return kernel
    try:
        kernel._cache = KernelsCache(kernel.py_func)  # what Dispatcher.enable_caching does, with our locator
    except RuntimeError:  # no writable cache directory
        pass
    return kernel
