"""What Numba's CUDA simulator lacks and the course's kernels use, and a faster way to run its blocks.

The simulator hands each kernel a fake `cuda` module (an instance of `FakeCUDAModule`). `install()` adds the missing
functions to that class, once:

- `shfl_down_sync`, `shfl_up_sync`, `shfl_xor_sync`, `shfl_sync`: the lanes of a warp (32 consecutive threads
  of the block) publish their value and meet at a barrier, then read the source lane's. As on the GPU, a source
  lane outside the warp leaves the value unchanged. The mask is ignored: every existing lane of the warp must make
  the call (the kernels only use full warps).
- `syncwarp`: a barrier for the warp's lanes.
- `libdevice.int_as_float` and `libdevice.float_as_int`: reinterpret 32 bits.
- `nanosleep`: a lane that polls gives the others their turn (the megakernel's counters).

It also replaces how a block runs. The stock simulator makes every CUDA thread a Python thread, and its barriers
hand the interpreter lock from thread to thread through the operating system: about 1 ms for 32 lanes to meet, and
the course's kernels meet at every warp reduction. Here a block's threads are greenlets (coroutines of one Python
thread, the `greenlet` package): a lane runs until it waits (syncthreads, a warp barrier, nanosleep) and hands over
to the block's scheduler, which resumes the lanes that can go on, in lane order. A switch costs about a
microsecond, and the order is the same from run to run. The semantics are the simulator's: threads released together
at syncthreads when every live one waits there; a warp's lanes released when all have reached its barrier.

An exchange costs one barrier (the values are double-buffered: a lane can only overwrite a buffer after a second
barrier, which every lane reaches after reading it), and `segment_reduce` gives the course's warp reductions
(`elementwise.segment_sum`, `segment_max`) a twin that exchanges once and then computes the butterfly: the same
operations on the same operands in the same order, so the same bits, for one barrier instead of log2(width).

The simulator runs a kernel's blocks one after another. A kernel marked `blocks_together` (the megakernel, whose
blocks wait on each other's counters: run one after another, the first to wait would wait forever) runs all of its
blocks at once, their threads interleaved, each block with its own shared memory.

A block whose live lanes all wait and cannot be released (a lane returned early or waits at `syncthreads` while
the others wait at a warp barrier: a deadlock on the GPU) fails at once with `BrokenBarrierError`, naming the lanes.
"""

from __future__ import annotations

import threading
import types

import greenlet
import numpy as np
from numba.cuda.simulator.kernel import BlockManager, BlockThread, _get_kernel_context
from numba.cuda.simulator.kernelapi import Dim3, FakeCUDAShared

WARP_SIZE = 32


class _Thread:
    """A CUDA thread of the block being run: its greenlet, and what the simulator's `cuda` module asks of
    `threading.current_thread()` (threadIdx, blockIdx, syncthreads, ...). `waiting`: None while it can run, else
    what it waits at ("syncthreads", a warp's _Barrier, or "its turn" after nanosleep)."""

    def __init__(self, manager, grid_point, point, run):
        self._manager = manager
        self.blockIdx, self.threadIdx = Dim3(*grid_point), Dim3(*point)
        x, y, _ = manager._block_dim
        self.thread_id = point[0] + x * (point[1] + y * point[2])
        self.waiting = None
        self.glet = greenlet.greenlet(run)
        self.glet.cuda_thread = self

    def wait(self, what):
        """Hand over to the block's scheduler until it resumes this thread (once `what` is over)."""
        self.waiting = what
        self.glet.parent.switch()

    def syncthreads(self):
        self.wait("syncthreads")

    # the block votes, as the simulator's threads cast them (through syncthreads above)
    syncthreads_count, syncthreads_and, syncthreads_or = (
        BlockThread.syncthreads_count, BlockThread.syncthreads_and, BlockThread.syncthreads_or)

    def __str__(self):
        return f"Thread <<<{self.blockIdx}, {self.threadIdx}>>>"


def _current() -> _Thread:
    """The CUDA thread running now (the greenlet's), else the Python thread (outside a kernel)."""
    return getattr(greenlet.getcurrent(), "cuda_thread", None) or threading.current_thread()


class _Barrier:
    """A warp's barrier: the last of its n lanes to arrive releases the others."""

    def __init__(self, n: int):
        self.n, self.arrived = n, []

    def wait(self):
        me = _current()
        if len(self.arrived) == self.n - 1:
            for thread in self.arrived:
                thread.waiting = None
            self.arrived = []
            return
        self.arrived.append(me)
        me.wait(self)


class _Warp:
    """The lanes of one warp of one block: a barrier and two buffers of a slot per lane (used in turn)."""

    def __init__(self, n_lanes: int):
        self.n_lanes = n_lanes
        self.barrier = _Barrier(n_lanes)
        self.buffers = ([None] * n_lanes, [None] * n_lanes)
        self.turn = [0] * n_lanes  # per lane: the buffer of its next exchange


def _my_warp() -> tuple[_Warp, int]:
    """(the calling thread's warp, its lane). Warps are kept on the block's manager, which lives for one block."""
    thread = _current()
    warp_id, lane = divmod(thread.thread_id, WARP_SIZE)
    block = thread._manager
    warps = block.__dict__.setdefault("_course_lib_warps", {})
    warp = warps.get(warp_id)
    if warp is None:
        n_threads = int(np.prod(block._block_dim))
        warp = warps[warp_id] = _Warp(min(WARP_SIZE, n_threads - warp_id * WARP_SIZE))
    return warp, lane


def _published(value) -> tuple[list, int, int]:
    """Publish this lane's value and wait for the warp's: (the warp's values, this lane, the warp's lane count).
    The list stays valid until this lane's next exchange but one (no lane can write it again before every lane
    has passed the next barrier, after reading)."""
    warp, lane = _my_warp()
    values = warp.buffers[warp.turn[lane]]
    warp.turn[lane] ^= 1
    values[lane] = value
    warp.barrier.wait()
    return values, lane, warp.n_lanes


def _exchange(value, source_lane):
    """Every lane publishes `value` and gets the value of lane source_lane(lane) (its own if out of range)."""
    values, lane, n_lanes = _published(value)
    src = source_lane(lane)
    return values[src] if 0 <= src < n_lanes else value


def segment_reduce(op):
    """The simulator's twin of a butterfly reduction over aligned segments of `width` lanes (offsets width / 2,
    ..., 1, each lane combining op(its value, the value of lane ^ offset)): one exchange, then each lane evaluates
    its own tree of the butterfly, with the same operands in the same order."""

    def reduce(v, width):
        values, lane, _ = _published(v)

        def after(of_lane, offset):  # the value of lane of_lane once the offsets width / 2 .. offset are done
            if offset >= width:
                return values[of_lane]
            return op(after(of_lane, 2 * offset), after(of_lane ^ offset, 2 * offset))

        return after(lane, 1)

    return reduce


def _shfl_sync(self, mask, value, src_lane):
    return _exchange(value, lambda lane: int(src_lane) % WARP_SIZE)


def _shfl_down_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane + int(delta))


def _shfl_up_sync(self, mask, value, delta):
    return _exchange(value, lambda lane: lane - int(delta))


def _shfl_xor_sync(self, mask, value, lane_mask):
    return _exchange(value, lambda lane: lane ^ int(lane_mask))


def _syncwarp(self, mask=0xFFFFFFFF):
    warp, _ = _my_warp()
    warp.barrier.wait()


class _LibDevice:
    """The few libdevice functions the kernels call, with the GPU's bit-level meaning."""

    @staticmethod
    def int_as_float(i):
        return np.array(int(i) & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]

    @staticmethod
    def float_as_int(f):
        return np.array(f, dtype=np.float32).view(np.int32)[()]


_POLYFILLS = {
    "shfl_sync": _shfl_sync,
    "shfl_down_sync": _shfl_down_sync,
    "shfl_up_sync": _shfl_up_sync,
    "shfl_xor_sync": _shfl_xor_sync,
    "syncwarp": _syncwarp,
    "libdevice": property(lambda self: _LibDevice),
    "nanosleep": lambda self, ns: _current().wait("its turn"),  # the GPU's is a hint: here the others' turn
}


def blocks_together(kernel):
    """Mark a kernel whose blocks wait for one another (the megakernel's counters and grid barriers): its launches run
    every block at once, their threads interleaved, each block with its own shared memory. Run one after another, as
    the simulator runs blocks, the first block to wait for a later one would wait forever. Returns the kernel."""
    kernel.fn.course_lib_blocks_together = True
    return kernel


def _run_block(self, grid_point, *args):
    """BlockManager.run: the block's threads as greenlets (_run_threads). For a kernel marked `blocks_together`, the
    launch's first block runs them all and the others return at once."""
    if not getattr(self._f, "course_lib_blocks_together", False):
        return _run_threads([_Thread(self, grid_point, point, lambda: self._f(*args))
                             for point in np.ndindex(*self._block_dim)])
    launch = _get_kernel_context()  # this launch's fake `cuda` module
    if getattr(launch, "course_lib_ran", False):
        return None
    launch.course_lib_ran = True
    threads = []
    for block in np.ndindex(*self._grid_dim):
        manager = self if block == tuple(grid_point) else BlockManager(self._f, self._grid_dim, self._block_dim,
                                                                       self._debug)
        manager.course_lib_shared = FakeCUDAShared(launch.shared._dynshared_size)
        threads += [_Thread(manager, block, point, lambda: self._f(*args)) for point in np.ndindex(*self._block_dim)]
    return _run_threads(threads)


def _run_threads(threads):
    """Resume the threads in order while they can run; release a block's threads together when every live one of
    them waits at syncthreads. The first exception is raised as the simulator raises it (naming the thread); threads
    that all wait while none can be released are a deadlock."""
    live = threads
    while live:
        for thread in live:
            if thread.waiting == "its turn":
                thread.waiting = None
            if thread.waiting is None:
                try:
                    thread.glet.switch()
                except Exception as e:
                    where = f"tid={list(thread.threadIdx)} ctaid={list(thread.blockIdx)}"
                    raise type(e)(f"{where}: {e}" if str(e) else where).with_traceback(e.__traceback__) from None
        live = [t for t in live if not t.glet.dead]
        blocks = {}
        for t in live:
            blocks.setdefault(id(t._manager), []).append(t)
        released = False
        for block in blocks.values():
            if all(t.waiting == "syncthreads" for t in block):
                for t in block:
                    t.waiting = None
                released = True
        if not released and live and all(t.waiting is not None and t.waiting != "its turn" for t in live):
            stuck = ", ".join(f"{list(t.blockIdx)} {list(t.threadIdx)} at "
                              f"{t.waiting if isinstance(t.waiting, str) else 'a warp barrier'}" for t in live[:4])
            raise threading.BrokenBarrierError("every live thread waits and none can go on (a thread left early, or "
                                               f"waits at another barrier): {stuck}, ...")


def _shared(self):
    """FakeCUDAModule.shared: the block's own shared memory in a launch of blocks together, else the launch's."""
    return getattr(getattr(_current(), "_manager", None), "course_lib_shared", None) or self._shared


class _Threading(types.ModuleType):
    """The `threading` the simulator's `cuda` module sees: current_thread() is the CUDA thread running now."""

    def __getattr__(self, name):
        return getattr(threading, name)

    @staticmethod
    def current_thread():
        return _current()


def install() -> None:
    """Add the polyfills to the simulator's fake `cuda` module (only those it lacks) and install the faster
    block scheduler; safe to call again."""
    from numba.cuda.simulator import kernel, kernelapi
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    for name, value in _POLYFILLS.items():
        if not hasattr(FakeCUDAModule, name):
            setattr(FakeCUDAModule, name, value)
    if kernel.BlockManager.run is not _run_block:
        kernel.BlockManager.run = _run_block
        kernelapi.threading = _Threading("threading")
        FakeCUDAModule.shared = property(_shared)


def installed() -> bool:
    """True when every polyfilled name is present on the simulator's fake `cuda` module."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    return all(hasattr(FakeCUDAModule, name) for name in _POLYFILLS)
