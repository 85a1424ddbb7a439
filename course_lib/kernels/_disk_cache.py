"""Kernels compiled once per machine: Numba's on-disk cache, kept in course_lib's cache directory.

Compiling the kernels of a decode step takes seconds of Numba and NVVM before the first token; the cache keeps
each compiled kernel (its cubin and launch metadata) in `$COURSE_LIB_KERNEL_CACHE`, else
`$COURSE_LIB_CACHE/kernels`, else `~/.cache/course_lib/kernels`, so that a second run loads them instead.

Numba stamps a cache entry with the modification time of the one file that defines the kernel, and keys it by
the kernel's bytecode. A kernel also calls device functions defined in other files (the weight readers of
`kernels/__init__.py`, for one): edit one of those and Numba would load a stale kernel. Here every entry is
stamped with a hash of all the source files of `course_lib.kernels` instead, so an edit anywhere recompiles every
kernel once. The stamp is taken when course_lib.kernels is imported, with the code that will be compiled.
Kernels defined elsewhere (in a notebook) are left to Numba as they are.

Each compiled kernel is one file named by a hash of its key (Numba numbers them in the order they arrive, and two
processes filling one cache at once could give one kernel's number to another) and holds its key, checked when it
is loaded. The cache of one checkout of course_lib lives in a directory of its own.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os

from numba.cuda.core.caching import IndexDataCacheFile, _CacheLocator
from numba.cuda.dispatcher import CUDACache, CUDACacheImpl

from ..model.loading import cache_dir as course_lib_cache_dir

KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))


def cache_dir() -> str:
    """Where compiled kernels live: $COURSE_LIB_KERNEL_CACHE, else $COURSE_LIB_CACHE/kernels, else
    ~/.cache/course_lib/kernels."""
    return os.environ.get("COURSE_LIB_KERNEL_CACHE") or os.path.join(course_lib_cache_dir(), "kernels")


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
        checkout = hashlib.sha256(KERNELS_DIR.encode()).hexdigest()[:12]
        self._path = os.path.join(cache_dir(), checkout, os.path.splitext(os.path.basename(py_file))[0])

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
    name, a hash of its bytecode and the names it uses, and, recursively, its own closure; a list or tuple item by
    item; other values as they are. Numba pickles the closure instead, and the pickle of a device function that
    calls an intrinsic (`vector.load16`) carries a random UUID: the kernels of factories (the narrow matmuls,
    flash-decoding) would never be found."""
    py_func = getattr(value, "py_func", None)
    if py_func is not None:
        code = py_func.__code__
        digest = hashlib.sha256(code.co_code + repr(code.co_names).encode()).hexdigest()
        cells = py_func.__closure__ or ()
        return ("function", py_func.__module__, py_func.__qualname__, digest,
                tuple(describe(c.cell_contents) for c in cells))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(describe(v) for v in value))
    return value


_OPTIONS = ("debug", "lineinfo", "fastmath", "opt", "launch_bounds", "lto")  # compile options that change the code


class _KeyedCacheFile(IndexDataCacheFile):
    """Numba's index and data files, each data file named by a hash of its key and holding the key."""

    def save(self, key, data):
        name = self._data_name_pattern.replace("{number:d}", hashlib.sha256(repr(key).encode()).hexdigest()[:20])
        self._save_data(name, (repr(key), data))
        overloads = self._load_index()
        overloads[key] = name
        self._save_index(overloads)

    def load(self, key):
        entry = super().load(key)
        if entry is None or entry[0] != repr(key):  # absent, or written for another key
            return None
        return entry[1]


class KernelsCache(CUDACache):
    _impl_class = _KernelsCacheImpl

    def __init__(self, py_func, options: dict):
        super().__init__(py_func)
        self._options = repr(sorted((k, repr(options.get(k))) for k in _OPTIONS))
        self._cache_file = _KeyedCacheFile(self._cache_path, self._impl.filename_base, source_stamp())

    def _index_key(self, sig, codegen):
        """Numba's key (signature, target, numba-cuda version, (bytecode hash, closure hash), launch config) with
        the closure hashed from `describe`, and the compile options."""
        key = super()._index_key(sig, codegen)
        cells = self._py_func.__closure__ or ()
        closure = repr((tuple(describe(c.cell_contents) for c in cells), self._options))
        return key[:3] + ((key[3][0], hashlib.sha256(closure.encode()).hexdigest()),) + key[4:]


_unwritable = False  # set when the cache directory could not be made: no cache for the rest of the process


def compiled_once(kernel):
    """Give a course_lib kernel (a CUDA dispatcher, not yet launched) the on-disk cache; other kernels, and the
    simulator's fake kernels, are returned untouched. Idempotent, and cheap after the first call for a kernel."""
    global _unwritable
    if getattr(kernel, "_course_lib_checked", False) or _unwritable:
        return kernel
    cache = getattr(kernel, "_cache", None)
    if cache is None:  # the simulator's kernels
        return kernel
    kernel._course_lib_checked = True
    if isinstance(cache, CUDACache) or os.path.dirname(os.path.abspath(inspect.getfile(kernel.py_func))) != KERNELS_DIR:
        return kernel
    try:  # what Dispatcher.enable_caching does, with our locator, key and files
        kernel._cache = KernelsCache(kernel.py_func, kernel.targetoptions)
    except RuntimeError:  # no writable cache directory
        _unwritable = True
    return kernel


source_stamp()  # taken now, with the code this process compiles
