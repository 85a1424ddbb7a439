"""The engine a user keeps: a model made ready once (weights uploaded, kernels compiled, the step plan recorded),
then any number of generations.

    engine = course_lib.Engine(model)                  # backend "auto": the GPU if there is one, else NumPy
    out = engine.generate("Explain what a KV cache is.", chat=True, max_new_tokens=64)

Backends, one interface (what an Engine asks of the object it drives, written down):
    name: str
    capacity: int                    positions the backend's cache holds
    reset()                          forget the sequence; the next prefill starts at position 0
    prefill(ids) -> logits [V]       float32 on the host, of the last of ids
    decode(token) -> logits [V]      the next position's logits
NumpyBackend (the reference) and CudaBackend (the kernels, recipes "baseline" to "paged") implement it, and so can
any object a test hands to Engine. The "plan" and "graph" recipes drive a CudaBackend through a StepPlan instead:
sampling happens on the GPU and the host reads 4 bytes per token.
"""

from __future__ import annotations

import secrets
import time
import weakref
from collections import deque

import numpy as np

from . import reference
from .device import check_fits_simulator, gpu_available
from .generate import Generation, TextStream, check_request, prompt_ids
from .kernels.sampling import NO_TOKEN, sample
from .model.loading import Model
from .recipes import default_recipe, get_recipe


class NumpyBackend:
    """The reference forward pass (course_lib.reference) as a backend."""

    name = "numpy"

    def __init__(self, model: Model, capacity: int):
        self.model, self.capacity = model, capacity
        self.rope = reference.rope_tables(model.config, capacity)
        self.reset()

    def reset(self):
        self.cache = reference.KVCache(self.model.config, self.capacity)  # zeros: pages untouched until written

    def prefill(self, ids) -> np.ndarray:
        return reference.forward(self.model.weights, self.model.config, np.asarray(ids), self.cache, self.rope)

    def decode(self, token: int) -> np.ndarray:
        return reference.forward(self.model.weights, self.model.config, np.asarray([token]), self.cache, self.rope)


class Engine:
    """A model ready to generate. backend: "auto" (the GPU if there is one, else NumPy), "numpy", "cuda", or an
    object with the backend interface (see the top). recipe: a name of course_lib.recipes.RECIPES (CUDA only;
    default: the fastest verified on this machine). capacity: the longest sequence (default: the model's
    context). weights: "bf16" or "f32" on the GPU."""

    def __init__(self, model: Model, backend="auto", recipe: str | None = None, capacity: int | None = None,
                 weights: str = "bf16"):
        self.model = model
        self.capacity = capacity or model.config.max_seq_len
        self.plan, self.recipe = None, None
        if not isinstance(backend, str):
            self.backend = backend
            self.capacity = min(self.capacity, backend.capacity)
        elif backend == "numpy" or (backend == "auto" and not gpu_available()):
            if recipe is not None:
                raise ValueError(f"recipe {recipe!r} runs CUDA kernels: there is no GPU here, and the NumPy backend "
                                 "has no recipes (backend='cuda' runs them in Numba's simulator, tiny models only)")
            self.backend = NumpyBackend(model, self.capacity)
        elif backend in ("cuda", "auto"):
            from .gpu.backend import CudaBackend
            from .gpu.plan import StepPlan

            check_fits_simulator(model.config)
            self.recipe = get_recipe(recipe or default_recipe(gpu_available()))
            self.recipe.check(gpu_available())
            if self.recipe.replay == "megakernel":
                from .megakernel.runner import Megakernel

                self.backend = Megakernel(model, self.capacity, weights=weights)
            else:
                self.backend = CudaBackend(model, self.capacity, weights=weights, ops=self.recipe.ops)
            if self.recipe.replay in ("plan", "graph"):
                self.plan = StepPlan(self.backend, overlap=self.recipe.overlap)
        else:
            raise ValueError(f"unknown backend {backend!r} (backends: auto, numpy, cuda, or a backend object)")
        self.name = getattr(self.backend, "name", type(self.backend).__name__) + (
            f" ({self.recipe.name})" if self.recipe else "")

    def generate(self, prompt: str | list[int], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None, chat: bool = False,
                 stream=None, stop: bool = True) -> Generation:
        """Up to max_new_tokens after the prompt (see course_lib.generate for the arguments)."""
        check_request(max_new_tokens, temperature, top_k, top_p, seed)
        ids = prompt_ids(self.model, prompt, chat)
        if len(ids) + max_new_tokens > self.capacity:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                             f"{'model' if self.capacity == self.model.config.max_seq_len else 'engine'}'s context of "
                             f"{self.capacity} positions")
        seed = secrets.randbits(63) if seed is None else seed % 2**63
        sampling = (temperature, top_k, top_p, seed)
        stops = self.model.tokenizer.stop_ids if stop else frozenset()
        text = TextStream(self.model.tokenizer, stream)
        out, times = [], []

        def take(token: int) -> bool:
            """Record the next token; False when generation is over."""
            if token == NO_TOKEN:
                raise RuntimeError(f"NaN in the logits of position {len(ids) + len(out) - 1}: no token to choose")
            out.append(token)
            times.append(time.perf_counter())
            if token in stops:
                return False
            text.push(token)
            return len(out) < max_new_tokens

        t0 = time.perf_counter()
        if self.recipe is not None and self.recipe.replay == "megakernel":
            self._megakernel_loop(ids, sampling, max_new_tokens, take, stops)
        elif self.plan is None:
            self._host_loop(ids, sampling, take)
        else:
            self._device_loop(ids, sampling, max_new_tokens, take)
        reason = "stop_token" if out[-1] in stops else "max_new_tokens"
        text.close()
        return Generation(ids, out, text.text, reason, times[0] - t0, times[-1] - times[0], self.name,
                          list(np.diff(times)))

    def _host_loop(self, ids, sampling, take):
        """Logits to the host every token, sampled there."""
        b, n = self.backend, 1
        b.reset()
        token = sample(b.prefill(ids), *sampling, position=len(ids))
        while take(token):
            token = sample(b.decode(token), *sampling, position=len(ids) + n)
            n += 1

    def _megakernel_loop(self, ids, sampling, max_new_tokens, take, stops):
        """The prompt in one launch, then launches of steps_per_launch tokens (fewer for the last), read after each;
        a launch ends after the step that chooses one of `stops`."""
        mk, n = self.backend, 1
        if not take(mk.prefill(ids, sampling)):
            return
        while True:
            steps = min(self.recipe.steps_per_launch, max_new_tokens - n)
            for token in mk.decode(steps, stops):
                if not take(token):
                    return
            n += steps

    def _device_loop(self, ids, sampling, max_new_tokens, take):
        """The prefill launched kernel by kernel, then the plan replayed: the GPU chooses every token and the host
        reads each from the plan's history as it arrives, one or two launches behind (a stop token is seen late;
        the tokens computed after it are dropped)."""
        b, plan, recipe = self.backend, self.plan, self.recipe
        b.reset()
        L = len(ids)
        logits = b.forward_on_device(np.asarray(ids, np.int32))  # reserves the prompt's cache rows
        plan.stage(L - 1, max_new_tokens - 1, *sampling)  # ... then those of the steps
        plan.sample(logits)
        graph, per_launch = recipe.replay == "graph", recipe.steps_per_launch
        queued, pending, got = 0, deque(), 0  # decode steps queued; (event, tokens known after it); tokens read

        def mark(n_tokens):
            event = _event()
            event.record(plan.rt.stream)
            pending.append((event, n_tokens))

        mark(1)
        while True:
            while len(pending) < 2 and 1 + queued < max_new_tokens:
                steps = per_launch if 1 + queued + per_launch <= max_new_tokens else 1
                plan.replay(steps, graph)
                queued += steps
                mark(1 + queued)
            event, known = pending.popleft()
            event.synchronize()
            while got < known:
                if not take(int(plan.history[L + got])):
                    plan.rt.synchronize()  # the steps still queued finish before the next generation stages
                    return
                got += 1


def _event():
    from .kernels import cuda

    return cuda.event()


_ENGINES: dict = {}  # (id(model), backend, recipe) -> Engine, dropped with the model


def engine_for(model: Model, backend="auto", recipe: str | None = None) -> Engine:
    """The engine `generate` uses for (model, backend, recipe), built on first use and kept while the model lives:
    the weights are uploaded once, not at every call."""
    if not isinstance(backend, str):
        return Engine(model, backend)
    key = (id(model), backend, recipe)
    engine = _ENGINES.get(key)
    if engine is None or engine.model is not model:
        engine = _ENGINES[key] = Engine(model, backend, recipe)
        weakref.finalize(model, _ENGINES.pop, key, None)
    return engine
