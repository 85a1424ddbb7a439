"""The megakernel's host side: a model's weights stacked by layer, every buffer of a step allocated once by name (as
llama2.c's RunState), the program scheduled on the GPU's SMs, and launches of many steps each.

    mk = Megakernel(model, capacity=1024)
    first = mk.prefill(prompt_ids, sampling)     # one launch: the prompt fed token by token, then the first choice
    more = mk.decode(16)                         # one launch: the next 16 tokens, each chosen on the GPU
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from .. import reference
from ..kernels import SIMULATOR, compiled_once, cuda, sm_count
from ..kernels.paged_attention import MAX_GROUP, MAX_GROUP_DIMS, MAX_HEAD_DIM
from ..kernels.row_dot import output_rows, paired_gate_up, paired_qkv
from ..kernels.sampling import NO_TOKEN, THREADS, device_settings
from ..kernels.vector import words
from ..model.loading import Model
from ..model.safetensors_io import f32_to_bf16
from .kernel import MAX_QUEUE, PAGE, SLICE_COLS, megakernel_for
from .program import build_program
from .schedule import assign, cost, counter_tables, encode

SYNCS = ("counters", "barrier")
BANDWIDTH = 3.7e12  # bytes/s the scheduler's cost model assumes (the H200's measured read bandwidth, about)


def check_shapes(config) -> None:
    """The shapes the megakernel's instructions handle (see kernel.py); a clear error otherwise."""
    c, hd = config, config.head_dim
    problems = [f"{name} = {v} is not a multiple of 8 (16-byte loads)" for name, v in
                (("d_model", c.d_model), ("d_ff", c.d_ff), ("n_heads * head_dim", c.n_heads * hd)) if v % 8]
    G = c.n_heads // c.n_kv_heads
    if hd > MAX_HEAD_DIM or hd % 8 or G > MAX_GROUP or G * hd > MAX_GROUP_DIMS or c.n_heads % c.n_kv_heads:
        problems.append(f"head_dim = {hd} and {G} query heads per KV head: attention (kernels/paged_attention) takes "
                        f"a head_dim multiple of 8 up to {MAX_HEAD_DIM}, up to {MAX_GROUP} heads per KV head, "
                        f"{MAX_GROUP_DIMS} of their elements")
    if c.vocab_size % 2:
        problems.append(f"vocab_size = {c.vocab_size} is odd (the logits come in pairs)")
    if problems:
        raise ValueError("the megakernel cannot run this model: " + "; ".join(problems))


def row_steps(config) -> int:
    """The megakernel's compile-time steps of a row (kernels/row_dot.pair_sums_for): its longest row, 256 elements a
    step (8 a lane)."""
    c = config
    return -(-max(c.d_model, c.d_ff, c.n_heads * c.head_dim) // 256)


@dataclass
class MegaState:
    """The buffers of the decode steps, allocated once (device arrays; shapes as in kernel.megakernel)."""

    token: object
    x: object
    q: object
    attn: object
    act: object  # [1, d_ff]
    logits: object
    k_cache: object  # [L, rows, Hkv, hd]: rows = capacity rounded up to whole pages (PAGE)
    v_cache: object
    pages: object  # the identity page table of kernels/paged_attention: int32 [rows / PAGE]
    weights: object  # the sampler's scratch
    counters: object  # instructions done per group, over all steps; then the grid barriers passed
    stamps: object  # int64 [n, 3]: clock when each instruction of the last step was waited for, started, done

    @classmethod
    def allocate(cls, config, capacity: int, n_instructions: int, n_counters: int) -> MegaState:
        c = config
        rows = -(-capacity // PAGE) * PAGE
        cache = (c.n_layers, rows, c.n_kv_heads, c.head_dim)
        zeros = lambda shape, dtype=np.float32: cuda.to_device(np.zeros(shape, dtype))  # noqa: E731
        return cls(zeros(1, np.int32), zeros((1, c.d_model)), zeros(c.n_heads * c.head_dim),
                   zeros(c.n_heads * c.head_dim), zeros((1, c.d_ff)), zeros(c.vocab_size), zeros(cache), zeros(cache),
                   cuda.to_device(np.arange(rows // PAGE, dtype=np.int32)), zeros(c.vocab_size, np.uint64),
                   zeros(n_counters + 1, np.int32), zeros((n_instructions, 3), np.int64))

    @functools.cached_property
    def views(self) -> tuple:
        """The buffers as the kernel takes them: x, words(x), q as [1, H hd] and [1, H, hd], attn as [1, H, hd],
        [1, H, 1, hd] and words, act, words(act), logits, logits as [1, V], k_cache, v_cache, their words, pages,
        weights, stamps. Made once (a new Numba view of an array costs tens of microseconds of host time, at every
        launch otherwise); they share the buffers' memory."""
        L, rows, Hkv, hd = self.k_cache.shape
        H, V = self.q.shape[0] // hd, self.logits.shape[0]
        return (self.x, words(self.x), self.q.reshape(1, H * hd), self.q.reshape(1, H, hd),
                self.attn.reshape(1, H, hd), self.attn.reshape(1, H, 1, hd), words(self.attn), self.act,
                words(self.act), self.logits, self.logits.reshape(1, V), self.k_cache, self.v_cache,
                words(self.k_cache), words(self.v_cache), self.pages, self.weights, self.stamps)


def stacked_weights(model: Model, dtype: str) -> dict:
    """The model's weights as the megakernel reads them: {name: device array}, matrices a row per output
    (kernels/row_dot's layouts: paired_qkv, output_rows, paired_gate_up) stacked by layer, bf16 bits or float32, seen
    as uint32 words; the head is the embedding table itself when tied ([V, d] rows); the norms float32 seen as words
    ([L d]), the QKV bias float32 [L, (H + 2 Hkv) hd] in paired_qkv's order."""
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"weight dtype must be 'f32' or 'bf16', got {dtype!r}")
    w, c = model.weights, model.config
    store = (lambda m: f32_to_bf16(m)) if dtype == "bf16" else (lambda m: np.ascontiguousarray(m, np.float32))

    def matrix(host):
        return cuda.to_device(store(host).view(np.uint32).reshape(-1))

    def by_layer(rows_of):
        return matrix(np.stack([rows_of(lw) for lw in w.layers]))

    def f32_words(host):
        return cuda.to_device(np.ascontiguousarray(host, np.float32).view(np.uint32).reshape(-1))

    hd, n_qkv = c.head_dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    biases = [np.concatenate([lw.bq, lw.bk, lw.bv]) if lw.bq is not None else np.zeros(n_qkv, np.float32)
              for lw in w.layers]
    embed = matrix(w.embed)
    return {
        "embed": embed, "head": embed if w.lm_head is None else matrix(output_rows(w.lm_head)),
        "attn_norm": f32_words(np.stack([lw.attn_norm for lw in w.layers])),
        "w_qkv": by_layer(lambda lw: paired_qkv(np.concatenate([lw.wq, lw.wk, lw.wv], axis=1), hd)),
        "b_qkv": cuda.to_device(np.stack([paired_qkv(b, hd) for b in biases]).astype(np.float32)),
        "wo": by_layer(lambda lw: output_rows(lw.wo)),
        "mlp_norm": f32_words(np.stack([lw.mlp_norm for lw in w.layers])),
        "w_gu": by_layer(lambda lw: paired_gate_up(lw.w_gate, lw.w_up)),
        "w_down": by_layer(lambda lw: output_rows(lw.w_down)),
        "final_norm": f32_words(w.final_norm),
    }


class Megakernel:
    """A model ready to decode by the megakernel: one launch for the prompt, one per `decode` call. blocks: the
    persistent grid (default: one per SM; one in the simulator, which interprets every thread: more blocks run
    there too, at once, only slower). sync: how an instruction waits for what it reads, "counters" (the
    instructions it depends on, counted done) or "barrier" (a grid barrier between consecutive phases, every block
    passing every one)."""

    def __init__(self, model: Model, capacity: int, weights: str = "bf16", blocks: int | None = None,
                 cols: int = SLICE_COLS, vocab_cols: int = 384, sync: str = "counters"):
        c = self.config = model.config
        check_shapes(c)
        if sync not in SYNCS:
            raise ValueError(f"sync must be one of {', '.join(SYNCS)}, got {sync!r}")
        if cols < 2 or cols % 2 or vocab_cols < 2 or vocab_cols % 2:
            raise ValueError(f"cols = {cols}, vocab_cols = {vocab_cols}: the kernel computes outputs in pairs (a warp "
                             "each), so a slice must hold an even number of them, at least 2")
        self.model, self.capacity = model, capacity
        self.blocks = blocks or (1 if SIMULATOR else sm_count())
        self.program = build_program(c, cols=cols, vocab_cols=vocab_cols)
        self.schedule = assign(self.program, cost(self.program, c, self.blocks, BANDWIDTH, context=256),
                               self.blocks)
        tables = encode(self.program, self.schedule.queues) | counter_tables(self.program, c)
        longest = max(len(q) for q in self.schedule.queues)
        if longest > MAX_QUEUE:
            raise ValueError(f"a block's queue of {longest} instructions is longer than {MAX_QUEUE}: use more "
                             "blocks or wider slices")
        self.tables = {k: cuda.to_device(v) for k, v in tables.items()}
        self.barriers = int(tables["phase"][-1]) + 1 if sync == "barrier" else 0
        # what the counters gain per step at most: reset before a launch would take them past int32
        self.per_step = self.blocks * self.barriers + int(tables["sizes"].max())
        self.w = stacked_weights(model, weights)
        self.kernel = megakernel_for(np.uint16 if weights == "bf16" else np.float32, row_steps(c),
                                     c.n_heads // c.n_kv_heads, c.head_dim)
        cos, sin = reference.rope_tables(c, capacity)
        self.cos, self.sin = cuda.to_device(cos), cuda.to_device(sin)
        self.state = MegaState.allocate(c, capacity, len(self.program), len(tables["sizes"]))
        self.stream = cuda.stream()
        self.epoch = 0  # steps run: the counters hold sizes x epoch
        self.settings = [cuda.to_device(a) for a in (np.zeros(2), np.zeros(2, np.int64))]
        self.position = 0  # positions of the cache filled
        self._stops = {}  # end-token sets, on the device

    def _launch(self, feed: np.ndarray, stops: frozenset = frozenset()) -> np.ndarray:
        """Run len(feed) steps, or fewer: the launch ends after a step that chose one of `stops`; -> the token each
        step chose (int32 [steps run]). The epoch and the position advance by the steps run."""
        tokens = self._queue(feed, stops).copy_to_host(stream=self.stream)
        ended = np.flatnonzero(np.isin(tokens, list(stops)) & (np.asarray(feed) < 0))
        if len(ended):  # the steps after the end token did not run
            left = len(feed) - int(ended[0] + 1)
            self.epoch, self.position, tokens = self.epoch - left, self.position - left, tokens[:ended[0] + 1]
        return tokens

    def _queue(self, feed: np.ndarray, stops: frozenset = frozenset()):
        """Queue the launch of len(feed) steps on the stream (ending after a step that chooses one of `stops`); ->
        the device array of the tokens they choose."""
        steps = len(feed)
        if self.position + steps > self.capacity:
            raise ValueError(f"{self.position} + {steps} positions exceed the megakernel's capacity of "
                             f"{self.capacity}")
        if (self.epoch + steps) * self.per_step >= 2**31:
            self.state.counters.copy_to_device(np.zeros(self.state.counters.shape, np.int32), stream=self.stream)
            self.epoch = 0
        out = self._run(self.tables, self.state.counters, self.epoch, self.blocks, feed, self.barriers, stops)
        self.epoch += steps
        self.position += steps
        return out

    def _run(self, t: dict, counters, epoch: int, blocks: int, feed, barriers: int = 0, stops: frozenset = frozenset()):
        """The launch of the program and schedule `t` (device arrays) on `blocks` blocks, from the current position
        (not advanced here), synchronized by counters (barriers 0) or by that many grid barriers a step; -> the
        device array of the tokens the steps choose. stops: end tokens (their device array made once per set)."""
        s, w = self.state, self.w
        if stops not in self._stops:
            self._stops[stops] = cuda.to_device(np.array(sorted(stops), np.int32))
        out = cuda.device_array(len(feed), np.int32, stream=self.stream)
        compiled_once(self.kernel)[blocks, THREADS, self.stream](
            t["ops"], t["waits_start"], t["waits"], t["counter_of"], t["sizes"], t["queue_start"], t["queue"],
            t["phase"], np.int32(barriers), counters, np.int32(epoch),
            cuda.to_device(np.asarray(feed, np.int32), stream=self.stream), out, s.token,
            self._stops[stops], np.int32(self.position),
            *self.settings, np.float32(self.config.rms_eps), self.cos, self.sin, w["embed"], w["attn_norm"], w["w_qkv"],
            w["b_qkv"], w["wo"], w["mlp_norm"], w["w_gu"], w["w_down"], w["final_norm"], w["head"], *s.views)
        return out

    def run_prefix(self, token: int, n: int) -> None:
        """Instructions 0 .. n - 1 of one step for `token` at the current position, in program order on one block,
        with counters of their own (the position does not advance). How `diff.first_kernel_difference` looks inside a
        step."""
        prefix = self.program[:n]
        tables = encode(prefix, [list(range(n))]) | counter_tables(prefix, self.config)
        tables = {k: cuda.to_device(v, stream=self.stream) for k, v in tables.items()}
        counters = cuda.to_device(np.zeros(len(tables["sizes"]) + 1, np.int32), stream=self.stream)
        self._run(tables, counters, 0, 1, [token])
        self.stream.synchronize()

    def prefill(self, ids, sampling=(0.0, None, None, 0)) -> int:
        """Start a sequence: the prompt's tokens fed one step each (one launch), -> the token chosen after them
        (NO_TOKEN on NaN logits). sampling: (temperature, top_k, top_p, seed)."""
        if len(ids) == 0:
            raise ValueError("an empty prompt: nothing to decode from")
        for arr, host in zip(self.settings, device_settings(*sampling), strict=True):
            arr.copy_to_device(np.asarray(host, arr.dtype), stream=self.stream)
        self.position = 0
        return int(self._launch(np.asarray(ids, np.int32))[-1])

    def decode(self, steps: int, stops: frozenset = frozenset()) -> list[int]:
        """The next `steps` tokens, each fed back by the GPU (one launch), or up to the first of `stops` (the end
        tokens: the kernel ends after the step that chose one, every block reading it)."""
        return [int(t) for t in self._launch(np.full(steps, -1, np.int32), frozenset(stops))]

    def timeline(self) -> dict:
        """The last step's instructions on the GPU clock: {"op": [n] names, "block": [n] the block that ran each,
        "wait", "start", "end": [n] microseconds from the step's first stamp (began waiting, began running, done)}."""
        st = self.state.stamps.copy_to_host()
        t0 = st.min()
        block = np.empty(len(self.program), np.int32)
        for b, queue in enumerate(self.schedule.queues):
            block[queue] = b
        return {"op": [ins.op for ins in self.program], "block": block,
                **{k: (st[:, j] - t0) / 1e3 for j, k in enumerate(("wait", "start", "end"))}}

    def step_costs(self, steps: int = 32) -> tuple[float, float]:
        """(GPU ms, host ms) per decode step of a launch of `steps` (the sequence goes on: `steps` positions are
        used). GPU: events around the launch; host: the time to issue it, shared by its steps."""
        start, end = cuda.event(), cuda.event()
        self.stream.synchronize()
        t0 = time.perf_counter()
        start.record(self.stream)
        self._queue(np.full(steps, -1, np.int32))
        end.record(self.stream)
        host = time.perf_counter() - t0
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / steps, 1e3 * host / steps


__all__ = ["Megakernel", "MegaState", "NO_TOKEN", "check_shapes", "row_steps", "stacked_weights"]
