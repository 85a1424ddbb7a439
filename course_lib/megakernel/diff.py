"""The megakernel against its twin, inside one step: which instruction is the first to go wrong.

The kernel can stop after any prefix of the program (`Megakernel.run_prefix`: one block, in program order). After
the prefix 0 .. i, its buffers should hold what the twin's hold after the same instructions. The first prefix whose
buffers differ, beyond a tolerance, ends with the first instruction that computes something wrong; it is found by
bisection, in about log2(n) launches of the kernel (a few seconds in the simulator for the tiny model), rather than
n. (A wrong result stays visible in later prefixes: the residual stream only accumulates, and every other buffer is
computed from it.)
"""

from __future__ import annotations

import copy

import numpy as np

from .program import Instruction
from .runner import Megakernel
from .twin import Twin, TwinState, largest_gap

COMPARED = ("x", "q", "attn", "act", "logits", "k_cache", "v_cache", "token")  # the buffers both sides hold


def kernel_state(mk: Megakernel, like: TwinState) -> TwinState:
    """The kernel's buffers as a TwinState (shapes of `like`, its position and sampling)."""
    s = mk.state
    return TwinState(s.token.copy_to_host().astype(np.int64), like.position.copy(), s.x.copy_to_host()[0],
                     s.q.copy_to_host(), s.attn.copy_to_host(), s.act.copy_to_host()[0], s.logits.copy_to_host(),
                     *(c.copy_to_host()[:, :like.k_cache.shape[1]] for c in (s.k_cache, s.v_cache)), like.sampling)


def restore(mk: Megakernel, state: TwinState) -> None:
    """The kernel's buffers set to those of `state` (each prefix starts from the same state)."""
    s = mk.state
    for name in ("q", "attn", "logits"):
        getattr(s, name).copy_to_device(np.ascontiguousarray(getattr(state, name), np.float32))
    for name in ("k_cache", "v_cache"):  # the kernel's rows: the capacity rounded up to whole pages
        rows = np.zeros(getattr(s, name).shape, np.float32)
        rows[:, :getattr(state, name).shape[1]] = getattr(state, name)
        getattr(s, name).copy_to_device(rows)
    s.x.copy_to_device(state.x[None].astype(np.float32))  # x and act: [1, n] on the kernel's side
    s.act.copy_to_device(state.act[None].astype(np.float32))
    s.token.copy_to_device(state.token.astype(np.int32))


def widest_gap(a: TwinState, b: TwinState, position: int) -> tuple[str, float]:
    """(buffer, largest |a - b|) over the buffers both sides hold, the caches compared at rows 0 .. position
    (twin.largest_gap: a NaN against a number counts as infinite)."""
    worst = ("", 0.0)
    for name in COMPARED:
        x, y = getattr(a, name), getattr(b, name)
        if name in ("k_cache", "v_cache"):
            x, y = x[:, :position + 1], y[:, :position + 1]
        gap = largest_gap(x, y)
        if gap > worst[1]:
            worst = (name, gap)
    return worst


def first_kernel_difference(mk: Megakernel, twin: Twin, tokens: list[int], tolerance: float
                            ) -> tuple[int, Instruction, str, float] | None:
    """Feed tokens[:-1] to the kernel (whole steps; the twin starts from the buffers it leaves), then find the
    first instruction of the step of tokens[-1] after which the kernel's buffers differ from the twin's by more than
    `tolerance`: (its index, the instruction, the buffer, the gap), or None when the whole step agrees."""
    program, position = twin.program, len(tokens) - 1
    if [str(i) for i in program] != [str(i) for i in mk.program]:
        raise ValueError("the twin and the kernel run different programs: build the twin with the kernel's slices")
    if position:
        mk.prefill(tokens[:-1])
    mk.position = position
    state = TwinState.empty(twin.model, twin.capacity)  # the kernel's buffers: both start the step from one state
    state.position[0] = position
    state = kernel_state(mk, state)
    state.token[0] = tokens[-1]

    def differs(n: int) -> tuple[str, float] | None:
        """The gap after the prefix of n instructions, or None within tolerance."""
        restore(mk, state)
        mk.run_prefix(tokens[-1], n)
        expected = copy.deepcopy(state)
        twin.run(expected, range(n))
        name, gap = widest_gap(kernel_state(mk, expected), expected, position)
        return (name, gap) if gap > tolerance else None

    if differs(len(program)) is None:
        return None
    lo, hi = 0, len(program)  # the prefix of lo instructions agrees (none: trivially), that of hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if differs(mid) is not None else (mid, hi)
    name, gap = differs(hi)
    return hi - 1, program[hi - 1], name, gap
