"""Many sequences at once: continuous batching over one paged KV cache (after nano-vllm's scheduler).

    outs = course_lib.generate_batch(model, ["Hello", "Explain a KV cache."], max_new_tokens=64, chat=True)

A `Scheduler` keeps a waiting queue and a running set. Each step it admits waiting sequences while the cache has
free pages for their prompt (a prefill), then runs one decode step for every running sequence. A finished sequence
gives its pages back at once, so a waiting one joins the next step. When a running sequence needs a new page and
none is free, the sequence admitted last is preempted: its pages are freed and it goes back to the front of the
queue, to be recomputed when pages free up (its prompt as one prefill, then its tokens one step at a time, exactly
as they were first computed: the same bits, the same continuation).

A sequence's tokens do not depend on what it was batched with: each is sampled from its own logits with its own
seed at its own position (kernels.sampling), and its rows get the bits they get alone. The NumPy backend
(`NumpyBatch`) computes each sequence's rows as the reference does for a sequence alone, over the shared paged
cache (`PagedSequence`). The CUDA backend (`CudaBatch`) runs one decode pass for all the running sequences, recorded
once per bucket of batch sizes and replayed as a CUDA graph (gpu.plan.BatchPlan): their rows side by side in every
matmul, so that each weight read serves them all (the split-K kernels sum a row the same way whatever the number of
rows), and attention in one launch, each row through its own sequence's page table. Its steps are pipelined: the
host queues step k + 1 before it reads the tokens of step k, each row of k + 1 fed the token its sequence's row of k
chose, still on the device; the host's bookkeeping (the next step's inputs, the tokens taken, the sequences
finished) then runs while the GPU computes, not between its steps. A sequence that step k ends (a stop token) has
computed one row of k + 1 for nothing, which is thrown away.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import reference
from .device import check_fits_simulator, gpu_available
from .generate import Generation, TextStream, check_request, prompt_ids
from .gpu.kv_cache import PAGE_SIZE, PagedKVCache
from .kernels import SIMULATOR, cuda
from .kernels.sampling import NO_TOKEN, device_settings, feed, sample, sample_batch
from .model.loading import Model


class PagedSequence:
    """One sequence of a host PagedKVCache, seen as a reference.KVCache: `reference.forward` writes and reads its
    keys and values through the sequence's pages."""

    def __init__(self, cache: PagedKVCache, seq_id, max_len: int):
        cache.add(seq_id, max_len)
        self.cache, self.seq_id, self.capacity = cache, seq_id, max_len
        self.length = 0  # positions computed
        self.reserved = 0  # positions given a slot
        self._rows = np.zeros(max_len, np.int64)  # the cache row (slot) of each position, the first `reserved` set

    @property
    def rows(self) -> np.ndarray:
        """The cache row (slot) of every position reserved."""
        return self._rows[:self.reserved]

    def reserve(self, n: int) -> None:
        """Take the slots of the next n positions (pages from the free list as needed)."""
        self._rows[self.reserved:self.reserved + n] = self.cache.slots(self.seq_id, n)
        self.reserved += n

    def write(self, layer, positions, k, v):
        rows = self.rows[positions]
        self.cache.k[layer][rows] = k
        self.cache.v[layer][rows] = v

    def read(self, layer, end):
        rows = self.rows[:end]
        return self.cache.k[layer][rows], self.cache.v[layer][rows]

    def free(self) -> None:
        self.cache.free(self.seq_id)


@dataclass
class Sequence:
    """A request and its state: its prompt's ids, its sampling settings, its tokens so far."""

    index: int  # position in the list of prompts
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: tuple  # (temperature, top_k, top_p, seed)
    stops: frozenset
    tokens: list[int] = field(default_factory=list)
    kv: PagedSequence | None = None  # while it holds pages
    admitted_at: float = 0.0
    times: list[float] = field(default_factory=list)  # wall clock of each token
    stop_reason: str | None = None  # set when finished
    preemptions: int = 0
    in_flight: int = 0  # decode steps queued for it whose tokens are not taken yet

    @property
    def continues(self) -> bool:
        """Whether it needs another decode step, as far as the host knows: not stopped, and its tokens, those
        taken and those in flight, short of max_new_tokens."""
        return self.stop_reason is None and len(self.tokens) + self.in_flight < self.max_new_tokens

    def pages_to_run(self, page_size: int) -> int:
        """Pages the sequence needs to compute what it has and one more position."""
        return -(-(self.next_position + 1) // page_size)

    @property
    def next_position(self) -> int:
        """The position of the sequence's next token (its length)."""
        return len(self.prompt_ids) + len(self.tokens)

    def take(self, token: int, now: float) -> None:
        """Record the next token, sampled from the logits of the last position (NO_TOKEN: they held a NaN)."""
        if token == NO_TOKEN:
            self.stop_reason = f"error: NaN in the logits of position {self.next_position - 1}"
            return
        self.tokens.append(token)
        self.times.append(now)
        if token in self.stops:
            self.stop_reason = "stop_token"
        elif len(self.tokens) == self.max_new_tokens:
            self.stop_reason = "max_new_tokens"


class Scheduler:
    """The waiting queue and the running set of a batch, bounded by the cache's pages and max_running."""

    def __init__(self, cache: PagedKVCache, max_running: int):
        self.cache, self.max_running = cache, max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def admit(self) -> list[Sequence]:
        """Waiting sequences that fit, in order, moved to the running set (each still to be prefilled)."""
        # the pages of those admitted are taken by their prefill; the running ones may each need one more this step
        admitted, free = [], self.cache.free_pages - self._pages_short()
        while (self.waiting and len(self.running) < self.max_running
               and self.waiting[0].pages_to_run(self.cache.page_size) <= free):
            seq = self.waiting.popleft()
            free -= seq.pages_to_run(self.cache.page_size)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def make_room(self) -> list[Sequence]:
        """Preempt sequences, last admitted first, until every running one has a slot for its next position."""
        preempted = []
        while self._pages_short() > self.cache.free_pages and len(self.running) > 1:
            seq = self.running.pop()
            seq.kv.free()
            seq.kv, seq.preemptions = None, seq.preemptions + 1
            self.waiting.appendleft(seq)
            preempted.append(seq)
        return preempted

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.kv.free()
        seq.kv = None

    def short_of_pages(self) -> bool:
        """Whether the running sequences that go on need more new pages than are free (make_room would preempt)."""
        return self._pages_short() > self.cache.free_pages

    def _pages_short(self) -> int:
        """New pages the running sequences that go on need for one more position each: one for each whose pages are
        full."""
        return sum(s.continues and s.kv.reserved % self.cache.page_size == 0 for s in self.running)


class Runner:
    """What the scheduler's loop drives: a cache shared by the sequences, forward(seq, ids) (the logits [1, V] of
    the last of `ids`, the sequence's next positions), sample(seqs, logits) (their next tokens, each with its own
    settings at its own position), and from those prefill(seq) and recompute(seq); and the decode steps, pipelined:
    start(seqs, feeds) queues one step of each sequence at its next slot and returns a handle, collect(handle) gives
    the step's tokens once it has ended. The loop starts step k + 1 before it collects step k: feeds[i] >= 0 says
    that sequence i is fed the token that row feeds[i] of step k chose (the host has not seen it yet), -1 its last
    token. decode(seqs): one step, each fed its last token, waited for."""

    cache: PagedKVCache

    def forward(self, seq: Sequence, ids: list[int]):
        raise NotImplementedError

    def sample(self, seqs: list[Sequence], logits) -> list[int]:
        raise NotImplementedError

    def start(self, seqs: list[Sequence], feeds: list[int]):
        raise NotImplementedError

    def collect(self, handle) -> list[int]:
        raise NotImplementedError

    def decode(self, seqs: list[Sequence]) -> list[int]:
        return self.collect(self.start(seqs, [-1] * len(seqs)))

    def recompute(self, seq: Sequence):
        """Compute the sequence from the start as it was first computed: its prompt in one pass, then each of its
        tokens but the last (the next decode step feeds that one) in a step of its own: a preempted sequence comes
        back with the same bits. -> the logits [1, V] of the last position computed."""
        logits = self.forward(seq, seq.prompt_ids)
        for token in seq.tokens[:-1]:
            logits = self.forward(seq, [token])
        return logits

    def prefill(self, seq: Sequence) -> int:
        """recompute, then the token sampled from the last logits (a preempted sequence has it already)."""
        return self.sample([seq], self.recompute(seq))[0]


class NumpyBatch(Runner):
    """The NumPy reference over several sequences sharing one paged cache of host arrays (the layout of
    course_lib.gpu.kv_cache.PagedKVCache), a sequence at a time. Its steps are computed when started; it keeps the
    tokens of the last one to feed the next (kernels.sampling.feed, the twin of the GPU's), so that the loop runs
    the same pipelined schedule on it as on the GPU."""

    def __init__(self, model: Model, pages: int, max_len: int, page_size: int = PAGE_SIZE):
        self.model = model
        self.cache = PagedKVCache(model.config, pages, page_size, max_len=max_len, host=True)
        self.rope = reference.rope_tables(model.config, max_len)
        self.chosen = np.zeros(0, np.int32)  # the tokens of the last step started

    def forward(self, seq: Sequence, ids: list[int]) -> np.ndarray:
        seq.kv.reserve(len(ids))
        return reference.forward(self.model.weights, self.model.config, np.asarray(ids), seq.kv, self.rope)[None]

    def sample(self, seqs: list[Sequence], logits: np.ndarray) -> list[int]:
        """Each sequence's token at the position after those it has computed (seq.kv.reserved)."""
        return [sample(row, *seq.sampling, position=seq.kv.reserved) for seq, row in zip(seqs, logits, strict=True)]

    def start(self, seqs: list[Sequence], feeds: list[int]) -> list[int]:
        sent = np.array([seq.tokens[-1] if f < 0 else 0 for seq, f in zip(seqs, feeds, strict=True)], np.int32)
        fed = feed(sent, np.array(feeds, np.int32), self.chosen)
        logits = np.concatenate([self.forward(seq, [int(t)]) for seq, t in zip(seqs, fed, strict=True)])
        self.chosen = np.array(self.sample(seqs, logits), np.int32)
        return self.chosen.tolist()

    def collect(self, handle: list[int]) -> list[int]:
        return handle


class CudaBatch(Runner):
    """The CUDA backend's fused step (gpu.backend.BATCHED: FUSED, with the logits in tiles of rows and attention's
    chunks of keys by paged_attention.BATCH_CHUNKS) over several sequences sharing its paged cache: a pass per
    sequence for its prompt (kernels launched one by one), then each decode step of the running sequences as one
    recorded step plan (gpu.plan.BatchPlan) for the smallest bucket of rows that holds them, replayed as a CUDA graph on
    a GPU: their rows side by side in every matmul, so that each weight read serves them all (every kernel sums a row
    the same way whatever the number of rows), attention in one launch, each row through its own sequence's page table,
    and every row's next token sampled on the GPU (T ids come back, not T x V logits), each kernel launched
    programmatically as in the "overlap" recipe (kernels/overlap.py). Only the rows' bookkeeping is on the host. One
    page of the cache, past the `pages` given to the sequences, holds the padding rows' keys and values."""

    PADDING = "padding rows"

    def __init__(self, model: Model, pages: int, max_len: int, weights: str = "bf16", max_running: int = 64):
        from .gpu.backend import BATCHED, CudaBackend
        from .gpu.plan import bucket

        self.model = model
        self.backend = CudaBackend(model, max_len, weights=weights, ops=BATCHED, pages=pages + 1)
        self.cache = self.backend.cache
        self.cache.free(0)  # the backend's own sequence: the batch's sequences take the pages
        self.cache.add(self.PADDING, 1)
        self.pad_slot = int(self.cache.slots(self.PADDING, 1)[0])
        self.plans = {}  # rows -> BatchPlan, recorded on first use
        # the ids each step chooses, in the rows of its bucket: shared by the plans (a step may feed a row the token of
        # a row of the step before it, whatever their buckets)
        self.chosen = cuda.device_array(bucket(max_running), np.int32)
        self._settings = {}  # sequence index -> its sampling settings as the kernels read them

    def forward(self, seq: Sequence, ids: list[int]):
        """One pass over the sequence's new positions (its prompt, or a token when it is recomputed): its slots
        reserved, one upload (ids, positions, slots, page table), the layers. -> the logits [1, V] of the last
        position, left on the device."""
        b, start = self.backend, seq.kv.reserved
        seq.kv.reserve(len(ids))
        b.rt.begin_pass()
        table = self.cache.page_table(seq.index, -(-seq.kv.reserved // PAGE_SIZE))
        return b.run_pass(b.rt, *b.upload_rows(ids, start, seq.kv.rows[start:], table), len(ids), seq.kv.reserved)

    def sample(self, seqs: list[Sequence], logits) -> list[int]:
        return sample_batch(logits, [seq.sampling for seq in seqs], [seq.next_position for seq in seqs],
                            rt=self.backend.rt).tolist()

    def start(self, seqs: list[Sequence], feeds: list[int]):
        """Queue one step of the sequences through the plan of their bucket (gpu.plan.bucket), each at its next
        slot, fed its last token, or (feeds[i] >= 0) the token row feeds[i] of the step queued before chose."""
        from .gpu.plan import BatchPlan, bucket

        if len(seqs) > self.chosen.shape[0]:
            raise ValueError(f"{len(seqs)} sequences in one step, more than max_running ({self.chosen.shape[0]})")
        rows = bucket(len(seqs))
        plan = self.plans.get(rows)
        if plan is None:
            plan = self.plans[rows] = BatchPlan(self.backend, rows, self.pad_slot, self.chosen, overlap=True)
        inputs = []
        for seq, source in zip(seqs, feeds, strict=True):
            position = seq.kv.reserved
            seq.kv.reserve(1)
            settings = self._settings.get(seq.index)
            if settings is None:
                settings = self._settings[seq.index] = device_settings(*seq.sampling)
            inputs.append((seq.tokens[-1] if source < 0 else 0, position, seq.kv.rows[position],
                           self.cache.pages_of(seq.index), settings, source))
        return plan, plan.start(inputs, graph=not SIMULATOR)

    def collect(self, handle) -> list[int]:
        plan, queued = handle
        return plan.collect(queued)


class BadPromptsError(ValueError):
    """Prompts that generate_batch refused, all reported at once before anything ran: `problems` lists (index in
    the prompts, "(excerpt): what is wrong")."""

    def __init__(self, problems: list[tuple[int, str]]):
        self.problems = problems
        super().__init__(self.report())

    def report(self, name=lambda i: f"prompt {i}") -> str:
        """The message, each problem named by name(index) (the CLI names a prompt by its line in the file)."""
        return "bad prompts, nothing was generated:\n  " + "\n  ".join(f"{name(i)} {text}" for i, text in self.problems)


def generate_batch(model: Model, prompts: list, *, max_new_tokens: int, temperature: float = 0.0,
                   top_k: int | None = None, top_p: float | None = None, seed: int | list[int] | None = None,
                   chat: bool = False, backend="auto", stop: bool = True, pages: int | None = None,
                   max_running: int = 64, on_finish: Callable[[int, Generation], None] | None = None,
                   on_step: Callable[[list[int]], None] | None = None,
                   stats: dict | None = None) -> list[Generation]:
    """One Generation per prompt (a text, or a list of token ids), in the order of `prompts`.

    The arguments are those of course_lib.generate; seed: one for every sequence (each then gives what
    generate(prompt, seed=seed) gives) or a list, one per prompt (None: fresh seeds). backend: "auto" (NumPy
    without a GPU), "numpy" or "cuda". pages: pages of 16 positions in the cache shared by the sequences (default:
    enough for the max_running longest requests to run together); max_running: sequences decoded together at
    most.
    on_finish(index, generation) is called as each sequence ends; on_step(indices) before each decode step, with
    the indices of the sequences it decodes (the scheduler's running set, as a timeline draws it). stats: a dict,
    filled with the host's seconds of each decode step, in order: stats["queue"], queuing the step (its inputs
    filled and sent, its graph launched), and stats["wait"], waiting for the tokens of the step before (a step
    collected before a preemption adds one); the rest of a step's period is the scheduler's bookkeeping (bench).
    Bad prompts (empty, out-of-range ids, longer than the context or than the whole cache with max_new_tokens) are
    reported together, each by its index, before anything runs."""
    check_request(max_new_tokens, temperature, top_k, top_p, None)
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts (texts or lists of token ids)")
    if not (isinstance(max_running, int) and max_running >= 1):
        raise ValueError(f"max_running must be an integer >= 1, got {max_running!r}")
    if backend not in ("auto", "numpy", "cuda"):
        raise ValueError(f"unknown backend {backend!r} (backends: auto, numpy, cuda)")
    if backend == "cuda":
        check_fits_simulator(model.config)
    seeds = _seeds(seed, len(prompts))
    c = model.config
    seqs, problems = [], []
    for i, prompt in enumerate(prompts):
        try:
            ids = prompt_ids(model, prompt, chat)
            need = len(ids) + max_new_tokens
            if need > c.max_seq_len:
                raise ValueError(f"{len(ids)} tokens + max_new_tokens {max_new_tokens} exceed the model's context of "
                                 f"{c.max_seq_len} positions")
            if pages is not None and need > pages * PAGE_SIZE:
                raise ValueError(f"{len(ids)} tokens + max_new_tokens {max_new_tokens} exceed the cache's "
                                 f"{pages} pages of {PAGE_SIZE} positions")
        except (ValueError, TypeError) as e:
            problems.append((i, f"({_excerpt(prompt)}): {e}"))
            continue
        stops = model.tokenizer.stop_ids if stop else frozenset()
        seqs.append(Sequence(i, ids, max_new_tokens, (temperature, top_k, top_p, seeds[i]), stops))
    if problems:
        raise BadPromptsError(problems)
    if pages is None:
        pages = sum(sorted(-(-(len(s.prompt_ids) + max_new_tokens) // PAGE_SIZE) for s in seqs)[-max_running:])
    longest = max(len(s.prompt_ids) + max_new_tokens for s in seqs)  # the longest sequence: it sizes the grids
    if backend == "cuda" or (backend == "auto" and gpu_available()):
        runner = CudaBatch(model, pages, longest, max_running=min(max_running, len(seqs)))
        name = "cuda (fused step, graph per batch size, continuous batching, pipelined steps)"
    else:
        runner, name = NumpyBatch(model, pages, longest), "numpy (continuous batching)"
    return _continuous(model, seqs, runner, name, max_running, on_finish, on_step, stats)


def _continuous(model, seqs, runner, name, max_running, on_finish, on_step, stats=None) -> list[Generation]:
    """The scheduler's loop: admit and prefill, queue one decode step for all, take the tokens of the step before,
    finish, repeat. stats: see generate_batch."""
    if stats is not None:
        stats.update(queue=[], wait=[])
    scheduler = Scheduler(runner.cache, max_running)
    scheduler.waiting.extend(seqs)
    results: dict[int, Generation] = {}
    queued = None  # the step queued and not collected: (its sequences, the runner's handle)

    def done(seq):
        scheduler.finish(seq)
        results[seq.index] = _generation(model, seq, name)
        if on_finish is not None:
            on_finish(seq.index, results[seq.index])

    def collect(step):
        """Take the tokens of a queued step; a sequence that ended before it (its row computed for nothing) takes
        none. Then finish the sequences that ended."""
        if step is None:
            return
        stepped, handle = step
        waited = time.perf_counter()
        tokens = runner.collect(handle)
        if stats is not None:
            stats["wait"].append(time.perf_counter() - waited)
        for seq, token in zip(stepped, tokens, strict=True):
            seq.in_flight -= 1
            if seq.stop_reason is None:
                seq.take(token, time.perf_counter())
        for seq in [s for s in scheduler.running if s.stop_reason]:
            done(seq)

    while scheduler.waiting or scheduler.running:
        admitted = scheduler.admit()
        if not admitted and not scheduler.running:  # nothing runs, so nothing will free a page: never wait forever
            head = scheduler.waiting[0]
            raise RuntimeError(f"the batch cannot go on: prompt {head.index} needs "
                               f"{head.pages_to_run(runner.cache.page_size)} pages, {runner.cache.free_pages} of "
                               f"{runner.cache.pages} are free and no sequence runs (pages not given back?)")
        for seq in admitted:
            seq.kv = PagedSequence(runner.cache, seq.index, len(seq.prompt_ids) + seq.max_new_tokens)
            seq.admitted_at = seq.admitted_at or time.perf_counter()
            if seq.tokens:  # a preempted sequence has its next token already
                runner.recompute(seq)
            else:
                seq.take(runner.prefill(seq), time.perf_counter())
        for seq in [s for s in scheduler.running if s.stop_reason]:
            done(seq)
        if scheduler.short_of_pages():  # preempt only sequences with no token in flight
            collect(queued)
            queued = None
            scheduler.make_room()
        stepping = [s for s in scheduler.running if s.continues]
        step = None
        if stepping:
            rows = {} if queued is None else {seq.index: r for r, seq in enumerate(queued[0])}
            feeds = [rows[seq.index] if seq.in_flight else -1 for seq in stepping]
            if on_step is not None:
                on_step([seq.index for seq in stepping])
            queued_at = time.perf_counter()
            step = (stepping, runner.start(stepping, feeds))
            if stats is not None:
                stats["queue"].append(time.perf_counter() - queued_at)
            for seq in stepping:
                seq.in_flight += 1
        collect(queued)
        queued = step
    return [results[s.index] for s in seqs]


def _generation(model, seq: Sequence, backend: str) -> Generation:
    text = TextStream(model.tokenizer)
    for token in seq.tokens:
        if token not in seq.stops:
            text.push(token)
    text.close()
    times = seq.times or [seq.admitted_at]
    return Generation(seq.prompt_ids, seq.tokens, text.text, seq.stop_reason, times[0] - seq.admitted_at,
                      times[-1] - times[0], backend, list(np.diff(times)), seq.preemptions)


def _seeds(seed, n: int) -> list[int]:
    if isinstance(seed, (list, tuple)):
        if len(seed) != n:
            raise ValueError(f"{len(seed)} seeds for {n} prompts")
        seeds = list(seed)
    else:
        seeds = [seed] * n
    for s in seeds:
        check_request(1, 0.0, None, None, s)
    return [secrets.randbits(63) if s is None else int(s) % 2**63 for s in seeds]


def _excerpt(prompt, width: int = 40) -> str:
    """A prompt as an error names it: its repr, whole quotes and brackets, cut to about `width` characters."""
    if isinstance(prompt, str):
        return repr(prompt) if len(prompt) <= width else repr(prompt[:width - 5]) + "..."
    if not hasattr(prompt, "__iter__"):
        return repr(prompt)[:width]
    ids = list(prompt)
    return repr(ids) if len(ids) <= 8 else repr(ids[:8])[:-1] + ", ...]"
