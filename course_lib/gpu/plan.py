"""Step plans: one decode step recorded once and replayed for every token, for one sequence (`StepPlan`) or for the
sequences of a batch (`BatchPlan`, one per batch-size bucket).

Launched from Python, a decode step of the paged recipe costs the host hundreds of launches per token, and the GPU
waits for them. Everything that changes from one token to the next already lives on the device, so the step can be
recorded once and replayed:
- the inputs of the step are buffers, not Python values. A StepPlan's: `x` (the fed token's embedding row, which
  the sampler writes), `position` (its position) and `slot` (its cache row), with the sequence's `page_table`;
  `token` holds the id the sampler chose (the step itself does not read it). A BatchPlan's: one int32 buffer of its
  rows' token ids, positions, slots and page tables, sent from pinned host memory before each step; the step
  embeds the ids itself (`feed_tokens` first puts in each row the token the step before chose, where it is fed
  one), and its chosen ids come back into pinned memory;
- every intermediate is a buffer allocated once under a name (as the fields of llama2.c's RunState: `x`, `q`,
  `attn`, `act`, `logits`, and with the unfused kernels `h`, `h_final`, `k`, `v`, `o`, `gate`, `up`, `down`), and
  every split-K matmul and every completion counter has its own scratch (`Runtime.per_site`);
- the grids are sized for the longest context the plan can reach: flash-decoding's grid holds the chunks of a query at
  `capacity` keys; blocks past a query's own chunks return at once, and a query of two chunks or more is merged
  (by the merge kernel, or by its last blocks in one launch);
- the step ends with the sampler, which chooses the next tokens on the GPU and writes them into host memory that the
  GPU writes directly (StepPlan; BatchPlan copies them back into pinned memory): 4 bytes per token cross to the
  host, not the 4 V bytes of the logits; a sequence's sampler also writes the chosen token's embedding row into `x`,
  so that its next step starts with the first layer.

`run()` launches the recorded list (the arguments flattened once); `capture(steps)` records `steps` steps into a CUDA
graph (course_lib.gpu.graphs), replayed by one call. In the simulator there are no graphs: the same plan runs launch
by launch.
"""

from __future__ import annotations

import time

import numpy as np

from ..kernels import SIMULATOR, cuda, launch, reshaped
from ..kernels import sampling as k_sampling
from .runtime import Runtime

# the batch sizes BatchPlans are recorded for, as serving engines capture a graph per bucket: n sequences run in the
# smallest bucket >= n, the rows past n padding (a bucket of n exactly past the last)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The rows of the plan that runs a batch of n sequences."""
    return next((b for b in BUCKETS if b >= n), n)


class Recorded:
    """The launches of `body` (which queues one step through `rt`) recorded once, then replayed launch by launch
    (`run`) or as a CUDA graph (`capture`, `replay`). `names`: the kernels of a step, in order."""

    def __init__(self, rt: Runtime, body):
        self.rt = rt
        # [(name, kernel, grid, block, args)]: a step's launches (the arrays the flattened ones point at, kept alive)
        self.recorded = rt.record(body, scratch_per_site=True)
        self.names = [name for name, *_ in self.recorded]
        self._launches = [rt.prepared(kernel, grid, block, args) for _, kernel, grid, block, args in self.recorded]
        self._graphs = {}

    @property
    def launches(self) -> int:
        """Kernels per step."""
        return len(self._launches)

    def run(self, steps: int = 1):
        """Queue `steps` steps, launch by launch (arguments flattened once)."""
        for _ in range(steps):
            for go in self._launches:
                go()

    def capture(self, steps: int):
        """A CUDA graph of `steps` steps, captured once (GPU only)."""
        from .graphs import Graph

        if steps not in self._graphs:
            self._graphs[steps] = Graph(lambda: self.run(steps), self.rt.stream)
        return self._graphs[steps]

    def replay(self, steps: int, graph: bool):
        """Queue `steps` steps: one graph launch (graph=True, on a GPU), or launch by launch."""
        if graph and not SIMULATOR:
            self.capture(steps).launch(self.rt.stream)
        else:
            self.run(steps)

    def timeline(self, hold=None) -> list[tuple[str, float, float]]:
        """[(kernel, start ms, end ms)] of one step run launch by launch, relative to the first launch's start: a
        pair of CUDA events around each launch (GPU; hold(stream), queued first, keeps the GPU busy while the host
        queues the step, so that each interval is the kernel's own time), or the host's time around each launch in
        the simulator (there only the names and counts mean something)."""
        stream, marks = self.rt.stream, []
        if SIMULATOR:
            t0 = time.perf_counter()
            for name, go in zip(self.names, self._launches, strict=True):
                start = time.perf_counter()
                go()
                marks.append((name, 1e3 * (start - t0), 1e3 * (time.perf_counter() - t0)))
            return marks
        stream.synchronize()
        if hold is not None:
            hold(stream)
        for name, go in zip(self.names, self._launches, strict=True):
            start, end = cuda.event(), cuda.event()
            start.record(stream)
            go()
            end.record(stream)
            marks.append((name, start, end))
        stream.synchronize()
        first = marks[0][1]
        return [(name, cuda.event_elapsed_time(first, start), cuda.event_elapsed_time(first, end))
                for name, start, end in marks]


class StepPlan(Recorded):
    """The decode step of `backend` (a CudaBackend with the paged cache), recorded once.

    Buffers (all allocated here, once): `token` (the id chosen last), inputs `position`, `slot` ([1] int32 each, views
    of `inputs`), `page_table` [pages] int32, the sampling settings `temperature_top_p` float64 [2] and `top_k_seed`
    int64 [2], `history` [capacity + 1] int32 in mapped host memory (history[p]: the id chosen for position p), the
    sampler's `weights` uint64 [V], the residual stream `x` [1, d_model] float32 (the sampler writes the next token's
    embedding into it: the step has no embedding kernel), and the step's activations and scratch (`rt`'s named pool)."""

    def __init__(self, backend, overlap: bool = False):
        if not backend.paged:
            raise ValueError("a step plan needs the paged cache (recipe 'paged' or later): the baseline's cache grows")
        self.backend, c = backend, backend.config
        self.capacity = backend.capacity
        self.rt = rt = Runtime(fast=backend.rt.fast, reuse=True, overlap=overlap)
        rt.stream = backend.rt.stream  # one stream: the prefill, the steps and the sampler run in order
        self.inputs = rt.empty(3, np.int32, name="inputs")
        self.token, self.position, self.slot = (self.inputs[i:i + 1] for i in range(3))
        self.page_table = rt.empty(backend.cache.pages, np.int32, name="page_table")
        self.temperature_top_p = rt.empty(2, np.float64, name="temperature_top_p")
        self.top_k_seed = rt.empty(2, np.int64, name="top_k_seed")
        self.weights = rt.empty(c.vocab_size, np.uint64, name="sampler_weights")
        self.history = cuda.mapped_array(self.capacity + 1, np.int32)
        self.x = rt.empty((1, c.d_model), np.float32, name="x")  # the residual stream; the sampler embeds into it
        self._staging = {}  # pinned host copies of the inputs, one per buffer
        self._table_sent = None
        super().__init__(rt, self._step)

    def buffers(self) -> dict[str, tuple]:
        """{name: (shape, dtype)} of the plan's named buffers (its RunState)."""
        named = {name: arr for name, arr in self.rt._pool.items() if isinstance(name, str)}
        return {name: (arr.shape, arr.dtype) for name, arr in named.items()} | {
            "history (mapped host memory)": (self.history.shape, self.history.dtype)}

    def _step(self):
        b = self.backend
        logits = b.run_pass(self.rt, self.token, self.position, self.slot, self.page_table, 1, self.capacity,
                            embedded=True)
        self._sample(logits, self.rt)

    def _sample(self, logits, rt):
        """Queue the sampler on logits [1, V]: the token after `position`, the step's inputs advanced, and the
        token's embedding row written into `x`, where the next step's first layer reads it."""
        table, slices = self.backend.w["embed"], k_sampling.SLICES
        launch(k_sampling.sample_next(table), slices, k_sampling.THREADS, 0, rt, reshaped(logits, logits.shape[1]),
               self.weights, self.temperature_top_p, self.top_k_seed, self.token, self.position, self.slot,
               self.page_table, self.backend.cache.page_size, self.history, table, self.x,
               rt.empty(slices, np.float32, name="slice_best"), rt.empty(slices, np.int32, name="slice_best_id"),
               rt.empty(slices, np.int32, name="slice_nan"), rt.counters(1))

    # ---- the host's side ----

    def stage(self, position: int, steps: int, temperature: float, top_k: int | None, top_p: float | None,
              seed: int):
        """Before sampling the token after `position`, then `steps` decode steps: reserve the cache pages they write,
        send the page table when it changed, the position and the sampling settings (seed in [0, 2^63))."""
        cache = self.backend.cache
        last = min(position + steps, self.capacity - 1)  # the last position a step feeds
        if last >= cache.length(0):
            cache.slots(0, last + 1 - cache.length(0))
        self.rt.synchronize()
        table = cache.page_table(0, cache.pages)
        if not np.array_equal(table, self._table_sent):
            self._send(self.page_table, table)
            self._table_sent = table
        self._send(self.inputs, [0, position, -1])
        floats, ints = k_sampling.device_settings(temperature, top_k, top_p, seed)
        self._send(self.temperature_top_p, floats)
        self._send(self.top_k_seed, ints)
        self.history[:] = k_sampling.NO_TOKEN

    def sample(self, logits):
        """Queue the sampler on logits [1, V] of the staged position (the prefill's last token)."""
        self._sample(logits, self.backend.rt)

    def _send(self, device_array, values):
        """Queue a copy of `values` into device_array through a pinned buffer of its own (the stream is idle:
        stage() synchronizes first, so the buffer is free)."""
        host = self._staging.get(id(device_array))
        if host is None:
            host = self._staging[id(device_array)] = cuda.pinned_array(device_array.shape, device_array.dtype)
        host[...] = values
        device_array.copy_to_device(host, stream=self.rt.stream)


class BatchPlan(Recorded):
    """The decode step of `rows` sequences of `backend`'s paged cache (a CudaBackend with the fused step), recorded
    once: every row a sequence fed its last token, each row's attention through its own sequence's page table, each
    row's next token sampled with its own settings at its own position (kernels.sampling.sample_rows).

    Buffers (allocated here, once): `ints` int32 [6 rows + rows * width] holding, in this order, the rows' tokens,
    positions, slots, sequence (row t: t), the position each samples at, the row of the step before whose chosen
    token each is fed (`feed_from`, -1: the token sent), and the page tables [rows, width] (width: pages of the
    backend's capacity); `temperature_top_p` float64 [rows, 2], `top_k_seed` int64 [rows, 2]; the sampler's weights
    uint64 [rows, V]; and the step's activations and scratch (`rt`'s named pool). `chosen` [>= rows] int32, the ids
    the step chooses: the plan's own, or one given to the plans of every bucket (CudaBatch), so that a step can feed
    a row the token that the step before it chose, whatever its bucket. The host fills pinned copies of the inputs,
    two sets taken in turn, and sends them before each step; the chosen ids come back into pinned memory, one buffer
    per set.

    A batch of fewer sequences pads its rows: a padding row feeds token 0 at position 0 into `pad_slot`, a cache row
    no sequence owns, and its token is never read. Rows never mix: a row gets the bits it gets alone."""

    def __init__(self, backend, rows: int, pad_slot: int, chosen=None, overlap: bool = False):
        self.backend, self.rows, self.pad_slot = backend, rows, pad_slot
        c = backend.config
        self.width = -(-backend.capacity // backend.cache.page_size)
        self.rt = rt = Runtime(fast=backend.rt.fast, reuse=True, overlap=overlap)
        if chosen is None:
            chosen = rt.empty(rows, np.int32, name="chosen")
        if chosen.shape[0] < rows:
            raise ValueError(f"a plan of {rows} rows needs `chosen` of {rows} ids at least, got {chosen.shape[0]}")
        self.chosen, self.chosen_rows = chosen, chosen[:rows]
        rt.stream = backend.rt.stream  # one stream: the prefills and the steps run in order
        self.ints = rt.empty(6 * rows + rows * self.width, np.int32, name="inputs")
        self.token, self.position, self.slot, self.seq_of_row, self.sample_at, self.feed_from = (
            self.ints[i * rows:(i + 1) * rows] for i in range(6))
        self.page_tables = self.ints[6 * rows:].reshape(rows, self.width)
        self.temperature_top_p = rt.empty((rows, 2), np.float64, name="temperature_top_p")
        self.top_k_seed = rt.empty((rows, 2), np.int64, name="top_k_seed")
        self.weights = rt.empty((rows, c.vocab_size), np.uint64, name="sampler_weights")
        self._host = [{name: cuda.pinned_array(arr.shape, arr.dtype) for name, arr in (
            ("ints", self.ints), ("temperature_top_p", self.temperature_top_p), ("top_k_seed", self.top_k_seed),
            ("chosen", self.chosen_rows))} for _ in range(2)]
        for host in self._host:
            host["ints"][3 * rows:4 * rows] = np.arange(rows)
        self._done = [None, None]  # per set of pinned buffers: an event after the last step that used it
        self._turn = 0
        super().__init__(rt, self._step)

    def _step(self):
        launch(k_sampling.feed_tokens, -(-self.rows // 64), 64, 0, self.rt, self.token, self.feed_from, self.chosen)
        logits = self.backend.run_pass(self.rt, self.token, self.position, self.slot,
                                       (self.page_tables, self.seq_of_row), self.rows, self.backend.capacity,
                                       all_logits=True)
        launch(k_sampling.sample_rows, self.rows, k_sampling.THREADS, 0, self.rt, logits, self.weights,
               self.temperature_top_p, self.top_k_seed, self.sample_at, self.chosen_rows)

    def start(self, rows: list[tuple], graph: bool):
        """Queue one step of up to `self.rows` sequences, each given as (token fed, its position, its slot, its pages
        [<= width], (temperature_top_p, top_k_seed) of kernels.sampling.device_settings, feed: the row of the step
        queued before this one whose chosen token it is fed instead, or -1), and the copy of the chosen ids back
        to the host. Returns at once, the step queued: a handle for `collect`. graph: replay the step's CUDA graph
        (GPU only)."""
        n, R = len(rows), self.rows
        if not 1 <= n <= R:
            raise ValueError(f"a plan of {R} rows decodes 1 to {R} sequences, not {n}")
        turn, self._turn = self._turn, 1 - self._turn
        if self._done[turn] is not None:
            self._done[turn].synchronize()  # the step that last used these pinned buffers has sent and returned them
        host = self._host[turn]
        ints, floats, settings = host["ints"], host["temperature_top_p"], host["top_k_seed"]
        token, position, slot, sample_at, feed_from = (ints[i * R:(i + 1) * R] for i in (0, 1, 2, 4, 5))
        tables = ints[6 * R:].reshape(R, self.width)
        tokens, positions, slots, pages, row_settings, feeds = zip(*rows, strict=True)
        # the sequences' rows (a column at a time), then padding (greedy, token 0 at position 0 in the padding slot)
        token[:n], position[:n], slot[:n], feed_from[:n] = tokens, positions, slots, feeds
        sample_at[:n] = position[:n] + 1
        floats[:n], settings[:n] = [f for f, _ in row_settings], [s for _, s in row_settings]
        tables[:] = -1
        for r, row_pages in enumerate(pages):
            tables[r, :len(row_pages)] = row_pages
        token[n:], position[n:], slot[n:], sample_at[n:], feed_from[n:] = 0, 0, self.pad_slot, 0, -1
        floats[n:], settings[n:] = 0, 0
        tables[n:, 0] = self.pad_slot // self.backend.cache.page_size
        stream = self.rt.stream
        for name in ("ints", "temperature_top_p", "top_k_seed"):
            getattr(self, name).copy_to_device(host[name], stream=stream)
        self.replay(1, graph)
        self.chosen_rows.copy_to_host(host["chosen"], stream=stream)
        done = self._done[turn] = cuda.event()
        done.record(stream)
        return turn, n

    def collect(self, handle) -> list[int]:
        """The ids a step queued by `start` chose for its sequences (NO_TOKEN for a row whose logits held a NaN),
        once it has ended."""
        turn, n = handle
        self._done[turn].synchronize()
        return self._host[turn]["chosen"][:n].tolist()
