"""A step plan: one decode step of a CudaBackend's sequence, recorded once and replayed for every token.

Launched from Python, a decode step of the paged recipe costs the host hundreds of launches per token, and the GPU
waits for them. Everything that changes from one token to the next already lives on the device, so the step can be
recorded once and replayed:
- the inputs of the step are buffers, not Python values: `token` (the id fed in), `position` (its position) and
  `slot` (its cache row), with the sequence's `page_table`;
- every intermediate is a buffer allocated once under a name (as the fields of llama2.c's RunState: `x`, `q`,
  `attn`, `act`, `logits`, and with the unfused kernels `h`, `h_final`, `k`, `v`, `o`, `gate`, `up`, `down`), and
  every split-K matmul and every completion counter has its own scratch (`Runtime.per_site`);
- the grids are sized for the longest context the plan can reach: flash-decoding launches the chunks of a query at
  `capacity` keys and always merges them (its merge kernel, or its last blocks in one launch); blocks past the
  current context return at once;
- the step ends with `sampling.sample_next`, which chooses the next token on the GPU, writes it into `token`,
  advances `position` and `slot`, and records the id in `history`, host memory the GPU writes directly (4 bytes
  per token cross to the host, not the 4 V bytes of the logits).

`stage()` writes the inputs from the host, outside any replay; `run()` launches the recorded list (the arguments
flattened once); `capture(steps)` records `steps` steps into a CUDA graph (course_lib.gpu.graphs), replayed by one
call. In the simulator there are no graphs: the same plan runs launch by launch.
"""

from __future__ import annotations

import numpy as np

from ..kernels import SIMULATOR, cuda, launch, reshaped
from ..kernels import sampling as k_sampling
from .runtime import Runtime


class StepPlan:
    """The decode step of `backend` (a CudaBackend with the paged cache), recorded once.

    Buffers (all allocated here, once): inputs `token`, `position`, `slot` ([1] int32 each, views of `inputs`),
    `page_table` [pages] int32, the sampling settings `temperature_top_p` float64 [2] and `top_k_seed` int64 [2],
    `history` [capacity + 1] int32 in mapped host memory (history[p]: the id chosen for position p), the sampler's
    `weights` uint64 [V], and the step's activations and scratch (`rt`'s named pool)."""

    def __init__(self, backend):
        if not backend.paged:
            raise ValueError("a step plan needs the paged cache (recipe 'paged' or later): the baseline's cache grows")
        self.backend, c = backend, backend.config
        self.capacity = backend.capacity
        self.rt = rt = Runtime(fast=backend.rt.fast, reuse=True)
        rt.stream = backend.rt.stream  # one stream: the prefill, the steps and the sampler run in order
        self.inputs = rt.empty(3, np.int32, name="inputs")
        self.token, self.position, self.slot = (self.inputs[i:i + 1] for i in range(3))
        self.page_table = rt.empty(backend.cache.pages, np.int32, name="page_table")
        self.temperature_top_p = rt.empty(2, np.float64, name="temperature_top_p")
        self.top_k_seed = rt.empty(2, np.int64, name="top_k_seed")
        self.weights = rt.empty(c.vocab_size, np.uint64, name="sampler_weights")
        self.history = cuda.mapped_array(self.capacity + 1, np.int32)
        self._staging = {}  # pinned host copies of the inputs, one per buffer
        self._table_sent = None
        recorded = rt.record(self._step, scratch_per_site=True)
        self.names = [name for name, *_ in recorded]
        self._arguments = [args for *_, args in recorded]  # the arrays the flattened launches point at, kept alive
        self._launches = [rt.prepared(kernel, grid, block, args) for _, kernel, grid, block, args in recorded]
        self._graphs = {}

    def buffers(self) -> dict[str, tuple]:
        """{name: (shape, dtype)} of the plan's named buffers (its RunState)."""
        named = {name: arr for name, arr in self.rt._pool.items() if isinstance(name, str)}
        return {name: (arr.shape, arr.dtype) for name, arr in named.items()} | {
            "history (mapped host memory)": (self.history.shape, self.history.dtype)}

    @property
    def launches(self) -> int:
        """Kernels per step."""
        return len(self._launches)

    def _step(self):
        b = self.backend
        logits = b.run_pass(self.rt, self.token, self.position, self.slot, self.page_table, 1, self.capacity)
        self._sample(logits, self.rt)

    def _sample(self, logits, rt):
        """Queue the sampler on logits [1, V]: the token after `position`, and the step's inputs advanced."""
        launch(k_sampling.sample_next, 1, k_sampling.THREADS, 0, rt, reshaped(logits, logits.shape[1]),
               self.weights, self.temperature_top_p, self.top_k_seed, self.token, self.position, self.slot,
               self.page_table, self.backend.cache.page_size, self.history)

    # ---- the host's side ----

    def _send(self, device_array, values):
        """Queue a copy of `values` into device_array through a pinned buffer of its own (the stream is idle:
        stage() synchronizes first, so the buffer is free)."""
        host = self._staging.get(id(device_array))
        if host is None:
            host = self._staging[id(device_array)] = cuda.pinned_array(device_array.shape, device_array.dtype)
        host[...] = values
        device_array.copy_to_device(host, stream=self.rt.stream)

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

    def run(self, steps: int = 1):
        """Queue `steps` decode steps, launch by launch (arguments flattened once)."""
        for _ in range(steps):
            for go in self._launches:
                go()

    def capture(self, steps: int):
        """A CUDA graph of `steps` decode steps, captured once (GPU only)."""
        from .graphs import Graph

        if steps not in self._graphs:
            self._graphs[steps] = Graph(lambda: self.run(steps), self.rt.stream)
        return self._graphs[steps]

    def replay(self, steps: int, graph: bool):
        """Queue `steps` decode steps: one graph launch (graph=True), or launch by launch."""
        if graph and not SIMULATOR:
            self.capture(steps).launch(self.rt.stream)
        else:
            self.run(steps)
