"""Launching kernels: the normal Numba dispatcher or a low-overhead path, with optional per-kernel profiling.

Numba's dispatcher spends 28-86 us of Python per launch on the H200 (typing every argument, building the launch
configuration), more than most decode kernels run. The fast path compiles once per argument-type signature and
then flattens the arguments itself (an array is passed as meminfo, parent, size, itemsize, pointer, shape,
strides) and calls cuda.core's launch directly. In the simulator both paths are the dispatcher.

Every device allocation and every launch of a backend goes through a Runtime, which counts them and, when a
Profile is attached, brackets each launch with CUDA events (host clocks in the simulator).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..kernels import SIMULATOR, compiled_once, cuda
from ..kernels.overlap import supported as overlap_supported


class FastKernel:
    """One compiled specialization of a kernel, launched through cuda.core with arguments flattened by hand."""

    def __init__(self, dispatcher, args):
        types = tuple(dispatcher.typeof_pyval(a) for a in args)
        kernel = dispatcher.overloads.get(types) or dispatcher.compile(types)
        kernel.bind()
        self.kernel = kernel._codelibrary.get_cufunc().kernel
        self.cooperative = kernel.cooperative
        self.flatteners = [_flattener(t) for t in kernel.argument_types]
        self.configs = {}  # (grid, block) -> LaunchConfig

    def flatten(self, args) -> list:
        flat = []
        for f, a in zip(self.flatteners, args, strict=True):
            f(a, flat)
        return flat

    def config(self, grid, block, overlap: bool = False):
        """The launch configuration of (grid, block); overlap: a programmatic launch (kernels/overlap.py), which may
        start before the previous kernel on the stream has finished."""
        from cuda.core import LaunchConfig

        cfg = self.configs.get((grid, block, overlap))
        if cfg is None:
            options = {"programmatic_stream_serialization": True} if overlap else {}
            try:
                cfg = LaunchConfig(grid=grid, block=block, is_cooperative=self.cooperative, **options)
            except TypeError as e:
                raise RuntimeError("overlapping launches need cuda-core >= 1.2 (LaunchConfig's "
                                   "programmatic_stream_serialization)") from e
            self.configs[grid, block, overlap] = cfg
        return cfg


def _flattener(ty):
    from numba.cuda import types

    if isinstance(ty, types.Array):
        def flat_array(a, out):
            out += (0, 0, a.size, a.dtype.itemsize, a.device_ctypes_pointer.value, *a.shape, *a.strides)
        return flat_array
    if isinstance(ty, types.Integer):
        ctype = getattr(ctypes, f"c_{ty}")
        return lambda v, out: out.append(ctype(v))
    if ty == types.float32:
        return lambda v, out: out.append(ctypes.c_float(v))
    if ty == types.float64:
        return lambda v, out: out.append(ctypes.c_double(v))
    raise NotImplementedError(f"fast launch does not handle arguments of type {ty}")


@dataclass
class Profile:
    """What a Runtime records while attached: one entry per launch (name, start, end in ms on one clock)."""

    events: list = field(default_factory=list)  # (name, start_event, end_event) on the GPU
    host: list = field(default_factory=list)  # (name, start_ms, end_ms) in the simulator
    hold: Callable | None = None  # hold(stream): queue a kernel that keeps the GPU busy, every hold_every launches
    hold_every: int = 128

    def timeline(self) -> list[tuple[str, float, float]]:
        """[(kernel name, start ms, end ms)], times relative to the first launch; synchronizes the GPU."""
        if self.host:
            t0 = self.host[0][1]
            return [(n, s - t0, e - t0) for n, s, e in self.host]
        if not self.events:
            return []
        cuda.synchronize()
        first = self.events[0][1]
        return [(n, cuda.event_elapsed_time(first, s), cuda.event_elapsed_time(first, e)) for n, s, e in self.events]


class Runtime:
    """Allocations and launches of one backend, counted; fast launches on a GPU unless fast=False.

    With overlap=True (fast launches only), a kernel marked by `kernels.overlap.waits_for_inputs` is launched
    programmatically: it may start while the kernel before it ends (see kernels/overlap.py); other kernels are
    launched as usual.

    With reuse=True, device arrays are recycled from one pass to the next, as PyTorch's caching allocator does: an
    `empty` with a name gets the array of that name (one buffer of the pass), and the i-th unnamed `empty` (or
    `to_device`) of a pass the array the i-th unnamed call of the previous pass got, when shape and dtype match;
    otherwise a new array replaces it. A decode step then allocates nothing once the first step has run, and the
    pool holds one array per name or unnamed call of a pass: passes of changing shapes (prompts of growing length)
    replace arrays rather than pile them up. Call `begin_pass` at the start of every pass; arrays from a pass are
    valid until the next pass."""

    def __init__(self, fast: bool = True, reuse: bool = False, overlap: bool = False):
        self.fast = fast and not SIMULATOR
        self.reuse = reuse
        self.overlap = overlap and self.fast and overlap_supported()
        self.stream = cuda.stream()  # a stream of our own: the default stream cannot be captured into a graph
        self._core_stream = None
        self._fast_kernels = {}
        self._pool = {}  # name, or call index in the pass -> device array, when reuse is on
        self._recording: list | None = None  # launches recorded instead of run (see `record`)
        self._scratch: dict | None = None  # per-call-site scratch while recording (per_site)
        self._scratch_calls = 0
        self._staging = {}  # call index -> (pinned host buffer, event of its last copy), for to_device
        self._calls = 0
        self.launches = 0
        self.allocations = 0
        self.transfers = 0  # host-to-device copies
        self.profile: Profile | None = None

    def begin_pass(self):
        self._calls = 0
        self._scratch_calls = 0

    def empty(self, shape, dtype=np.float32, name: str | None = None):
        """A device array: fresh and counted, or (reuse) the one this name, or this call, got in an earlier pass.

        A name stands for one buffer of the pass, as a field of llama2.c's RunState: every call with that name
        gets the same array (the layers of a pass use their activations one after another)."""
        if not self.reuse:
            self.allocations += 1
            return cuda.device_array(shape, dtype=dtype)
        key, shape = name, tuple(int(n) for n in np.atleast_1d(shape))
        if key is None:
            key = self._calls
            self._calls += 1
        arr = self._pool.get(key)
        if arr is None or arr.shape != shape or arr.dtype != np.dtype(dtype):
            self.allocations += 1
            arr = self._pool[key] = cuda.device_array(shape, dtype=dtype)
        return arr

    def split_k_scratch(self, partial_shape, groups: int):
        """(partial sums [S, rows, N] float32, completion counters [>= groups] int32 zeros) for one split-K launch.
        See per_site."""
        from ..kernels import narrow

        return (self.per_site(lambda: narrow.partial_sums(partial_shape),
                              lambda: cuda.device_array(partial_shape, np.float32)), self.counters(groups))

    def counters(self, n: int):
        """Completion counters [>= n] int32 zeros for one launch (kernels.last_to_arrive). See per_site."""
        from ..kernels import completion_counters

        return self.per_site(lambda: completion_counters(n), lambda: cuda.to_device(np.zeros(n, np.int32)))

    def per_site(self, shared, own):
        """Scratch for one launch: shared(), launched one by one (every launch of the process shares one buffer:
        one stream, one launch at a time); while recording a plan, own(), made once per call site and kept with the
        plan: a shared buffer may be replaced by a larger one, and a recorded launch would then point at freed
        memory."""
        if self._scratch is None:
            return shared()
        site = self._scratch_calls
        self._scratch_calls += 1
        if site not in self._scratch:
            self.allocations += 1
            self._scratch[site] = own()
        return self._scratch[site]

    def record(self, body, scratch_per_site: bool = False) -> list:
        """Run body() with launches recorded, not run: -> [(name, kernel, grid, block, args)], in order. Also a way
        to count what a pass launches and allocates without running it (allocations and uploads do happen).
        scratch_per_site: every launch gets scratch of its own (a step plan: the arrays stay the recorded
        launches' own)."""
        self._recording, self._scratch = [], {} if scratch_per_site else None
        self.begin_pass()
        try:
            body()
            return self._recording
        finally:
            self._recording, self._scratch = None, None  # the recorded arguments hold the scratch: keep them

    def to_device(self, array, persistent: bool = False):
        """A device copy of a host array (one transfer), in a fresh or (reuse) recycled device array; persistent
        arrays (weights, tables) are always fresh and never recycled.

        A recycled array is filled through a pinned (page-locked) host buffer of its own, by an asynchronous copy
        queued on the stream like a kernel: a copy from ordinary (pageable) memory would make the host wait until
        the GPU has finished all the work queued before it. The buffer is reused once its last copy is done."""
        array = np.ascontiguousarray(array)
        self.transfers += 1
        if persistent or not self.reuse:
            self.allocations += 1
            return cuda.to_device(array)
        call = self._calls
        out = self.empty(array.shape, array.dtype)
        if SIMULATOR:
            out.copy_to_device(array)
            return out
        staging = self._staging.get(call)
        if staging is None or staging[0].shape != array.shape or staging[0].dtype != array.dtype:
            staging = self._staging[call] = (cuda.pinned_array(array.shape, array.dtype), cuda.event())
        host, copied = staging
        copied.synchronize()  # its previous copy has left the buffer (at once if never recorded)
        host[...] = array
        out.copy_to_device(host, stream=self.stream)
        copied.record(self.stream)
        return out

    def launch(self, name: str, kernel, grid, block, *args):
        """kernel[grid, block](*args), counted, profiled when a Profile is attached (recorded while `record`
        runs)."""
        if self._recording is not None:
            self._recording.append((name, kernel, grid, block, args))
            return
        self.launches += 1
        prof = self.profile
        if prof is not None:
            if prof.hold is not None and len(prof.events) % prof.hold_every == 0:
                prof.hold(self.stream)
            if SIMULATOR:
                t = time.perf_counter()
            else:
                start, end = cuda.event(), cuda.event()
                start.record(self.stream)
        self.prepared(kernel, grid, block, args)()
        if prof is not None:
            if SIMULATOR:
                prof.host.append((name, t * 1e3, time.perf_counter() * 1e3))
            else:
                end.record(self.stream)
                prof.events.append((name, start, end))

    def _fast(self, kernel, args) -> FastKernel:
        key = (id(kernel), tuple(_type_key(a) for a in args))
        fk = self._fast_kernels.get(key)
        if fk is None:
            fk = self._fast_kernels[key] = FastKernel(kernel, args)
        return fk

    def _stream_core(self):
        if self._core_stream is None:
            from numba.cuda.cudadrv import driver

            self._core_stream = driver._to_core_stream(self.stream)
        return self._core_stream

    def prepared(self, kernel, grid, block, args):
        """The one way a Runtime launches: a launch with its arguments flattened once; calling it queues
        kernel[grid, block](*args) on the runtime's stream (through Numba's dispatcher where there is no fast path:
        the simulator, or fast=False). `launch` calls it at once; a step plan keeps it and calls it every step."""
        compiled_once(kernel)
        if not self.fast:
            return lambda: kernel[grid, block, self.stream](*args)
        from cuda.core import launch

        fk = self._fast(kernel, args)
        overlap = self.overlap and getattr(kernel, "waits_for_inputs", False)
        stream, cfg, cufunc, flat = self._stream_core(), fk.config(_dim3(grid), _dim3(block), overlap), fk.kernel, \
            fk.flatten(args)
        return lambda: launch(stream, cfg, cufunc, *flat)

    def synchronize(self):
        self.stream.synchronize()


def _dim3(d):
    return d if isinstance(d, tuple) else (d,)


def _type_key(a):
    if hasattr(a, "dtype") and hasattr(a, "shape"):
        return (a.dtype.str, a.ndim)
    return type(a)
