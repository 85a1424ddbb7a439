"""Benchmarks: the copy bandwidth of this GPU, and decode speed against the bound it implies.

Used by `python -m course_lib bench` and the notebooks; never by the tests (timings are not assertions).
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np

from . import accounting
from .device import by_mode
from .kernels import copy as k_copy
from .kernels import cuda
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
    from .cuda_backend import CudaBackend

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


def same_text(model, weights: str, ops: dict, n_tokens: int = 32, prompt: str = "The capital of France is") -> bool:
    """Do these kernel choices give the NumPy reference's greedy tokens (on the same bf16-rounded weights)?"""
    import dataclasses

    from .cuda_backend import CudaBackend
    from .generate import generate
    from .weights import round_to_bf16

    ref_model = model if weights == "f32" else dataclasses.replace(model, weights=round_to_bf16(model.weights))
    expected = generate(ref_model, prompt, max_new_tokens=n_tokens, stop=False, backend="numpy").token_ids
    ids = model.tokenizer.encode(prompt)
    backend = CudaBackend(model, len(ids) + n_tokens, weights=weights, ops=ops)
    tokens = [int(np.argmax(backend.prefill(ids)))]
    while len(tokens) < n_tokens:
        tokens.append(int(np.argmax(backend.decode(tokens[-1]))))
    return tokens == expected


def _gb_per_s(run, buffers: list, nbytes: int, repeats: int, graph: bool = False) -> float:
    """GB/s of `nbytes` moved by run(buffer, stream=s), on the buffers in turn, GPU time only, timed by events
    around `repeats` runs back to back, with launch overhead left out in one of two ways:
    - graph=False: a `hold` kernel keeps the GPU busy while the host queues the runs on the default stream. Each
      kernel still waits for the GPU to start it after the previous one ends (1.6 us for an empty kernel on
      the H200): the cost of kernels launched one by one.
    - graph=True: the runs captured once as a CUDA graph (course_lib.graphs) on a stream of their own; the median
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
            from .graphs import Graph

            g = Graph(runs, stream)
            g.launch(stream)  # first replay: uploads the graph
            seconds = float(np.median([_elapsed(partial(g.launch, stream), stream) for _ in range(5)]))
        else:
            k_copy.hold[1, 1, stream](20_000)
            seconds = _elapsed(runs, stream)
    return nbytes * repeats / seconds / 1e9


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
    from .kernels import matmul as k_matmul
    from .kernels import narrow as k_narrow
    from .safetensors_io import f32_to_bf16

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


def attention_bandwidth(config, lengths: list[int], repeats: int = 30, graph: bool = False) -> list[dict]:
    """GB/s of keys and values read by one decode step's attention (one query, float32 cache, GPU time, see
    _gb_per_s: kernels launched one by one, or replayed in a CUDA graph with graph=True), at each context
    length: the baseline kernel over a contiguous cache, and flash-decoding over a paged cache (pages of 16 in
    shuffled order). The runs rotate over enough caches (>= 256 MB) that they come
    from memory, not from the L2 cache. With PyTorch on the GPU, "torch": its scaled_dot_product_attention on a
    contiguous cache (enable_gqa). "read": a plain read of the same bytes (read_bandwidth), the ceiling at this
    size. Rows: {"context", "MB", "read", "baseline", "flash", "chunks"[, "torch"]}."""
    from .kernels import attention as k_attention
    from .kernels import paged_attention as k_paged

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
               "chunks": k_paged.chunks_for(n, Hkv, hd)[1]}
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
    from .runtime import Runtime

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


def run_bench(model, weights=("bf16", "f32"), launches=("fast", "dispatcher"), context=64, steps=50) -> str:
    """The `bench` command's report: bandwidth, bound, launch cost, then one row per step of the course's
    progression (cuda_backend.STEPS), weight dtype and launch path, with a check that the text is unchanged."""
    from .cuda_backend import STEPS

    c = model.config
    measured = measure_bandwidth()
    bandwidth = max(measured.values())
    lines = [f"model {c.name}: {c.n_params() / 1e6:.1f}M parameters, context {context} + {steps} decode steps",
             "copy bandwidth (read + write): " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in measured.items())]
    for w in weights:
        wb = 2 if w == "bf16" else 4
        bound = accounting.tokens_per_s_bound(c, bandwidth, context, wb)
        lines.append(f"bound with {w} weights: {bound:,.0f} tokens/s "
                     f"({accounting.decode_cost(c, context, wb).bytes / 1e6:.1f} MB per token)")
    overhead = measure_launch_overhead()
    lines.append("launch cost from Python: " + ", ".join(f"{k} {v:.1f} us" for k, v in overhead.items()))
    rows = []
    for label, ops in STEPS.items():
        for w in weights:
            same = same_text(model, w, ops)
            for launch in launches:
                row = bench_decode(model, bandwidth, w, context, steps, launch == "fast", ops, label)
                rows.append(row | {"same_text": same})
    lines.append(format_rows(rows))
    return "\n".join(lines)
