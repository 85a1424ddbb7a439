"""The CUDA backend: the forward pass of reference.py, op by op, as Numba CUDA kernels.

The baseline mirrors a training-oriented engine, so the course starts from a real, honest starting point:
every projection is the 64x64-tile matmul, the KV cache grows by concatenation (a fresh allocation and a copy
of the whole cache each token), every intermediate is a fresh device allocation, the bias is a separate
kernel, and the logits go through an explicit transpose of the embedding table. The token ids and positions
of a pass live in device arrays (read by the kernels), not in Python scalars.

Weights: float32 or bf16 (stored as uint16, widened to float32 in the kernels); activations always float32.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from ..kernels import attention as k_attention
from ..kernels import copy as k_copy
from ..kernels import elementwise as k_elt
from ..kernels import fused as k_fused
from ..kernels import matmul as k_matmul
from ..kernels import narrow as k_narrow
from ..kernels import paged_attention as k_paged
from ..kernels import reshaped
from ..kernels import row_dot as k_row
from ..model.loading import Model
from ..model.safetensors_io import f32_to_bf16
from .kv_cache import PAGE_SIZE, PagedKVCache
from .runtime import Runtime

# Kernel choice per op. Each later notebook adds its optimized choice beside the baseline's, so `bench` can show
# the whole progression with the same text at every step.
OP_CHOICES = {
    # every projection: the 64x64-tile matmul | split-K narrow matmul for <= 16 rows, tiled above (notebook 02)
    "matmul": ("tiled", "narrow"),
    # a new, longer cache every pass, the old one copied into it | pages allocated once, rows written in place,
    # read by flash-decoding attention; intermediates recycled from pass to pass (notebooks 03, 04)
    "kv_cache": ("concat", "paged"),
    # tied embeddings: transpose the table, then matmul | a . table^T read in place (notebook 02) | the same, each
    # logit summed along K by one thread, tiles of many rows (a batch's: notebook 07)
    "logits": ("transpose", "transposed", "rows"),
    # Q/K/V bias: added by its own kernel | added by the matmul's reduction (notebook 02)
    "bias": ("separate", "fused"),
    # the residual add after the O and down projections: its own kernel | in the matmul's reduction (notebook 05)
    "residual": ("separate", "fused"),
    # RMSNorm: its own kernel writing the normalized rows | computed by the blocks of the projection that reads them
    "norm": ("separate", "fused"),
    # Q, K, V: three matmuls, two RoPE kernels, two cache writes | one matmul with RoPE and the cache write in its
    # epilogue (notebook 05)
    "qkv": ("separate", "fused"),
    # SwiGLU: gate and up matmuls, then silu(gate) * up | one matmul on the interleaved gate/up columns with the
    # product in its epilogue (notebook 05)
    "swiglu": ("separate", "fused"),
    # flash-decoding: the chunks, then a merge kernel | one kernel, the last chunk block of each query and group of
    # heads to finish merges them (notebook 05)
    "attention": ("two_kernels", "one_kernel"),
    # flash-decoding's chunks of keys: four keys per team and block step, chunks of whole steps, as many as fill the
    # GPU for one sequence | two keys per team and step, chunks of four steps (a batch: its rows fill the GPU, each
    # chunk past the first costs a merge, and fewer registers per lane let more blocks run; notebook 07)
    "chunks": ("sequence", "batch"),
    # the decode step's projections: split-K over [K, N] weights (partial sums, then each column group's last block
    # adds them) | a warp per pair of outputs over [N, K] weight rows, one pass, the first weights loaded before
    # waiting for the inputs (kernels/row_dot; notebook 05)
    "projection": ("split_k", "row_dot"),
}
BASELINE = {op: choices[0] for op, choices in OP_CHOICES.items()}
NARROW = BASELINE | {"matmul": "narrow", "logits": "transposed", "bias": "fused"}
PAGED = NARROW | {"kv_cache": "paged"}
# every fusion of notebook 05 but attention's: it stays two kernels (with a block per KV head, a separate merge kernel
# beat the merge by each head's last block from two chunks of keys up on the H200, 1.30 against 1.40 ms per step at
# 200 keys; data/h200_kernel_notes.md); the batched step builds on it
FUSED = PAGED | {"residual": "fused", "norm": "fused", "qkv": "fused", "swiglu": "fused"}
ROW_DOT = FUSED | {"projection": "row_dot"}
# five kernels a layer: with a block per query head (paged_attention.SEQUENCE_HEADS), the merge by each head's last
# chunk block matched or beat the merge kernel up to 1k keys on the H200, and lost about 3% at 4k
# (data/batch_add_norm_h200.json; the bench of both on the real model: data/bench_five_h200.json)
FIVE = ROW_DOT | {"attention": "one_kernel"}
# the batched step (course_lib.batch.CudaBatch): a row's bits must not depend on the batch, and the transposed
# kernel's team of lanes per logit does not tile over many rows; chunks of keys for many rows
BATCHED = FUSED | {"logits": "rows", "chunks": "batch"}
CHUNKS = {"sequence": k_paged.SEQUENCE_CHUNKS, "batch": k_paged.BATCH_CHUNKS}  # op chunks -> paged_attention.Chunks


def resolve_ops(ops: dict | None) -> dict:
    """BASELINE updated with `ops`; unknown ops or choices are errors."""
    chosen = BASELINE | (ops or {})
    for op, choice in chosen.items():
        if op not in OP_CHOICES:
            raise ValueError(f"unknown op {op!r} (ops: {', '.join(OP_CHOICES)})")
        if choice not in OP_CHOICES[op]:
            raise ValueError(f"op {op!r} has no choice {choice!r} (choices: {', '.join(OP_CHOICES[op])})")
    if chosen["kv_cache"] == "paged" and chosen["matmul"] != "narrow":
        raise ValueError("the paged cache comes after the narrow matmul: use matmul='narrow' with it")
    if chosen["bias"] == "fused" and chosen["matmul"] != "narrow":
        raise ValueError("a fused bias is added by the narrow matmul's reduction: use matmul='narrow' with it")
    for op in ("attention", "chunks"):
        if chosen[op] != OP_CHOICES[op][0] and chosen["kv_cache"] != "paged":
            raise ValueError(f"{op}={chosen[op]!r} is flash-decoding's: use kv_cache='paged' with it")
    if chosen["norm"] == "fused" and chosen["logits"] == "transpose":
        raise ValueError("a fused norm is computed by the logits' kernel too, a transposed one: use "
                         "logits='transposed' or 'rows' with it")
    for op in ("residual", "norm", "qkv", "swiglu"):
        if chosen[op] == "fused" and chosen["kv_cache"] != "paged":
            raise ValueError(f"a fused {op} is done by the split-K matmul, which only the paged cache's step uses "
                             "for every row count: use kv_cache='paged' with it")
    if chosen["projection"] == "row_dot" and any(chosen[op] != "fused" for op in ("residual", "norm", "qkv",
                                                                                 "swiglu")):
        raise ValueError("the row_dot projections have their norm, RoPE, SwiGLU and residual in their epilogues: "
                         "use residual, norm, qkv and swiglu 'fused' with it")
    return chosen


def upload_weights(model: Model, rt: Runtime, dtype: str, ops: dict = BASELINE) -> dict:
    """{name: device array}: matrices and the embedding table in `dtype` ('f32' or 'bf16'), norms in float32.
    The layout follows the ops: with a fused qkv, a layer has w_qkv = [wq | wk | wv] (and b_qkv) instead; with a
    fused swiglu, w_gu = interleave_gate_up(w_gate, w_up) instead of the two. With the row_dot projections every
    matrix is stored as rows of outputs [N, K] instead, named with "_rows" (kernels/row_dot: w_qkv_rows and
    b_qkv_rows in RoPE-pair order, w_gu_rows with gate and up rows alternating, wo_rows, w_down_rows)."""
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"weight dtype must be 'f32' or 'bf16', got {dtype!r}")

    def put(arr, keep_f32=False):
        host = arr if keep_f32 or dtype == "f32" else f32_to_bf16(arr)
        return rt.to_device(host, persistent=True)

    w = model.weights
    out = {"embed": put(w.embed), "final_norm": put(w.final_norm, True),
           "lm_head": None if w.lm_head is None else put(w.lm_head), "layers": []}
    for lw in w.layers:
        host = dict(vars(lw))
        if ops["qkv"] == "fused":
            host["w_qkv"] = np.concatenate([host.pop(m) for m in ("wq", "wk", "wv")], axis=1)
            biases = [host.pop(b) for b in ("bq", "bk", "bv")]
            host["b_qkv"] = None if biases[0] is None else np.concatenate(biases)
        if ops["projection"] == "row_dot":  # rows of outputs, in the order their epilogues take them
            hd, bias = model.config.head_dim, host.pop("b_qkv")
            host["w_qkv_rows"] = k_row.paired_qkv(host.pop("w_qkv"), hd)
            host["b_qkv_rows"] = None if bias is None else k_row.paired_qkv(bias, hd)
            host["w_gu_rows"] = k_row.paired_gate_up(host.pop("w_gate"), host.pop("w_up"))
            for m in ("wo", "w_down"):
                host[m + "_rows"] = k_row.output_rows(host.pop(m))
        elif ops["swiglu"] == "fused":
            host["w_gu"] = k_fused.interleave_gate_up(host.pop("w_gate"), host.pop("w_up"))
        out["layers"].append({
            name: (None if value is None else put(value, keep_f32=value.ndim == 1)) for name, value in host.items()
        })
    return out


class CudaBackend:
    """CUDA backend for one sequence. prefill(ids) / decode(token) -> logits [V] (host, float32); reset() empties
    the cache. With kv_cache="paged" the cache is a PagedKVCache (float32) and the runtime recycles its arrays."""

    name = "cuda"

    def __init__(self, model: Model, capacity: int, weights: str = "bf16", fast_launch: bool = True,
                 ops: dict | None = None, pages: int | None = None):
        self.model, self.config = model, model.config
        self.ops = resolve_ops(ops)
        self.paged = self.ops["kv_cache"] == "paged"
        self.rt = Runtime(fast=fast_launch, reuse=self.paged)
        self.w = upload_weights(model, self.rt, weights, self.ops)
        cos, sin = reference.rope_tables(self.config, capacity)
        self.cos, self.sin = self.rt.to_device(cos, persistent=True), self.rt.to_device(sin, persistent=True)
        self.capacity = capacity
        if self.paged:
            self.cache = PagedKVCache(self.config, pages=pages or -(-capacity // PAGE_SIZE), page_size=PAGE_SIZE)
        self.reset()
        self.rt.allocations = 0  # count what the passes allocate, not the upload

    def reset(self):
        """Forget the sequence: the next prefill starts at position 0."""
        self.length = 0
        if self.paged:
            if 0 in self.cache:
                self.cache.free(0)
            self.cache.add(0, self.capacity)
        else:
            self.k_cache = [None] * self.config.n_layers  # [S, d_kv] per layer, grown by concatenation
            self.v_cache = [None] * self.config.n_layers

    def prefill(self, ids, all_logits: bool = False) -> np.ndarray:
        """Logits [V] of the last token of ids, or [T, V] of every token with all_logits."""
        return self.forward(np.asarray(ids, np.int32), all_logits)

    def decode(self, token: int) -> np.ndarray:
        return self.forward(np.asarray([token], np.int32))

    def _grow(self, cache, new_rows):
        """Baseline cache append: allocate [S + T, d_kv], copy the old rows and the new ones (every token)."""
        rt = self.rt
        old_rows = 0 if cache is None else cache.shape[0]
        grown = rt.empty((old_rows + new_rows.shape[0], new_rows.shape[1]))
        flat = grown.reshape(grown.size)
        if cache is not None:
            k_copy.copy(cache.reshape(cache.size), flat[: cache.size], rt=rt)
        k_copy.copy(new_rows.reshape(new_rows.size), flat[old_rows * new_rows.shape[1]:], rt=rt)
        return grown

    def _upload_pass(self, ids, start):
        """Device arrays (ids, positions, slots, page table) of this pass. Paged: one host-to-device transfer,
        shared by every layer (the slots are reserved in the cache here)."""
        T, rt = len(ids), self.rt
        if not self.paged:
            return rt.to_device(ids), rt.to_device(np.arange(start, start + T, dtype=np.int32)), None, None
        return self.upload_rows(ids, start, self.cache.slots(0, T), self.cache.page_table(0, self.cache.pages))

    def upload_rows(self, ids, start: int, slots, table):
        """Device arrays (ids, positions, slots, page table) int32 of a paged pass over the positions start ..
        start + T - 1 of one sequence, its T slots and its page table given: one host-to-device transfer, shared by
        every layer."""
        T = len(ids)
        positions = np.arange(start, start + T, dtype=np.int32)
        packed = self.rt.to_device(np.concatenate([ids, positions, slots, table]).astype(np.int32))
        return packed[:T], packed[T:2 * T], packed[2 * T:3 * T], packed[3 * T:]

    def forward(self, ids: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """ids [T] int32 after the cached positions -> logits [V] of the last token, or [T, V] of every token with
        all_logits (copied to the host)."""
        logits = self.forward_on_device(ids, all_logits).copy_to_host(stream=self.rt.stream)
        return logits if all_logits else logits[0]

    def forward_on_device(self, ids: np.ndarray, all_logits: bool = False):
        """As forward, the logits left on the device: [T, V], or [1, V] of the last token."""
        T, start = len(ids), self.length
        if start + T > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} positions; {start} used + {T} new do not fit")
        self.rt.begin_pass()
        ids_d, pos_d, slots_d, table_d = self._upload_pass(ids, start)
        logits = self.run_pass(self.rt, ids_d, pos_d, slots_d, table_d, T, start + T, all_logits)
        self.length = start + T
        return logits

    def run_pass(self, rt, ids_d, pos_d, slots_d, tables, T: int, max_len: int, all_logits: bool = False,
                 embedded: bool = False):
        """The layers, through runtime rt, on inputs already on the device: ids_d, pos_d [T] int32 (token ids and
        their positions), slots_d [T] int32 (paged cache: the cache rows of the new tokens) and tables: the page
        table [pages] int32 of the sequence the T rows belong to, or, for rows of several sequences (a batched
        decode step), (page tables [S, pages], seq_of_row [T]) int32; max_len >= every position + 1. embedded: the
        buffer "x" already holds the embeddings of ids_d (a step plan's sampler wrote them), no embedding kernel.
        -> logits [T, V], or [1, V] of the last token.
        Every intermediate has a name: with a recycling runtime (the paged recipe, a step plan) that name is one
        buffer of the pass, reused by every layer."""
        c, w, layers = self.config, self.w, self.w["layers"]
        x = rt.empty((T, c.d_model), name="x")
        if not embedded:
            k_elt.embedding(w["embed"], ids_d, out=x, rt=rt)
        h = None  # RMSNorm(x) * gamma of the next norm, when the projection that last added into x wrote it
        for i, lw in enumerate(layers):
            q = self._attention_inputs(rt, x, h, lw, i, pos_d, slots_d, T)
            if self.paged:
                a = self._paged_attention(rt, q, i, pos_d, tables, T, max_len)
            else:
                a = k_attention.attention(q, self.k_cache[i].reshape(max_len, c.n_kv_heads, c.head_dim),
                                          self.v_cache[i].reshape(max_len, c.n_kv_heads, c.head_dim), pos_d, rt=rt)
            x, h = self._add_linear(rt, x, reshaped(a, T, c.d_model), lw, "wo", lw["mlp_norm"])
            after = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else w["final_norm"] if all_logits else None
            x, h = self._add_linear(rt, x, self._mlp_inputs(rt, x, h, lw, T), lw, "w_down", after)
        rows = x if all_logits else x[T - 1:]  # the transposed kernel normalizes one row (a decode step's) itself
        fits = w["lm_head"] is not None or (rows.shape[0] == 1 and c.d_model <= k_narrow.MAX_NORMED_K
                                            and self.ops["logits"] == "transposed")
        h, norm = (h, None) if h is not None else self._normed(rt, rows, w["final_norm"], name="h_final", fuse=fits)
        if w["lm_head"] is not None:
            return self._linear(rt, h, w["lm_head"], name="logits", norm=norm)
        if self.ops["logits"] == "rows":
            return k_narrow.matmul_transposed_rows(h, w["embed"], out=rt.empty((rows.shape[0], c.vocab_size),
                                                                               name="logits"), rt=rt)
        if self.ops["logits"] == "transposed":
            return self._by_rows(rt, lambda rows, out: k_narrow.matmul_transposed(rows, w["embed"], out, rt=rt,
                                                                                  norm=norm), h, c.vocab_size,
                                 "logits")
        return k_matmul.matmul(h, k_matmul.transpose(w["embed"], rt=rt), rt=rt)

    def _paged_attention(self, rt, q, i, pos_d, tables, T, max_len):
        """Flash-decoding of q [T, H, hd] over layer i's cache, through one sequence's page table, or (a batch)
        each row through its own sequence's (one launch: the same bits as each sequence alone)."""
        c, one_launch = self.config, self.ops["attention"] == "one_kernel"
        table, seq_of_row = tables if isinstance(tables, tuple) else (tables, None)
        return k_paged.flash_attention(q, self.cache.k[i], self.cache.v[i], table, pos_d, PAGE_SIZE, max_len=max_len,
                                       out=rt.empty((T, c.n_heads, c.head_dim), name="attn"), rt=rt,
                                       one_launch=one_launch, seq_of_row=seq_of_row,
                                       chunks=CHUNKS[self.ops["chunks"]])

    def _attention_inputs(self, rt, x, normed, lw, i, pos_d, slots_d, T):
        """The queries q [T, H, hd] of layer i, its keys and values stored in the cache: the norm (unless `normed`
        holds it already), the Q, K, V projections and RoPE, in one kernel with the fused qkv, else a kernel for
        each."""
        c = self.config
        h, norm = (normed, None) if normed is not None else self._normed(rt, x, lw["attn_norm"])
        if self.ops["projection"] == "row_dot":
            q = k_row.qkv_rope(h, lw["w_qkv_rows"], lw["b_qkv_rows"], norm, self.cos, self.sin, pos_d, slots_d,
                               rt.empty((T, c.d_model), name="q"), self.cache.k[i], self.cache.v[i], rt=rt)
            return reshaped(q, T, c.n_heads, c.head_dim)
        if self.ops["qkv"] == "fused":
            q = k_fused.qkv_rope(h, lw["w_qkv"], lw["b_qkv"], norm, self.cos, self.sin, pos_d, slots_d,
                                 rt.empty((T, c.d_model), name="q"), self.cache.k[i], self.cache.v[i], rt=rt)
            return reshaped(q, T, c.n_heads, c.head_dim)
        q, k, v = (self._linear(rt, h, lw[m], lw[b], name=m[1], norm=norm) for m, b in (("wq", "bq"), ("wk", "bk"),
                                                                                       ("wv", "bv")))
        q, k, v = (reshaped(y, T, -1, c.head_dim) for y in (q, k, v))
        k_elt.rope(q, self.cos, self.sin, pos_d, rt=rt)
        k_elt.rope(k, self.cos, self.sin, pos_d, rt=rt)
        if self.paged:
            k_paged.write_rows(k, self.cache.k[i], slots_d, rt=rt)
            k_paged.write_rows(v, self.cache.v[i], slots_d, rt=rt)
        else:
            self.k_cache[i] = self._grow(self.k_cache[i], k.reshape(T, c.d_kv))
            self.v_cache[i] = self._grow(self.v_cache[i], v.reshape(T, c.d_kv))
        return q

    def _mlp_inputs(self, rt, x, normed, lw, T):
        """silu(gate) * up [T, d_ff] of RMSNorm(x) (`normed`, when already written): one kernel with the fused
        swiglu, else two matmuls and the product's kernel (and the norm's, unless fused)."""
        h, norm = (normed, None) if normed is not None else self._normed(rt, x, lw["mlp_norm"])
        if self.ops["projection"] == "row_dot":
            return k_row.gate_up_swiglu(h, lw["w_gu_rows"], norm, rt.empty((T, self.config.d_ff), name="act"), rt=rt)
        if self.ops["swiglu"] == "fused":
            return k_fused.gate_up_swiglu(h, lw["w_gu"], norm, rt.empty((T, self.config.d_ff), name="act"), rt=rt)
        gate = self._linear(rt, h, lw["w_gate"], name="gate", norm=norm)
        up = self._linear(rt, h, lw["w_up"], name="up", norm=norm)
        return k_elt.silu_mul(gate, up, out=rt.empty((T, self.config.d_ff), name="act"), rt=rt)

    def _normed(self, rt, x, gamma, name="h", fuse=True):
        """(rows, norm) to give the next projections: (x, (gamma, eps)) when they normalize it themselves (a fused
        norm, and `fuse`), else (RMSNorm(x) gamma written by the norm kernel into the buffer `name`, None)."""
        if self.ops["norm"] == "fused" and fuse:
            return x, (gamma, self.config.rms_eps)
        h = k_elt.rms_norm(x, gamma, self.config.rms_eps, out=rt.empty(x.shape, name=name), rt=rt)
        return h, None

    def _by_rows(self, rt, f, x, n_out, name, out=None):
        """f(x, out) for a kernel of at most MAX_ROWS rows (the transposed logits), into `out` or else the buffer
        `name` [rows, n_out]:
        called once when x has that many rows or fewer, else on slices of MAX_ROWS rows of x and of the output (a
        row gets the same bits either way)."""
        step = k_narrow.MAX_ROWS
        y = rt.empty((x.shape[0], n_out), name=name) if out is None else out
        if x.shape[0] <= step:
            f(x, y)
            return y
        for r in range(0, x.shape[0], step):
            f(x[r:r + step], y[r:r + step])
        return y

    def _add_linear(self, rt, x, a, lw, matrix, gamma_after=None):
        """(x + a @ lw[matrix] ("wo" or "w_down"), h): the residual stream [T, d_model] updated in place, by the
        projection itself when the residual is fused (one kernel: the row_dot epilogue, or the narrow matmul's
        reduction), else a matmul into a buffer then an add kernel. h: RMSNorm(x) * gamma_after, the next
        projection's input, when the norm and the residual are fused and x has more rows than a projection normalizes
        itself (a batch's: the narrow matmul's epilogue adds and normalizes a row in one launch), else None."""
        if self.ops["projection"] == "row_dot":
            return k_row.project(a, lw[matrix + "_rows"], x, accumulate=True, rt=rt), None
        if self.ops["residual"] != "fused":
            return k_elt.add(x, self._linear(rt, a, lw[matrix], name={"wo": "o", "w_down": "down"}[matrix]),
                             out=rt.empty(x.shape, name="x"), rt=rt), None
        if gamma_after is None or self.ops["norm"] != "fused" or x.shape[0] <= k_narrow.NORMED_ROWS:
            return k_narrow.matmul_narrow(a, lw[matrix], out=x, rt=rt, accumulate=True), None
        h = rt.empty(x.shape, name="h")
        k_narrow.matmul_narrow(a, lw[matrix], out=x, rt=rt, accumulate=True,
                               norm_after=(gamma_after, self.config.rms_eps, h))
        return x, h

    def _linear(self, rt, x, weight, bias=None, name=None, norm=None):
        """x [T, K] @ weight + bias into the buffer `name`, with the chosen matmul; the bias in its own kernel
        unless fused; norm = (gamma, eps): x normalized by the matmul itself (the paged step's split-K kernel only).
        With the paged cache, the narrow matmul takes every row even in a long prefill (not the tiled kernel): a
        token's result is then the same bits whether it comes alone, inside a prompt or inside a batch (see
        notebook 03)."""
        fused = self.ops["bias"] == "fused"
        if norm is not None and not (self.ops["matmul"] == "narrow" and self.paged):
            raise ValueError("a norm inside the matmul needs the paged step's split-K matmul")
        if self.ops["matmul"] == "narrow" and self.paged:
            y = k_narrow.matmul_narrow(x, weight, bias if fused else None, rt.empty((x.shape[0], weight.shape[1]),
                                                                                    name=name), rt=rt, norm=norm)
        elif self.ops["matmul"] == "narrow":
            y = k_narrow.linear(x, weight, bias if fused else None, out=rt.empty((x.shape[0], weight.shape[1]),
                                                                                 name=name), rt=rt)
        else:
            y = k_matmul.matmul(x, weight, out=rt.empty((x.shape[0], weight.shape[1]), name=name), rt=rt)
        return y if bias is None or fused else k_matmul.add_bias(y, bias, rt=rt)
