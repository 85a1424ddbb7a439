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

    blocks_together = _sim.blocks_together  # its blocks run at once, interleaved (they wait for one another)
else:
    from ._disk_cache import compiled_once  # kernels compiled once per machine, kept on disk

    def blocks_together(kernel):
        """On a GPU a kernel's blocks run at once already (the simulator's runs them one after another)."""
        return kernel


SIM_SMS = 4  # "SMs" of the simulator, for the kernels that size their grid by the SM count (few blocks: it is slow)


@functools.cache
def sm_count(simulated: int = SIM_SMS) -> int:
    """SMs of the current GPU (`simulated` in the simulator)."""
    return simulated if SIMULATOR else cuda.get_current_device().MULTIPROCESSOR_COUNT


def sized(gpu: int, simulator: int) -> int:
    """A block dimension: `gpu` on a GPU, the smaller `simulator` in the simulator, where every CUDA thread is
    interpreted in Python and every barrier hands over to the others (the same code runs; only the launch geometry
    shrinks)."""
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


if SIMULATOR:
    def gpu_fence():
        """The simulator's threads share one coherent memory: there is nothing to order."""

    def load_acquire(counters, i):
        """counters[i] (the simulator's memory is coherent: a plain read)."""
        return counters[i]

    def add_release(counters, i, value):
        """counters[i] += value (in the simulator only thread 0 of a block, and one block at a time, counts)."""
        counters[i] += value
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    def ptx_statement(ptx, emitted=lambda: True):
        """An intrinsic of no arguments that emits one PTX statement (in the kernels compiled while emitted() is
        true: nothing otherwise), never moved across memory accesses."""

        def typer(typingctx):
            def codegen(context, builder, signature, args):
                if emitted():
                    asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), ptx, "~{memory}", side_effect=True)
                    builder.call(asm, [])
                return context.get_dummy_value()

            return types.void(), codegen

        return intrinsic(typer)

    # gpu_fence(): the calling thread's memory operations before it are seen by the whole GPU before those after it
    # (a release), and what other threads released before what it read is seen by its reads after it (an acquire).
    # cuda.threadfence() is the stronger sequentially consistent fence (fence.sc.gpu: MEMBAR.SC.GPU in sm_90's SASS,
    # where this one is MEMBAR.ALL.GPU; both then invalidate the SM's L1 cache): a counter handed from block to
    # block needs only acquire and release.
    gpu_fence = ptx_statement("fence.acq_rel.gpu;")

    def _counter_address(context, builder, signature, args):
        """The address of counters[i] (args[0], args[1]) as a 64-bit integer."""
        array = context.make_array(signature.args[0])(context, builder, value=args[0])
        i = context.cast(builder, args[1], signature.args[1], types.intp)
        return builder.add(builder.ptrtoint(array.data, ir.IntType(64)), builder.mul(i, ir.Constant(ir.IntType(64), 4)))

    def _int32_counter(arr, i) -> bool:
        """arr is a contiguous 1-D int32 array and i an integer: element i is 4 i bytes past its start."""
        return (isinstance(arr, types.Array) and arr.dtype == types.int32 and arr.ndim == 1 and arr.layout == "C"
                and isinstance(i, types.Integer))

    @intrinsic
    def load_acquire(typingctx, counters, i):
        """counters[i] read with acquire semantics at GPU scope (PTX ld.acquire.gpu: from the L2 cache, and what the
        thread reads after it is seen after what other threads released before the value it read)."""
        if not _int32_counter(counters, i):
            return None

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.IntType(64)]), "ld.acquire.gpu.s32 $0, [$1];",
                               "=r,l,~{memory}", side_effect=True)
            return builder.call(asm, [_counter_address(context, builder, signature, args)])

        return types.int32(counters, i), codegen

    @intrinsic
    def add_release(typingctx, counters, i, value):
        """counters[i] += value with release semantics at GPU scope (PTX red.release.gpu: the thread's writes, and
        those ordered before it by a block barrier, are seen before the new count), no value returned."""
        if not (_int32_counter(counters, i) and isinstance(value, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            v = context.cast(builder, args[2], signature.args[2], types.int32)
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64), ir.IntType(32)]),
                               "red.release.gpu.add.s32 [$0], $1;", "l,r,~{memory}", side_effect=True)
            builder.call(asm, [_counter_address(context, builder, signature, args), v])
            return context.get_dummy_value()

        return types.void(counters, i, value), codegen


@cuda.jit(device=True)
def last_to_arrive(counters, i, count):
    """True in the last of the `count` blocks that call this with counter i, False in the others; every thread of
    a block calls, after writing what the last block will read. The block barrier orders its threads' writes before
    thread 0's fence, which releases them to the whole GPU before it counts the block (an atomic add on
    counters[i]); the block that brings the count to `count` fences again (an acquire: every other block's writes
    are seen by its threads after the next block barrier) and resets counters[i] to 0 for the next launch. The
    atomic only elects a block: what the last block computes never depends on the order of arrival. (The pattern
    of CUDA's own grid synchronisation: one thread fences for its block.)"""
    last = cuda.shared.array(1, dtype=int32)
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        gpu_fence()
        is_last = cuda.atomic.add(counters, i, 1) == count - 1
        if is_last:
            gpu_fence()
            counters[i] = 0  # every block has counted itself
        last[0] = is_last
    cuda.syncthreads()
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


__all__ = ["SIMULATOR", "WEIGHT_READERS", "add_release", "bf16_weight", "cached_view", "compiled_once",
           "completion_counters", "cuda", "empty", "f32_weight", "for_weight_dtypes", "gpu_fence", "last_to_arrive",
           "launch", "load_acquire", "pick", "reshaped", "sized"]
