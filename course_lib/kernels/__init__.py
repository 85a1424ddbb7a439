"""Numba CUDA kernels, one module per topic.

Import order matters: the simulator must be chosen (no GPU) before `numba.cuda` is first imported, so every
kernel module takes `cuda` from here (`from course_lib.kernels import cuda`) and writes `cuda.x` in kernels
(the simulator swaps the `cuda` global for a fake module while a kernel runs).

Weights are stored either as float32 or as bf16 bit patterns (uint16). A kernel that reads weights is written
once, as a factory taking the device function that turns one stored weight into float32, and compiled for both
storage types by `for_weight_dtypes`; `pick` chooses the specialization for an array.

Host wrappers launch on `stream`, or through `rt` when given (a `course_lib.gpu.runtime.Runtime`, which counts
allocations and launches and can profile them): see `launch` and `empty`.
"""

import functools
import os
import weakref

import numpy as np

from course_lib import device as _device

_device.ensure_simulator_if_no_gpu()

from numba import cuda, int32, uint32  # noqa: E402  (after the simulator has been chosen)
from numba.cuda.core import config as _config  # noqa: E402

# Small grids are the point of the baseline (one row per token): Numba's occupancy warning is expected.
_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0

SIMULATOR = bool(cuda.config.ENABLE_CUDASIM) or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
if SIMULATOR:
    from . import _sim

    _sim.install()

    def compiled_once(kernel):
        """The simulator interprets kernels: nothing to compile, nothing to cache."""
        return kernel
else:
    from ._disk_cache import compiled_once  # kernels compiled once per machine, kept on disk


SIM_SMS = 4  # "SMs" of the simulator, for the kernels that size their grid by the SM count (few blocks: it is slow)


@functools.cache
def sm_count(simulated: int = SIM_SMS) -> int:
    """SMs of the current GPU (`simulated` in the simulator)."""
    return simulated if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


def sized(gpu: int, simulator: int) -> int:
    """A block dimension: `gpu` on a GPU, the smaller `simulator` in the simulator, where every CUDA thread is a
    Python thread and every barrier a Python barrier (the same code runs; only the launch geometry shrinks)."""
    return simulator if SIMULATOR else gpu


@cuda.jit(device=True)
def f32_weight(w):
    """A weight stored as float32: already float32."""
    return w


@cuda.jit(device=True)
def bf16_weight(bits):
    """A weight stored as bf16 bits (uint16): bf16 is the top half of a float32, so shift and reinterpret."""
    return cuda.libdevice.int_as_float(uint32(bits) << uint32(16))


WEIGHT_READERS = {np.dtype(np.float32): f32_weight, np.dtype(np.uint16): bf16_weight}


def for_weight_dtypes(make_kernel):
    """{weight dtype: kernel}, each built by make_kernel(to_f32) with that dtype's weight reader."""
    return {dtype: make_kernel(to_f32) for dtype, to_f32 in WEIGHT_READERS.items()}


def pick(kernels: dict, w):
    """The kernel of `kernels` (from for_weight_dtypes) for the storage dtype of weight array w."""
    try:
        return kernels[np.dtype(w.dtype)]
    except KeyError:
        raise TypeError(f"weights must be float32 or bf16 stored as uint16, got {w.dtype}") from None


@cuda.jit(device=True)
def last_to_arrive(counters, i, count):
    """True in the last of the `count` blocks that call this with counter i, False in the others; every thread of
    a block calls, after writing what the last block will read. Each block makes its writes visible to the whole
    GPU (threadfence) before one of its threads counts it (an atomic add on counters[i]); the block that brings the
    count to `count` has every other block's writes to read, and resets counters[i] to 0 for the next launch. The
    atomic only elects a block: what the last block computes never depends on the order of arrival."""
    last = cuda.shared.array(1, dtype=int32)
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        last[0] = cuda.atomic.add(counters, i, 1) == count - 1
    cuda.syncthreads()
    if last[0]:
        cuda.threadfence()  # and the last block sees them: no line of another block's writes read stale
        if cuda.threadIdx.x == 0:
            counters[i] = 0  # every block has counted itself
    return last[0] != 0


_counters = None  # the completion counters of the launches made one by one: zero between launches


def completion_counters(n: int):
    """An int32 device array of at least n zeros for a launch's `last_to_arrive` counters, kept for every such
    launch of the process (one stream at a time: two kernels running concurrently would share it); each launch's
    last blocks leave their counters at zero."""
    global _counters
    if _counters is None or _counters.size < n:
        _counters = cuda.to_device(np.zeros(max(n, 4096), np.int32))
    return _counters


def launch(kernel, grid, block, stream, rt, *args):
    """kernel[grid, block, stream](*args), or rt.launch(name, kernel, grid, block, *args) when a Runtime is given."""
    if rt is None:
        compiled_once(kernel)[grid, block, stream](*args)
    else:
        rt.launch(kernel.py_func.__name__, kernel, grid, block, *args)


_VIEWS = {}  # (id(array), what) -> (weak reference to the array, its view), dropped when the array dies


def cached_view(arr, what, make):
    """make(arr), a view of device array arr, made once per (arr, what) and kept while arr lives. Making a Numba
    device-array view costs about 25 us of host time on the H200, and a decode step needs hundreds: of the weights
    and KV tables at every launch, of the recycled activations of the paged step at every pass."""
    key = (id(arr), what)
    entry = _VIEWS.get(key)
    if entry is None or entry[0]() is not arr:
        entry = _VIEWS[key] = (weakref.ref(arr, lambda _: _VIEWS.pop(key, None)), make(arr))
    return entry[1]


def reshaped(arr, *shape):
    """arr.reshape(*shape), made once per array and shape (see cached_view)."""
    return cached_view(arr, shape, lambda a: a.reshape(*shape))


def empty(shape, dtype=np.float32, stream=0, rt=None, name=None):
    """A new device array (from rt.empty, which counts it, when a Runtime is given: its buffer `name`, if named)."""
    return cuda.device_array(shape, dtype, stream=stream) if rt is None else rt.empty(shape, dtype, name=name)


__all__ = ["SIMULATOR", "WEIGHT_READERS", "bf16_weight", "cached_view", "compiled_once", "completion_counters", "cuda",
           "empty", "f32_weight", "for_weight_dtypes", "last_to_arrive", "launch", "pick", "reshaped", "sized"]
