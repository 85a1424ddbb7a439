"""Benchmarks: the copy bandwidth of this GPU, and decode speed against the bound it implies.

Used by `python -m course_lib bench` and the notebooks; the tests check what they report, never their timings.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np

from ..device import by_mode
from ..kernels import SIMULATOR, cuda
from ..kernels import copy as k_copy
from . import accounting
from .profiler import profile_decode, time_decode


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up: compile and load
    return float(np.median([_elapsed(run, cuda.default_stream()) for _ in range(repeats)]))


def measure_bandwidth(n_bytes: int = 4 << 30, repeats: int = 10) -> dict[str, float]:
    """Device copy bandwidth in bytes/s, counting bytes read plus bytes written, of n_bytes of random data
    (never zeros): through our copy kernel (32 blocks per SM) and through the driver's device-to-device copy.
    The median of `repeats` copies each, timed with CUDA events. The larger is the bound we compare with."""
    n = n_bytes // 4
    src = cuda.to_device(np.random.default_rng(0).standard_normal(n, dtype=np.float32))
    dst = cuda.device_array(n, np.float32)
    blocks = 32 * cuda.get_current_device().MULTIPROCESSOR_COUNT
    kernel_s = _median_seconds(lambda: k_copy.copy(src, dst, blocks=blocks), repeats)
    assert np.array_equal(dst[-4096:].copy_to_host(), src[-4096:].copy_to_host())
    driver_s = _median_seconds(lambda: dst.copy_to_device(src), repeats)
    return {"copy kernel": 2 * n_bytes / kernel_s, "driver memcpy": 2 * n_bytes / driver_s}


def bench_decode(model, bandwidth: float, weights: str = "bf16", context: int = 64, steps: int = 50,
                 fast_launch: bool = True, ops: dict | None = None, label: str = "baseline") -> dict:
    """Decode speed of the CUDA backend after a prompt of `context` tokens; one row of the bench table."""
    from ..gpu.backend import CudaBackend

    c = model.config
    ids = np.random.default_rng(1).integers(0, c.vocab_size, context)
    backend = CudaBackend(model, context + steps + 2, weights=weights, fast_launch=fast_launch, ops=ops)
    token = int(np.argmax(backend.prefill(ids)))
    backend.decode(token)  # warm-up
    step = profile_decode(backend, token)
    ms = time_decode(backend, token, steps)
    wbytes = 2 if weights == "bf16" else 4
    moved = accounting.decode_cost(c, context + steps // 2, weight_bytes=wbytes).bytes
    bound = accounting.tokens_per_s_bound(c, bandwidth, context + steps // 2, weight_bytes=wbytes)
    return {"step": label, "weights": weights, "launch": "fast" if fast_launch else "dispatcher",
            "tokens_per_s": 1e3 / ms,
            "ms_per_token": ms, "GB_per_s": moved / (ms / 1e3) / 1e9, "bound_tokens_per_s": bound,
            "percent_of_bound": 100 * (1e3 / ms) / bound, "kernels_per_token": step.launches,
            "allocations_per_token": step.allocations, "busy_fraction": step.busy_fraction, "profile": step}


def format_rows(rows: list[dict]) -> str:
    head = (f"{'step':<20}{'weights':<8}{'launch':<11}{'tok/s':>9}{'ms/tok':>9}{'GB/s':>9}{'bound tok/s':>13}"
            f"{'% bound':>9}{'kernels/tok':>12}{'allocs/tok':>11}" + ("  same text" if "same_text" in rows[0] else ""))
    lines = [head]
    for r in rows:
        same = f"  {'yes' if r['same_text'] else 'NO'}" if "same_text" in r else ""
        lines.append(f"{r['step']:<20}{r['weights']:<8}{r['launch']:<11}{r['tokens_per_s']:>9.1f}{r['ms_per_token']:>9.3f}"
                     f"{r['GB_per_s']:>9.1f}{r['bound_tokens_per_s']:>13.0f}{r['percent_of_bound']:>8.2f}%"
                     f"{r['kernels_per_token']:>12}{r['allocations_per_token']:>11}{same}")
    return "\n".join(lines)


def _gb_per_s(run, buffers: list, nbytes: int, repeats: int, graph: bool = False) -> float:
    """GB/s of `nbytes` moved by run(buffer, stream=s), on the buffers in turn, GPU time only, timed by events
    around `repeats` runs back to back, with launch overhead left out in one of two ways:
    - graph=False: a `hold` kernel keeps the GPU busy while the host queues the runs on the default stream. Each
      kernel still waits for the GPU to start it after the previous one ends (1.6 us for an empty kernel on
      the H200): the cost of kernels launched one by one.
    - graph=True: the runs captured once as a CUDA graph (course_lib.gpu.graphs) on a stream of their own; the median
      of 5 replays. The GPU knows each next kernel in advance (0.85 us between empty kernels): the cost inside a
      graph, where a whole decode step can run.
    No array is freed while timing (arrays the runs allocate outlive the replays)."""
    stream = cuda.stream() if graph else cuda.default_stream()
    run(buffers[0], stream=stream)  # compile and load
    stream.synchronize()

    def runs():
        for i in range(repeats):
            run(buffers[i % len(buffers)], stream=stream)

    with cuda.defer_cleanup():
        if graph:
            from ..gpu.graphs import Graph

            g = Graph(runs, stream)
            g.launch(stream)  # first replay: uploads the graph
            seconds = float(np.median([_elapsed(partial(g.launch, stream), stream) for _ in range(5)]))
        else:
            k_copy.hold[1, 1, stream](20_000)
            seconds = _elapsed(runs, stream)
    return nbytes * repeats / seconds / 1e9


def us_per_call(run, buffers: list, nbytes: int, repeats: int, graph: bool = False) -> float:
    """Microseconds of GPU time per run(buffer, stream=s), timed as _gb_per_s times it (nbytes: what a run reads;
    it cancels out)."""
    return 1e-3 * nbytes / _gb_per_s(run, buffers, nbytes, repeats, graph)


def _elapsed(queue, stream) -> float:
    """Seconds of GPU time between events recorded on `stream` before and after queue() (waits for the end)."""
    start, end = cuda.event(), cuda.event()
    start.record(stream)
    queue()
    end.record(stream)
    end.synchronize()
    return cuda.event_elapsed_time(start, end) / 1e3


def _torch_gb_per_s(torch, run, buffers: list, nbytes: int, repeats: int, graph: bool = False) -> float:
    """_gb_per_s for PyTorch's run(buffer): on the default stream after a hold, or (graph) captured and replayed
    as a torch.cuda.CUDAGraph, the same way."""
    if not graph:
        return _gb_per_s(lambda b, stream: run(b), buffers, nbytes, repeats)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants (workspaces, handles)
        run(buffers[0])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(repeats):
            run(buffers[i % len(buffers)])
    g.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return nbytes * repeats / float(np.median(times)) / 1e9


def _copies(nbytes: int) -> int:
    """How many copies of an nbytes array the timed runs rotate over: enough for 256 MB, so that each run reads
    from memory, not from the 50 MB L2 cache (2 in the simulator)."""
    return by_mode(max(2, -(-(256 << 20) // nbytes)), 2)


def read_bandwidth(nbytes: int, repeats: int = 30, graph: bool = False) -> float:
    """GB/s of one plain read of `nbytes` (copy.read, GPU time, see _gb_per_s), rotating over >= 256 MB of arrays
    so that they come from memory: the most one kernel that reads nbytes once reaches on this GPU, its fixed costs
    (launch, ramp-up, tail) included. Small reads fall far below the copy bandwidth; matmuls and attention are
    compared with this at their own sizes, timed the same way (graph or not)."""
    host = np.random.default_rng(0).standard_normal(max(8, nbytes // 32 * 8), dtype=np.float32)
    arrays = [cuda.to_device(host) for _ in range(_copies(host.nbytes))]
    out = k_copy.read(arrays[0])
    return _gb_per_s(partial(k_copy.read, out=out), arrays, host.nbytes, repeats, graph)


def torch_cuda():
    """PyTorch, when it is installed and sees a GPU (the peers of the kernels), else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def matmul_bandwidth(shapes: list[tuple[int, int]], weights: str = "bf16", rows: int = 1, repeats: int = 30,
                     graph: bool = False) -> list:
    """GB/s of weight bytes per matmul kernel (GPU time, see _gb_per_s: kernels launched one by one, or replayed
    in a CUDA graph with graph=True), for each weight shape (K, N): the tiled
    baseline, the narrow split-K kernel on b [K, N], and the transposed kernel on the same
    weights stored as [N, K]. The runs rotate over enough copies of the weights (>= 256 MB) that they come from
    memory, not from the 50 MB L2 cache. With PyTorch on the GPU, "torch": torch.nn.functional.linear on the
    [N, K] weights (cuBLAS), activations in the weights' dtype, timed the same way (both use the default stream).
    "read": a plain read of the same bytes (read_bandwidth), the ceiling at this size."""
    from ..kernels import matmul as k_matmul
    from ..kernels import narrow as k_narrow
    from ..model.safetensors_io import f32_to_bf16

    rng = np.random.default_rng(0)
    out = []
    for K, N in shapes:
        host = rng.standard_normal((K, N), dtype=np.float32) / np.float32(np.sqrt(K))
        host = f32_to_bf16(host) if weights == "bf16" else host
        copies = _copies(host.nbytes)
        a = cuda.to_device(rng.standard_normal((rows, K), dtype=np.float32))
        row = {"K": K, "N": N, "MB": host.nbytes / 1e6, "read": read_bandwidth(host.nbytes, repeats, graph)}
        kn = [cuda.to_device(host) for _ in range(copies)]
        row["tiled"] = _gb_per_s(partial(k_matmul.matmul, a), kn, host.nbytes, repeats, graph)
        row["narrow"] = _gb_per_s(partial(k_narrow.matmul_narrow, a), kn, host.nbytes, repeats, graph)
        del kn
        nk = [cuda.to_device(np.ascontiguousarray(host.T)) for _ in range(copies)]
        row["transposed"] = _gb_per_s(partial(k_narrow.matmul_transposed, a), nk, host.nbytes, repeats, graph)
        del nk
        torch = torch_cuda()
        if torch is not None:
            dtype = torch.bfloat16 if weights == "bf16" else torch.float32
            w_t = torch.from_numpy(np.ascontiguousarray(host.T).view(np.int16 if weights == "bf16" else np.float32))
            w_t = w_t.view(dtype)  # the same bits
            ws = [w_t.cuda() for _ in range(copies)]
            x = torch.from_numpy(a.copy_to_host()).cuda().to(dtype)
            row["torch"] = _torch_gb_per_s(torch, partial(torch.nn.functional.linear, x), ws, host.nbytes, repeats,
                                           graph)
            del ws
        out.append(row)
    return out


def _swiglu_variants(x, d_ff: int) -> dict:
    """{name: run(w, stream)} of SwiGLU's projections for the rows x [M, d] (see swiglu_times), w = (w_gate, w_up,
    w_gu), into buffers allocated here once (nothing is allocated while a graph is captured)."""
    from ..kernels import elementwise as k_elt
    from ..kernels import fused as k_fused
    from ..kernels import matmul as k_matmul
    from ..kernels import narrow as k_narrow

    gate, up, act = (cuda.device_array((x.shape[0], d_ff), np.float32) for _ in range(3))

    def narrow(w, stream):
        k_narrow.matmul_narrow(x, w[0], out=gate, stream=stream)
        k_narrow.matmul_narrow(x, w[1], out=up, stream=stream)
        k_elt.silu_mul(gate, up, out=act, stream=stream)

    def tiled(w, stream):
        k_matmul.matmul(x, w[0], gate, stream)
        k_matmul.matmul(x, w[1], up, stream)
        k_elt.silu_mul(gate, up, out=act, stream=stream)

    return {"narrow": narrow,
            "narrow fused": lambda w, stream: k_fused.gate_up_swiglu(x, w[2], None, act, stream=stream),
            "tiled": tiled,
            "two passes": lambda w, stream: k_fused.swiglu_two_passes(x, w[0], w[1], act, stream),
            "interleaved": lambda w, stream: k_fused.swiglu_interleaved(x, w[2], act, stream)}


def swiglu_times(d: int, d_ff: int, rows: list[int], weights: str = "bf16", repeats: int = 20) -> list[dict]:
    """Microseconds of GPU time per call of SwiGLU's projections, silu(x @ w_gate) * (x @ w_up) for x [M, d], at each
    M of `rows`, graph-timed (_gb_per_s), unfused against fused: the library's split-K matmuls ("narrow": two
    matmuls and silu_mul; "narrow fused": one kernel on the interleaved columns, kernels.fused.gate_up_swiglu; beyond
    four rows both sum their slices in tiles, a launch per 64 rows) and the tiled ones ("tiled": two matmuls and
    silu_mul; "two passes" and "interleaved": the paper's two strategies, kernels.fused). -> [{"M": M, variant: us,
    ...}]."""
    from ..kernels.fused import interleave_gate_up
    from ..model.safetensors_io import f32_to_bf16

    rng = np.random.default_rng(0)
    host = [rng.standard_normal((d, d_ff), dtype=np.float32) / np.float32(np.sqrt(d)) for _ in range(2)]
    host = [f32_to_bf16(w) if weights == "bf16" else w for w in host]
    nbytes = 2 * host[0].nbytes
    copies = [(cuda.to_device(host[0]), cuda.to_device(host[1]), cuda.to_device(interleave_gate_up(*host)))
              for _ in range(_copies(nbytes))]
    out = []
    for M in rows:
        x = cuda.to_device(rng.standard_normal((M, d), dtype=np.float32))
        out.append({"M": M} | {name: us_per_call(run, copies, nbytes, repeats, graph=True)
                               for name, run in _swiglu_variants(x, d_ff).items()})
    return out


def attention_bandwidth(config, lengths: list[int], repeats: int = 30, graph: bool = False) -> list[dict]:
    """GB/s of keys and values read by one decode step's attention (one query, float32 cache, GPU time, see
    _gb_per_s: kernels launched one by one, or replayed in a CUDA graph with graph=True), at each context
    length: the baseline kernel over a contiguous cache, and flash-decoding over a paged cache (pages of 16 in
    shuffled order). The runs rotate over enough caches (>= 256 MB) that they come
    from memory, not from the L2 cache. With PyTorch on the GPU, "torch": its scaled_dot_product_attention on a
    contiguous cache (enable_gqa). "read": a plain read of the same bytes (read_bandwidth), the ceiling at this
    size. Rows: {"context", "MB", "read", "baseline", "flash", "chunks"[, "torch"]}."""
    from ..kernels import attention as k_attention
    from ..kernels import paged_attention as k_paged

    rng = np.random.default_rng(0)
    H, Hkv, hd, page = config.n_heads, config.n_kv_heads, config.head_dim, 16
    q = cuda.to_device(rng.standard_normal((1, H, hd), dtype=np.float32))
    out = []
    for n in lengths:
        pages = -(-n // page)
        kv = rng.standard_normal((2, pages * page, Hkv, hd), dtype=np.float32)
        copies = _copies(kv.nbytes)
        caches = [(cuda.to_device(kv[0]), cuda.to_device(kv[1])) for _ in range(copies)]
        positions = cuda.to_device(np.array([n - 1], np.int32))
        table = cuda.to_device(rng.permutation(pages).astype(np.int32))
        nbytes = 2 * n * Hkv * hd * 4
        row = {"context": n, "MB": nbytes / 1e6, "read": read_bandwidth(nbytes, repeats, graph),
               "chunks": k_paged.chunks_for(n, H, Hkv, hd)[1]}
        def baseline(c, stream, n=n, positions=positions):
            return k_attention.attention(q, c[0][:n], c[1][:n], positions, stream=stream)

        def flash(c, stream, n=n, positions=positions, table=table):
            return k_paged.flash_attention(q, c[0], c[1], table, positions, page, n, stream=stream)

        row["baseline"] = _gb_per_s(baseline, caches, nbytes, repeats, graph)
        row["flash"] = _gb_per_s(flash, caches, nbytes, repeats, graph)
        del caches
        torch = torch_cuda()
        if torch is not None:  # [1, heads, positions, hd], the first n positions
            q_t = torch.from_numpy(q.copy_to_host()).cuda().transpose(0, 1)[None]
            kv_t = [torch.from_numpy(kv[:, :n]).cuda().permute(0, 2, 1, 3)[:, None].contiguous() for _ in range(copies)]
            sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q_t, enable_gqa=True)
            row["torch"] = _torch_gb_per_s(torch, lambda c, sdpa=sdpa: sdpa(c[0], c[1]), kv_t, nbytes, repeats, graph)
            del kv_t
        out.append(row)
    return out


def measure_launch_overhead(n: int = 2000) -> dict:
    """Host microseconds per launch of a tiny kernel (8 array arguments, as in the model's kernels), through
    Numba's dispatcher and through the runtime's fast path. The GPU work is negligible; launches queue up."""
    from ..gpu.runtime import Runtime

    arrays = [cuda.to_device(np.ones(32, np.float32)) for _ in range(2)]
    src, dst = arrays
    out = {}
    for label, fast in (("dispatcher", False), ("fast", True)):
        rt = Runtime(fast=fast)
        k_copy.copy(src, dst, blocks=1, rt=rt)  # compile / prepare
        rt.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            k_copy.copy(src, dst, blocks=1, rt=rt)
        elapsed = time.perf_counter() - t0
        rt.synchronize()
        out[label] = elapsed / n * 1e6
    return out


def gpu_name() -> str:
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def kernel_gaps(n: int = 500) -> dict[str, float]:
    """GPU microseconds per tiny kernel (a copy of 32 floats) when n of them run back to back: launched one by one
    behind a `hold` kernel (so no kernel waits for the host; each still waits for the GPU to start it), and
    replayed from a CUDA graph (the GPU knows the next kernel in advance)."""
    from ..gpu.graphs import Graph

    src, dst, stream = cuda.to_device(np.ones(32, np.float32)), cuda.device_array(32, np.float32), cuda.stream()

    def queue():
        for _ in range(n):
            k_copy.copy(src, dst, blocks=1, stream=stream)

    queue()
    graph = Graph(queue, stream)
    graph.launch(stream)  # the first replay uploads the graph
    out = {}
    for label, run in (("launched one by one", queue), ("graph replay", lambda: graph.launch(stream))):
        k_copy.hold[1, 1, stream](100 * n)  # longer than the host takes to queue n launches
        out[label] = 1e6 * _elapsed(run, stream) / n
    return out


def overlap_chain(links: int, n: int, overlap: bool):
    """(plan, check): a step plan of `links` kernels (copy.plus_one over n floats, blocks of copy.THREADS), each
    reading what the one before wrote, two buffers in turn, recorded with overlapping launches or not; check()
    resets the first buffer to zeros, runs the plan once (its CUDA graph on a GPU) and returns the result, which
    must be `links` everywhere (a link that read its input before the previous one had written it would leave less).
    """
    from ..gpu.plan import Recorded
    from ..gpu.runtime import Runtime

    rt = Runtime(reuse=True, overlap=overlap)
    buffers = cuda.to_device(np.zeros(n, np.float32)), cuda.device_array(n, np.float32)

    def body():
        for i in range(links):
            rt.launch("plus_one", k_copy.plus_one, -(-n // k_copy.THREADS), k_copy.THREADS, buffers[i % 2],
                      buffers[1 - i % 2])

    plan = Recorded(rt, body)

    def check():
        buffers[0].copy_to_device(np.zeros(n, np.float32), stream=rt.stream)
        plan.replay(1, graph=not SIMULATOR)
        return buffers[links % 2].copy_to_host(stream=rt.stream)

    return plan, check


def overlap_gaps(links: int = 200, n: int = 32 * 1024, repeats: int = 20) -> dict[str, float]:
    """GPU microseconds per kernel of a chain of `links` dependent kernels (overlap_chain) replayed as a CUDA graph,
    launched one after the other's end and launched programmatically; raises if a chain's result is wrong."""
    out = {}
    for label, overlap in (("after the previous ends", False), ("programmatic", True)):
        plan, check = overlap_chain(links, n, overlap)
        if not np.all(check() == links):
            raise RuntimeError(f"a chain of {links} kernels ({label}) computed a wrong result")
        replay = partial(plan.replay, 1, True)
        out[label] = 1e6 * _elapsed(lambda r=replay: [r() for _ in range(repeats)], plan.rt.stream) / (
            repeats * links)
    return out


def bound_bandwidth(n_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s of one streaming read of n_bytes of random data (copy.read, 16-byte loads, the median of `repeats`,
    timed with CUDA events). `run_bench` takes the higher of this and the copy bandwidth as the bound of every
    share it prints."""
    src = cuda.to_device(np.random.default_rng(0).standard_normal(n_bytes // 4, dtype=np.float32))
    out = k_copy.read(src)
    return n_bytes / _median_seconds(lambda: k_copy.read(src, out=out), repeats)


def _random_prompt(config, n: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(1).integers(0, config.vocab_size, n)]


def _plan_step_costs(plan, graph: bool, position: int, repeats: int = 5) -> tuple[float, float]:
    """(GPU ms, host ms) of one replayed step, medians of `repeats`. Host: the time to issue the step, the GPU idle
    before it. GPU: events around the step queued behind a `hold` kernel, so that no kernel waits for the host."""
    plan.stage(position, 2 * repeats + 1, 0.0, None, None, 0)
    stream, host = plan.rt.stream, []
    for _ in range(repeats):
        stream.synchronize()
        t0 = time.perf_counter()
        plan.replay(1, graph)
        host.append(time.perf_counter() - t0)
    return held_step_ms(plan, graph, int(3e6 * max(host)) + 1_000, repeats), 1e3 * float(np.median(host))


def held_ms(queue, stream, hold_us: int, repeats: int) -> float:
    """GPU ms of what queue() queues on `stream`, median of `repeats`: events around it (_elapsed), queued behind a
    `hold` kernel of hold_us (longer than the host takes to queue it), so that no kernel waits for the host."""
    times = []
    for _ in range(repeats):
        k_copy.hold[1, 1, stream](hold_us)
        times.append(1e3 * _elapsed(queue, stream))
    return float(np.median(times))


def held_step_ms(plan, graph: bool, hold_us: int, repeats: int) -> float:
    """GPU ms of one replayed step of a recorded plan (gpu.plan.Recorded), median of `repeats` (held_ms)."""
    return held_ms(lambda: plan.replay(1, graph), plan.rt.stream, hold_us, repeats)


def bench_recipe(model, name: str, bandwidth: float, context: int = 64, steps: int = 200,
                 weights: str = "bf16") -> dict:
    """One row of the progression: recipe `name` decoding `steps` greedy tokens after a random prompt of `context`
    tokens. tokens/s from the generator itself (a warm engine: compilation and capture done); GPU and host time
    per step, kernels per step; the share of the bound at the middle context."""
    from ..engine import Engine
    from ..recipes import get_recipe

    recipe, c = get_recipe(name), model.config
    engine = Engine(model, "cuda", recipe=name, capacity=context + steps + 32, weights=weights)
    ids = _random_prompt(c, context)
    engine.generate(ids, max_new_tokens=4, stop=False)  # warm-up: compile, record, capture
    out = engine.generate(ids, max_new_tokens=steps, stop=False)
    if recipe.replay == "megakernel":  # one kernel for steps_per_launch steps
        engine.backend.prefill(ids)
        gpu_ms, host_ms = engine.backend.step_costs(recipe.steps_per_launch)
        kernels = 1
    elif engine.plan is None:
        step = profile_decode(engine.backend, out.token_ids[-1], queued=True)
        gpu_ms, host_ms, kernels = step.gpu_ms, time_decode(engine.backend, out.token_ids[-1], 5), step.launches
    else:
        gpu_ms, host_ms = _plan_step_costs(engine.plan, recipe.replay == "graph", context)
        kernels = engine.plan.launches
    bound = accounting.tokens_per_s_bound(c, bandwidth, context + steps // 2, 2 if weights == "bf16" else 4)
    return {"recipe": name, "notebook": recipe.notebook, "weights": weights, "tokens_per_s": out.decode_tokens_per_s,
            "ms_per_token": 1e3 / out.decode_tokens_per_s, "gpu_ms_per_token": gpu_ms, "host_ms_per_token": host_ms,
            "kernels_per_token": kernels, "host_launches_per_token": kernels if recipe.replay in ("launches", "plan")
            else 1 / recipe.steps_per_launch, "bound_tokens_per_s": bound,
            "percent_of_bound": 100 * out.decode_tokens_per_s / bound}


def reference_tokens(model, weights: str, n_tokens: int, prompt: str) -> list[int]:
    """The NumPy reference's greedy tokens, on the weights as the GPU stores them (rounded to bf16 for "bf16")."""
    import dataclasses

    from ..engine import Engine
    from ..model.weights import round_to_bf16

    ref = model if weights == "f32" else dataclasses.replace(model, weights=round_to_bf16(model.weights))
    return Engine(ref, "numpy").generate(prompt, max_new_tokens=n_tokens, stop=False).token_ids


def recipe_tokens(model, name: str, weights: str, n_tokens: int, prompt: str) -> list[int]:
    from ..engine import Engine

    return Engine(model, "cuda", recipe=name, weights=weights, capacity=256).generate(
        prompt, max_new_tokens=n_tokens, stop=False).token_ids


def run_bench(model, recipes=None, weights: str = "bf16", context: int = 64, steps: int = 200, peers: bool = True,
              check_tokens: int = 32, prompt: str = "The capital of France is", progress=None) -> dict:
    """The `bench` command: the bound, then every recipe of the progression (recipes.RECIPES) with its tokens/s,
    GPU and host time per token, kernels per token, share of the bound and a same-text check against the NumPy
    reference, then the PyTorch peers of the same shapes in the same run when PyTorch sees the GPU.
    -> {"bound": ..., "rows": [...], "peers": {...}, ...}; `format_bench` prints it."""
    from ..recipes import RECIPES

    c = model.config
    names = list(RECIPES) if recipes is None else list(recipes)
    say = progress or (lambda msg: None)
    say("measuring the read bandwidth")
    result = {"model": c.name, "params": c.n_params(), "context": context, "steps": steps, "weights": weights,
              "gpu": gpu_name(), "date": time.strftime("%Y-%m-%d"),
              "read_bandwidth": bound_bandwidth(), "copy_bandwidth": max(measure_bandwidth().values())}
    result["bound_bandwidth"] = max(result["read_bandwidth"], result["copy_bandwidth"])  # the highest of the methods
    say("reference tokens (NumPy)")
    expected = reference_tokens(model, weights, check_tokens, prompt)
    result["rows"] = []
    for name in names:
        say(f"recipe {name}")
        row = bench_recipe(model, name, result["bound_bandwidth"], context, steps, weights)
        row["same_text"] = recipe_tokens(model, name, weights, check_tokens, prompt) == expected
        result["rows"].append(row)
    torch = torch_cuda() if peers else None
    if torch is not None:
        from . import peers as torch_peers

        say("PyTorch peers (torch.compile takes a minute)")
        result["peers"] = torch_peers.tokens_per_s(torch, c, steps=steps, context=context,
                                                   max_len=context + steps + 32)
    result["bound_tokens_per_s"] = accounting.tokens_per_s_bound(c, result["bound_bandwidth"], context + steps // 2,
                                                                 2 if weights == "bf16" else 4)
    return result


def format_bench(r: dict) -> str:
    lines = [f"{r['model']} ({r['params'] / 1e6:.1f}M parameters, {r['weights']} weights) on {r['gpu']}: "
             f"greedy decode of {r['steps']} tokens after {r['context']}",
             f"bound: {r['bound_bandwidth'] / 1e12:.2f} TB/s, the higher of a streaming read of 1 GiB "
             f"({r['read_bandwidth'] / 1e12:.2f} TB/s) and a copy ({r['copy_bandwidth'] / 1e12:.2f} TB/s, read + "
             f"write) -> {r['bound_tokens_per_s']:,.0f} tokens/s",
             f"{'recipe':<12}{'nb':<8}{'tok/s':>9}{'ms/tok':>9}{'GPU ms':>9}{'host ms':>9}{'kernels':>9}"
             f"{'launches':>10}{'% bound':>9}  same text"]
    for row in r["rows"]:
        lines.append(f"{row['recipe']:<12}{row['notebook']:<8}{row['tokens_per_s']:>9.1f}{row['ms_per_token']:>9.3f}"
                     f"{row['gpu_ms_per_token']:>9.3f}{row['host_ms_per_token']:>9.3f}{row['kernels_per_token']:>9}"
                     f"{row['host_launches_per_token']:>10.3g}{row['percent_of_bound']:>8.2f}%  "
                     f"{'yes' if row['same_text'] else 'NO'}")
    for mode, tps in r.get("peers", {}).items():
        lines.append(f"{'torch ' + mode:<20}{tps:>9.1f}{1e3 / tps:>9.3f}{'':>37}"
                     f"{100 * tps / r['bound_tokens_per_s']:>8.2f}%  (random weights, same shapes)")
    lines.append("ms/tok: wall time per token of the generator; GPU ms: kernels of one step; host ms: the host's time "
                 "to issue one step; kernels: per step; launches: host launches per token")
    return "\n".join(lines)


def bench_batch(model, sizes, context: int = 64, steps: int = 64, weights: str = "bf16") -> list[dict]:
    """Aggregate decode throughput of generate_batch on the CUDA backend (the fused step over B sequences, course_lib
    .batch) for each batch size B of `sizes`: B random prompts of `context` tokens, all admitted at once, greedy,
    9 + steps new tokens. The clock is read as each decode step starts (generate_batch's on_step), and the last
    `steps` periods between step starts are timed, after the prefills, the first steps and the capture of the
    bucket's graph: with the steps pipelined (the host queues step k + 1 while step k runs) each period is one step.
    Not timed: the last step, drained with nothing queued behind it, the sequences' finishing, and generate_batch's
    release of the runner's GPU memory (weights, cache, graphs) as it returns: once per call, not per step.
    same_text: the first sequence gets the tokens it gets alone (B = 1). queue_ms, wait_ms: the host's median time
    per timed step queuing it and waiting for the tokens of the step before (generate_batch's stats; the rest of
    ms_per_step is the scheduler's bookkeeping: a step whose wait is near zero found the GPU idle, waiting for the
    host). -> [{"batch", "tokens_per_s", "ms_per_step", "queue_ms", "wait_ms", "same_text"}]."""
    from ..batch import generate_batch

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, model.config.vocab_size, context).tolist() for _ in range(max(sizes))]

    def run(batch):
        starts, stats = [], {}
        outs = generate_batch(model, prompts[:batch], max_new_tokens=9 + steps, stop=False, backend="cuda",
                              max_running=batch, on_step=lambda running: starts.append(time.perf_counter()),
                              stats=stats)
        host = {f"{part}_ms": 1e3 * float(np.median(stats[part][-steps:])) for part in ("queue", "wait")}
        return starts[-1] - starts[-1 - steps], host, outs[0].token_ids

    alone = run(1)[2]
    rows = []
    for batch in sizes:
        seconds, host, first = run(batch)
        rows.append({"batch": batch, "tokens_per_s": batch * steps / seconds, "ms_per_step": 1e3 * seconds / steps,
                     **host, "same_text": first == alone})
    return rows


def batch_step_profile(model, batch: int, context: int = 64, weights: str = "bf16", repeats: int = 7) -> dict:
    """Where the GPU time of one decode step of `batch` sequences goes (CudaBatch: the bucket's recorded step):
    random prompts of `context` tokens prefilled, a few steps decoded (the plan recorded, its graph captured), then
    the step replayed as its graph behind a `hold` kernel, timed by CUDA events (median of `repeats`), and run once
    launch by launch with events around each kernel (gpu.plan.Recorded.timeline). In the simulator the times are
    the host's: only the kernels and their counts mean something there. -> {"batch", "rows" (the bucket's),
    "gpu_ms" (the graph's step), "kernels": [[name, launches, ms]], most expensive first}."""
    from ..batch import CudaBatch, PagedSequence, Sequence
    from ..gpu.kv_cache import PAGE_SIZE
    from ..gpu.plan import bucket
    from .profiler import by_kernel

    new = 8
    runner = CudaBatch(model, pages=batch * -(-(context + new) // PAGE_SIZE), max_len=context + new, weights=weights)
    rng = np.random.default_rng(2)
    seqs = []
    for i in range(batch):
        seq = Sequence(i, rng.integers(0, model.config.vocab_size, context).tolist(), new, (0.0, None, None, 0),
                       frozenset())
        seq.kv = PagedSequence(runner.cache, i, context + new)
        seq.take(runner.prefill(seq), 0.0)
        seqs.append(seq)
    for _ in range(3):
        for seq, token in zip(seqs, runner.decode(seqs), strict=True):
            seq.take(token, 0.0)
    plan = runner.plans[bucket(batch)]
    hold_us = 20_000 + 50 * plan.launches  # longer than the host takes to queue the step, events and all
    kernels = plan.timeline(hold=lambda stream: k_copy.hold[1, 1, stream](hold_us))
    return {"batch": batch, "rows": plan.rows,
            "gpu_ms": None if SIMULATOR else held_step_ms(plan, True, hold_us, repeats),
            "kernels": [[name, count, ms] for name, count, ms in by_kernel(kernels)]}


def format_batch_profile(profile: dict) -> str:
    """The kernels of batch_step_profile's step, most expensive first, with their share of the step's kernels."""
    total = sum(ms for _, _, ms in profile["kernels"])
    step = f"; the step as one graph {profile['gpu_ms']:.3f} ms" if profile["gpu_ms"] is not None else ""
    lines = [f"one decode step of {profile['batch']} sequences ({profile['rows']} rows), kernel by kernel: "
             f"{total:.3f} ms{step}",
             f"{'kernel':<34}{'launches':>9}{'ms':>10}{'share':>8}{'us each':>10}"]
    for name, count, ms in profile["kernels"]:
        lines.append(f"{name:<34}{count:>9}{ms:>10.3f}{ms / total:>8.1%}{1e3 * ms / count:>10.1f}")
    return "\n".join(lines)


def batch_peers(config, batch: int, context: int = 64, steps: int = 64) -> dict[str, float]:
    """{mode: aggregate decode tokens/s} of the PyTorch peer (measure.peers) decoding `batch` sequences together
    with a CUDA graph, and compiled then graphed, at the context of bench_batch; {} without PyTorch on a GPU."""
    from . import peers

    torch = torch_cuda()
    if torch is None:
        return {}
    return peers.tokens_per_s(torch, config, steps=steps, max_len=context + steps + 1, modes=("graph", "compile+graph"),
                              context=context, batch=batch)


def format_batch(rows: list[dict], peers: dict | None = None, peer_batch: int | None = None) -> str:
    host = all("wait_ms" in r for r in rows)  # records made before the host's split have none
    lines = [f"{'batch':>6}{'tok/s':>11}{'ms/step':>9}{'x batch 1':>11}" + (f"{'queue':>8}{'wait':>8}" if host else "")
             + "  same text as alone"]
    base = next((r["tokens_per_s"] for r in rows if r["batch"] == 1), None)
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:>10.1f}x" if base else f"{'':>11}"
        split = f"{r['queue_ms']:>8.2f}{r['wait_ms']:>8.2f}" if host else ""
        lines.append(f"{r['batch']:>6}{r['tokens_per_s']:>11.1f}{r['ms_per_step']:>9.2f}{ratio}{split}  "
                     f"{'yes' if r['same_text'] else 'NO'}")
    for mode, tps in (peers or {}).items():
        lines.append(f"torch {mode} at batch {peer_batch}: {tps:,.1f} tok/s (random weights, same shapes)")
    lines.append("tok/s: decode tokens of all sequences per second (generate_batch: the fused step of the batch "
                 "replayed as the CUDA graph of its bucket)")
    if host:
        lines.append("queue, wait: the host's ms per step queuing it and waiting for the step before's tokens; the "
                     "rest of ms/step is the scheduler's bookkeeping")
    return "\n".join(lines)
