"""What Numba's CUDA simulator lacks and the course's kernels use: warp shuffles, syncwarp, libdevice.

The simulator runs every CUDA thread of a block as a Python thread and hands each kernel a fake `cuda` module
(an instance of `FakeCUDAModule`). `install()` adds the missing functions to that class, once:

- `shfl_down_sync`, `shfl_up_sync`, `shfl_xor_sync`, `shfl_sync`: the lanes of a warp (32 consecutive threads
  of the block) publish their value and meet at a barrier, then read the source lane's. As on the GPU, a source
  lane outside the warp leaves the value unchanged. The mask is ignored: every existing lane of the warp must make
  the call (the kernels only use full warps).
- `syncwarp`: a barrier for the warp's lanes.
- `libdevice.int_as_float` and `libdevice.float_as_int`: reinterpret 32 bits.
- `nanosleep`: a real sleep (used by the `hold` kernel of the benchmarks).

The barriers are the simulator's slowest part (32 Python threads handing the interpreter lock round, ~1 ms per
exchange of a warp), so an exchange costs one barrier (the values are double-buffered: a lane can only overwrite a
buffer after a second barrier, which every lane reaches after reading it), and `segment_reduce` gives the
course's warp reductions (`elementwise.segment_sum`, `segment_max`) a twin that exchanges once and then computes,
in each lane, its own butterfly: the same operations on the same operands in the same order, so the same bits,
for one barrier instead of log2(width).

A lane that never arrives (it returned early, or waits at `syncthreads`) breaks the barrier after
`BARRIER_TIMEOUT_S` and the kernel fails with `BrokenBarrierError` instead of hanging.

It also replaces the simulator's block scheduler. The stock one polls its threads in a busy loop to find out
when all of them wait at `syncthreads`, and that loop competes for the GIL with the threads doing the work
(a 16-thread matmul block took ~0.9 s). Here the threads tell the scheduler through a condition variable
when they block or finish, and it sleeps in between: the same semantics, 4 to 10 times faster.
"""

from __future__ import annotations

import threading
import time

import numpy as np

WARP_SIZE = 32
BARRIER_TIMEOUT_S = 60.0


class _Warp:
    """The lanes of one warp of one block: a barrier and two buffers of a slot per lane (used in turn)."""

    def __init__(self, n_lanes: int):
        self.n_lanes = n_lanes
        self.barrier = threading.Barrier(n_lanes, timeout=BARRIER_TIMEOUT_S)
        self.buffers = ([None] * n_lanes, [None] * n_lanes)
        self.turn = [0] * n_lanes  # per lane: the buffer of its next exchange


_registry_lock = threading.Lock()


def _my_warp() -> tuple[_Warp, int]:
    """(the calling thread's warp, its lane). Warps are kept on the block's manager, which lives for one block."""
    thread = threading.current_thread()
    warp_id, lane = divmod(thread.thread_id, WARP_SIZE)
    block = thread._manager
    with _registry_lock:
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
    "nanosleep": lambda self, ns: time.sleep(ns * 1e-9),  # the GPU's is a hint; here a real sleep
}


def _run_block(self, grid_point, *args):
    """BlockManager.run: start the block's threads; release them together when all live ones wait at
    syncthreads; re-raise the first exception; return when all have finished."""
    from numba.cuda.simulator.kernel import BlockThread

    wake = threading.Condition()
    threads = [BlockThread(lambda: self._f(*args), self, grid_point, point, self._debug)
               for point in np.ndindex(*self._block_dim)]
    for t in threads:
        t.wake = wake
        t.start()
    live = threads
    with wake:
        while live:
            failed = next((t for t in threads if t.exception), None)
            if failed is not None:
                for t in threads:
                    t.abort, t.syncthreads_blocked = True, False
                    t.syncthreads_event.set()
                raise failed.exception[0].with_traceback(failed.exception[1])
            live = [t for t in live if t.is_alive()]
            if live and all(t.syncthreads_blocked for t in live):
                for t in live:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
            elif live:
                wake.wait(0.05)  # woken by a thread that blocks or ends; the timeout is only a safety net
    for t in threads:
        t.join()
        if t.exception:
            raise t.exception[0].with_traceback(t.exception[1])


def _syncthreads(self):
    """BlockThread.syncthreads: mark this thread blocked, wake the scheduler, wait to be released."""
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    with self.wake:
        self.syncthreads_blocked = True
        self.wake.notify()
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _thread_body(original_run):
    def run(self):
        """BlockThread.run, then wake the scheduler: this thread has ended."""
        try:
            original_run(self)
        finally:
            with self.wake:
                self.wake.notify()

    return run


def install() -> None:
    """Add the polyfills to the simulator's fake `cuda` module (only those it lacks) and install the faster
    block scheduler; safe to call again."""
    from numba.cuda.simulator import kernel
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    for name, value in _POLYFILLS.items():
        if not hasattr(FakeCUDAModule, name):
            setattr(FakeCUDAModule, name, value)
    if kernel.BlockManager.run is not _run_block:
        kernel.BlockThread.run = _thread_body(kernel.BlockThread.run)
        kernel.BlockThread.syncthreads = _syncthreads
        kernel.BlockManager.run = _run_block


def installed() -> bool:
    """True when every polyfilled name is present on the simulator's fake `cuda` module."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    return all(hasattr(FakeCUDAModule, name) for name in _POLYFILLS)
