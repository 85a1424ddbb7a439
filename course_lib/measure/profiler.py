"""Profiling a decode step: per-kernel GPU time from CUDA events, launches and allocations per token, the
fraction of wall time the GPU is busy, and a timeline plot.

Events around every launch cost time themselves, so the undisturbed rate is measured separately, without them
(`time_decode`). In the simulator the "GPU time" is host time: only the counts are meaningful there.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..gpu.runtime import Profile


@dataclass
class StepProfile:
    """One decode step. kernels: [(name, start ms, end ms)] relative to the step's first launch."""

    kernels: list[tuple[str, float, float]]
    wall_ms: float
    launches: int
    allocations: int
    transfers: int  # host-to-device copies

    @property
    def gpu_ms(self) -> float:
        return sum(e - s for _, s, e in self.kernels)

    @property
    def busy_fraction(self) -> float:
        """GPU time / wall time of the step (kernels of one stream never overlap)."""
        return self.gpu_ms / self.wall_ms

    def by_kernel(self) -> list[tuple[str, int, float]]:
        """[(kernel name, launches, total ms)], the most expensive first."""
        return by_kernel(self.kernels)

    def table(self) -> str:
        lines = [f"{'kernel':<22}{'launches':>9}{'total ms':>10}{'share':>8}"]
        for name, count, total in self.by_kernel():
            lines.append(f"{name:<22}{count:>9}{total:>10.3f}{total / self.gpu_ms:>8.1%}")
        lines.append(f"{'all kernels':<22}{self.launches:>9}{self.gpu_ms:>10.3f}")
        lines.append(f"wall time of the step {self.wall_ms:.3f} ms; GPU busy {self.busy_fraction:.0%}; "
                     f"{self.allocations} device allocations")
        return "\n".join(lines)


def by_kernel(kernels: list[tuple[str, float, float]]) -> list[tuple[str, int, float]]:
    """[(kernel name, launches, total ms)] of a timeline [(name, start ms, end ms)], the most expensive first."""
    totals = defaultdict(lambda: [0, 0.0])
    for name, s, e in kernels:
        totals[name][0] += 1
        totals[name][1] += e - s
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])


def profile_decode(backend, token: int, queued: bool = False) -> StepProfile:
    """Run one decode step of `backend` with a CUDA event pair around every launch.

    As the step runs, a kernel's interval also holds any wait for the host's next launch. queued=True (GPU only)
    keeps the GPU busy with `hold` kernels while the host queues the step (memory frees deferred), so the kernels
    run back to back and each interval is the kernel's own time; the wall time is then that of the holds and the
    step together, not meaningful. The GPU accepts only so many queued commands (three per profiled launch), so
    a hold goes before every Profile.hold_every launches, and lasts three times as long as the host takes to
    queue them: a first profiled step (two steps in all; the counts are those of the second) measures that.
    Nothing in the step may wait for the GPU (a recycling Runtime uploads asynchronously, from pinned memory; the
    others upload before the step's first launch, so before its first hold), and Python's garbage collector is
    paused while the steps are queued (as timeit does): in a process holding many objects (a notebook that built
    several engines) one full collection can outlast a hold. A warning says when the kernels still waited on the
    host: then each interval also holds the host's preparation of that launch."""
    with _collector_paused():
        return _profile_step(backend, token, queued)


def _profile_step(backend, token: int, queued: bool) -> StepProfile:
    """profile_decode's step (queued: behind holds sized by a first, unqueued step)."""
    from ..kernels import copy as k_copy
    from ..kernels import cuda

    rt = backend.rt
    profile = Profile()
    if queued:
        first = _profile_step(backend, token, False)
        per_launch_us = 1e3 * first.wall_ms / max(1, first.launches)
        hold_us = int(3 * per_launch_us * profile.hold_every) + 1_000
        profile.hold = lambda stream: k_copy.hold[1, 1, stream](hold_us)
    rt.synchronize()
    launches, allocations, transfers = rt.launches, rt.allocations, rt.transfers
    rt.profile = profile
    t0 = time.perf_counter()
    try:
        if queued:
            with cuda.defer_cleanup():
                backend.decode(token)
        else:
            backend.decode(token)
        rt.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
        kernels = rt.profile.timeline()
    finally:
        rt.profile = None
    if queued:
        kernels = _without_holds(kernels, profile.hold_every)
    step = StepProfile(kernels, wall_ms, rt.launches - launches, rt.allocations - allocations,
                       rt.transfers - transfers)
    waits = [s - e for (_, _, e), (_, s, _) in zip(kernels, kernels[1:], strict=False) if s - e > 0.02]
    if queued and waits:  # back to back, kernels are ~2 us apart; a wait for the host is tens of us or more
        warnings.warn(f"the hold ended before the step was queued: {len(waits)} waits for the host, "
                      f"{sum(waits):.3f} ms", stacklevel=3)
    return step


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off inside the block (back on after it, if it was on)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _without_holds(kernels, every: int):
    """The timeline of a queued profile with the holds taken out: kernel i, a multiple of `every` (a hold went
    before it), starts where kernel i - 1 ended, and the kernels after it move with it."""
    out, shift = [], 0.0
    for i, (name, s, e) in enumerate(kernels):
        if i and i % every == 0:
            shift += s - kernels[i - 1][2]
        out.append((name, s - shift, e - shift))
    return out


def time_decode(backend, token: int, steps: int) -> float:
    """Median wall ms of `steps` undisturbed decode steps (no events), each ending with its logits on the host."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        backend.decode(token)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def plot_timeline(ax, step: StepProfile, title: str = ""):
    """One bar per kernel on a time axis (ms), one row per kernel name, in order of first appearance."""
    names = list(dict.fromkeys(n for n, _, _ in step.kernels))
    row = {n: i for i, n in enumerate(names)}
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    for name, s, e in step.kernels:
        ax.barh(row[name], max(e - s, 1e-4), left=s, height=0.8, color=colors[name])
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("time since the step's first launch (ms)")
    ax.set_xlim(0, max(step.wall_ms, max((e for _, _, e in step.kernels), default=0)))
    ax.set_title(title or f"one decode step: {step.launches} launches, GPU busy {step.busy_fraction:.0%}")
    return ax
