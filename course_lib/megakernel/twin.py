"""The NumPy twin of the megakernel: the instruction list executed one instruction at a time, in any order the
dependencies allow, on named buffers (as the step plan's), each operation written with course_lib.reference.

`run` executes a step; `random_order` draws an order the dependencies allow (run in a shuffled order, the step must
give the same result: the dependencies are complete); `trace` keeps what each instruction wrote, and
`first_difference` names the first instruction whose output differs between two traces, beyond a tolerance: how a
kernel that interprets the same list is debugged, instruction by instruction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import reference
from ..kernels.sampling import NO_TOKEN, sample
from ..model.loading import Model
from .program import Instruction, build_program
from .schedule import check_queues


@dataclass
class TwinState:
    """The buffers of a decode step, by name. token: the token fed in; position: its position (both advanced by
    `sample`); q, attn [H * hd], x [d], act [d_ff], logits [V]; k_cache, v_cache [layers, capacity, Hkv, hd];
    sampling: (temperature, top_k, top_p, seed)."""

    token: np.ndarray
    position: np.ndarray
    x: np.ndarray
    q: np.ndarray
    attn: np.ndarray
    act: np.ndarray
    logits: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    sampling: tuple = (0.0, None, None, 0)

    @classmethod
    def empty(cls, model: Model, capacity: int, sampling=(0.0, None, None, 0)) -> TwinState:
        c = model.config
        cache = (c.n_layers, capacity, c.n_kv_heads, c.head_dim)
        return cls(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(c.d_model, np.float32),
                   np.zeros(c.n_heads * c.head_dim, np.float32), np.zeros(c.n_heads * c.head_dim, np.float32),
                   np.zeros(c.d_ff, np.float32), np.zeros(c.vocab_size, np.float32), np.zeros(cache, np.float32),
                   np.zeros(cache, np.float32), sampling)


class Twin:
    """A model's instruction list and the NumPy execution of each instruction."""

    def __init__(self, model: Model, capacity: int, **program_options):
        self.model, self.config = model, model.config
        self.program = build_program(model.config, **program_options)
        self.rope = reference.rope_tables(model.config, capacity)
        self.capacity = capacity

    def execute(self, ins: Instruction, s: TwinState) -> None:
        """One instruction on the buffers of s."""
        c, w = self.config, self.model.weights
        hd, pos = c.head_dim, int(s.position[0])
        if ins.op == "embed":
            s.x[:] = reference.embedding(w.embed, s.token)[0]
        elif ins.op == "qkv":  # RoPE pairs start .. stop - 1: dimensions i and i + hd / 2 of one head
            lw, half = w.layers[ins.layer], hd // 2
            h, i0 = divmod(ins.start, half)
            dims = np.r_[i0:ins.stop - h * half, half + i0:half + ins.stop - h * half]
            x = reference.rms_norm(s.x[None], lw.attn_norm, c.rms_eps)
            (weight, bias, j), kind = _head(lw, h, c)
            y = reference.linear(x, weight[:, j * hd:(j + 1) * hd], None if bias is None else bias[j * hd:(j + 1) * hd])
            if kind != "v":
                y = reference.rope(y.reshape(1, 1, hd), self.rope[0][pos:pos + 1], self.rope[1][pos:pos + 1])
            if kind == "q":
                s.q[j * hd + dims] = y.reshape(hd)[dims]
            else:
                (s.k_cache if kind == "k" else s.v_cache)[ins.layer, pos, j, dims] = y.reshape(hd)[dims]
        elif ins.op == "attention":
            h = ins.start
            g, head = h // (c.n_heads // c.n_kv_heads), slice(h * hd, (h + 1) * hd)
            k = s.k_cache[ins.layer, :pos + 1, g:g + 1]
            v = s.v_cache[ins.layer, :pos + 1, g:g + 1]
            s.attn[head] = reference.attention(s.q[head].reshape(1, 1, hd), k, v, np.array([pos])).reshape(-1)
        elif ins.op in ("o_proj", "down"):
            lw, cols = w.layers[ins.layer], slice(ins.start, ins.stop)
            a, weight = (s.attn, lw.wo) if ins.op == "o_proj" else (s.act, lw.w_down)
            s.x[cols] = s.x[cols] + reference.linear(a[None], weight[:, cols])[0]
        elif ins.op == "gate_up":
            lw, cols = w.layers[ins.layer], slice(ins.start, ins.stop)
            x = reference.rms_norm(s.x[None], lw.mlp_norm, c.rms_eps)
            s.act[cols] = reference.swiglu(reference.linear(x, lw.w_gate[:, cols]),
                                           reference.linear(x, lw.w_up[:, cols]))[0]
        elif ins.op == "logits":
            cols = slice(ins.start, ins.stop)
            x = reference.rms_norm(s.x[None], w.final_norm, c.rms_eps)
            head = w.embed[cols].T if w.lm_head is None else w.lm_head[:, cols]
            s.logits[cols] = (x @ head)[0]
        elif ins.op == "sample":
            token = sample(s.logits, *s.sampling, position=pos + 1)
            if token == NO_TOKEN:
                raise RuntimeError(f"NaN in the logits of position {pos}: no token to choose")
            s.token[0], s.position[0] = token, pos + 1
        else:
            raise ValueError(f"unknown instruction {ins.op!r}")

    def run(self, state: TwinState, order=None) -> TwinState:
        """One decode step: every instruction, in program order or in `order` (a permutation of its indices)."""
        for i in range(len(self.program)) if order is None else order:
            self.execute(self.program[i], state)
        return state

    def run_queues(self, state: TwinState, queues: list[list[int]], rng: np.random.Generator) -> TwinState:
        """One decode step as the persistent kernel runs it: each block takes the instructions of its queue in order,
        each once everything it waits for is done; at every turn a random block among those that can go does (the
        blocks' relative speeds are arbitrary). Raises if they deadlock."""
        check_queues(self.program, queues)
        done, nxt = np.zeros(len(self.program), bool), [0] * len(queues)
        for _ in range(len(self.program)):
            can_go = [b for b, q in enumerate(queues)
                      if nxt[b] < len(q) and all(done[d] for d in self.program[q[nxt[b]]].deps)]
            if not can_go:
                raise RuntimeError("deadlock: every block waits for an instruction that never runs")
            b = can_go[int(rng.integers(len(can_go)))]
            i = queues[b][nxt[b]]
            self.execute(self.program[i], state)
            done[i], nxt[b] = True, nxt[b] + 1
        return state

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling=(0.0, None, None, 0),
                 stop_ids=frozenset(), order_rng: np.random.Generator | None = None) -> list[int]:
        """Tokens after the prompt, every position a decode step of the program (the prompt fed one token at a
        time, as the megakernel would loop over tokens), until a stop id or max_new_tokens; each step in a random
        order the dependencies allow when order_rng is given."""
        if len(prompt_ids) + max_new_tokens > self.capacity:
            raise ValueError(f"{len(prompt_ids)} + {max_new_tokens} positions exceed the twin's {self.capacity}")
        state, out = TwinState.empty(self.model, self.capacity, sampling), []
        for i, token in enumerate(prompt_ids):
            state.token[0], state.position[0] = token, i
            self.run(state, None if order_rng is None else random_order(self.program, order_rng))
        while True:  # state.token: the token the last step chose
            out.append(int(state.token[0]))
            if out[-1] in stop_ids or len(out) == max_new_tokens:
                return out
            self.run(state, None if order_rng is None else random_order(self.program, order_rng))

    def trace(self, state: TwinState, order=None, fault=None) -> dict[int, list[np.ndarray]]:
        """Run a step and keep, for each instruction, copies of the regions it wrote (in its declared order).
        fault(index, state): called after each instruction (a way to inject a bug in a test)."""
        out = {}
        for i in range(len(self.program)) if order is None else order:
            ins = self.program[i]
            self.execute(ins, state)
            if fault is not None:
                fault(i, state)
            out[i] = [self._region(state, a).copy() for a in ins.writes]
        return out

    def _region(self, state: TwinState, access) -> np.ndarray:
        buf = getattr(state, access.buffer)
        if access.buffer in ("k_cache", "v_cache"):  # a qkv instruction writes the row of the current position
            hd = self.config.head_dim
            (layer, head), i = divmod(access.start // hd, self.config.n_kv_heads), access.start % hd
            return buf[layer, int(state.position[0]), head, i:i + access.stop - access.start]
        return buf[access.start:access.stop]


def _head(lw, h: int, c) -> tuple[tuple, str]:
    """((weight [d, n * hd], bias or None, index j of the head in it), "q" | "k" | "v") for qkv head h."""
    if h < c.n_heads:
        return (lw.wq, lw.bq, h), "q"
    if h < c.n_heads + c.n_kv_heads:
        return (lw.wk, lw.bk, h - c.n_heads), "k"
    return (lw.wv, lw.bv, h - c.n_heads - c.n_kv_heads), "v"


def random_order(program: list[Instruction], rng: np.random.Generator) -> list[int]:
    """A random order of the instructions that the dependencies allow (each after everything it waits for)."""
    waiting = [len(ins.deps) for ins in program]
    children = [[] for _ in program]
    for i, ins in enumerate(program):
        for d in ins.deps:
            children[d].append(i)
    ready, order = [i for i, n in enumerate(waiting) if n == 0], []
    while ready:
        i = ready.pop(int(rng.integers(len(ready))))
        order.append(i)
        for child in children[i]:
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    return order


def largest_gap(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| (0 for no element; two NaNs agree, a NaN against a number is infinitely far)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    gaps = np.where(np.isnan(a) & np.isnan(b), 0.0, np.nan_to_num(np.abs(a - b), nan=np.inf))
    return float(np.max(gaps, initial=0.0))


def first_difference(program, trace_a, trace_b, tolerance: float) -> tuple[int, Instruction, float] | None:
    """The first instruction, in program order, whose output differs by more than `tolerance` between two traces
    (int outputs, exactly; a NaN against a number, infinitely): (index, instruction, largest difference), or None
    when they agree."""
    for i, ins in enumerate(program):
        for a, b in zip(trace_a[i], trace_b[i], strict=True):
            diff = largest_gap(a, b)
            if diff > (tolerance if trace_a[i][0].dtype.kind == "f" else 0):
                return i, ins, diff
    return None
