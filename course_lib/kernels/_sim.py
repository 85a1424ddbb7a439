"""What Numba's CUDA simulator lacks and the course's kernels use: warp shuffles, syncwarp, libdevice.

The simulator runs every CUDA thread of a block as a Python thread and hands each kernel a fake `cuda` module
(an instance of `FakeCUDAModule`). `install()` adds the missing functions to that class, once:

- `shfl_down_sync`, `shfl_up_sync`, `shfl_xor_sync`, `shfl_sync`: the lanes of a warp (32 consecutive threads
  of the block) meet at a barrier, publish their value, read the source lane's, and meet again. As on the GPU,
  a source lane outside the warp leaves the value unchanged. The mask is ignored: every existing lane of the
  warp must make the call (the kernels only use full warps).
- `syncwarp`: a barrier for the warp's lanes.
- `libdevice.int_as_float` and `libdevice.float_as_int`: reinterpret 32 bits.
- `nanosleep`: a real sleep (used by the `hold` kernel of the benchmarks).

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
    """The lanes of one warp of one block: a barrier and a slot per lane for exchanging values."""

    def __init__(self, n_lanes: int):
        self.n_lanes = n_lanes
        self.barrier = threading.Barrier(n_lanes, timeout=BARRIER_TIMEOUT_S)
        self.values = [None] * n_lanes


_registry_lock = threading.Lock()


def _my_warp(fake_cuda) -> tuple[_Warp, int]:
    """(the calling thread's warp, its lane). Warps are kept on the fake module, which lives for one launch."""
    thread = threading.current_thread()
    warp_id, lane = divmod(thread.thread_id, WARP_SIZE)
    key = (tuple(thread.blockIdx), warp_id)
    with _registry_lock:
        warps = fake_cuda.__dict__.setdefault("_course_lib_warps", {})
        warp = warps.get(key)
        if warp is None:
            bd = fake_cuda.blockDim
            n_threads = bd.x * bd.y * bd.z
            warp = warps[key] = _Warp(min(WARP_SIZE, n_threads - warp_id * WARP_SIZE))
    return warp, lane


def _exchange(fake_cuda, value, source_lane):
    """Every lane publishes `value` and gets the value of lane source_lane(lane) (its own if out of range)."""
    warp, lane = _my_warp(fake_cuda)
    warp.values[lane] = value
    warp.barrier.wait()
    src = source_lane(lane)
    result = warp.values[src] if 0 <= src < warp.n_lanes else value
    warp.barrier.wait()  # nobody overwrites a slot before every lane has read
    return result


def _shfl_sync(self, mask, value, src_lane):
    return _exchange(self, value, lambda lane: int(src_lane) % WARP_SIZE)


def _shfl_down_sync(self, mask, value, delta):
    return _exchange(self, value, lambda lane: lane + int(delta))


def _shfl_up_sync(self, mask, value, delta):
    return _exchange(self, value, lambda lane: lane - int(delta))


def _shfl_xor_sync(self, mask, value, lane_mask):
    return _exchange(self, value, lambda lane: lane ^ int(lane_mask))


def _syncwarp(self, mask=0xFFFFFFFF):
    warp, _ = _my_warp(self)
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
