"""CUDA graphs: launches recorded once by stream capture, then replayed by one call.

Launched one by one from the host, every kernel pays a gap on the GPU between the end of the previous kernel and its
own start (1.6 us for an empty kernel on the H200); inside a graph the GPU knows the next kernel in advance and the
gap shrinks (0.85 us). Numba's kernels are captured like any launch on a stream.

Capture runs the host code once with the stream in capture mode: kernels launched on that stream become the graph's
nodes and do not run. Relaxed mode lets the host code allocate while capturing; an array a captured kernel uses must
then stay alive as long as the graph is replayed (the caller keeps it, or holds `cuda.defer_cleanup()`).
GPU only: the simulator has no graphs.
"""

import weakref

from cuda.bindings import driver

from course_lib.kernels import SIMULATOR


def _ok(result):
    """The values of a cuda.bindings call, after checking its error code."""
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA graph: {driver.cuGetErrorName(err)[1].decode()}")
    return values[0] if values else None


class Graph:
    """record() captured on `stream` (a Numba stream, not the default stream); launch(stream) replays it."""

    def __init__(self, record, stream):
        if SIMULATOR:
            raise RuntimeError("CUDA graphs need a GPU: the simulator cannot capture launches")
        if not int(stream.handle or 0):
            raise ValueError("the default stream cannot be captured: give the graph a stream of its own, cuda.stream()")
        _ok(driver.cuStreamBeginCapture(stream.handle, driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        try:
            record()
        finally:
            graph = _ok(driver.cuStreamEndCapture(stream.handle))
        self._exec = _ok(driver.cuGraphInstantiate(graph, 0))
        _ok(driver.cuGraphDestroy(graph))  # the instantiated graph does not need it
        weakref.finalize(self, driver.cuGraphExecDestroy, self._exec)

    def launch(self, stream):
        """Queue one replay of the whole graph on `stream`."""
        _ok(driver.cuGraphLaunch(self._exec, stream.handle))
