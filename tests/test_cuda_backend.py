"""The CUDA backend against the NumPy reference: the same logits, to the derived tolerance, for every kernel
choice; its choices checked; its launches and allocations counted.

In the simulator (no GPU) on the tiny models; on a GPU with the real SmolLM2 weights. bf16 weights are compared
with the reference run on the same weights rounded to bf16 (checks.as_computed).
"""

import numpy as np
import pytest
from checks import as_computed, logit_tolerance

from course_lib import reference
from course_lib.gpu.backend import BATCHED, CHUNKS, FIVE, FUSED, NARROW, PAGED, ROW_DOT, CudaBackend
from course_lib.kernels import SIMULATOR
from course_lib.kernels.paged_attention import ONE_CHUNK_KEYS, chunk_unit, chunks_for


@pytest.mark.parametrize("ops", [None, NARROW, PAGED, FUSED, ROW_DOT], ids=["baseline", "narrow", "paged", "fused",
                                                                          "row_dot"])
@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_logits_match_reference(request, model, weights, ops):
    if SIMULATOR and ops is ROW_DOT and weights == "f32":
        pytest.skip("simulator time: the row_dot kernels' float32 weights are checked in test_row_dot")
    if SIMULATOR and ops is FUSED and weights == "f32":
        pytest.skip("simulator time: the fused step is the paged step bit for bit (test_fused_step_gives_the_paged_"
                    "steps_bits), once is enough")
    if ops is not None and SIMULATOR:  # tied embeddings: the transposed logits kernel
        model = request.getfixturevalue("tiny_one_layer" if ops is ROW_DOT else "tiny")
    c = model.config
    ref_model = as_computed(model, weights)
    ids = np.random.default_rng(5).integers(0, c.vocab_size, 9 if SIMULATOR else 40)  # 40: 3 pages
    backend = CudaBackend(model, 48, weights=weights, ops=ops)
    cache, rope = reference.KVCache(c, 48), reference.rope_tables(c, 48)
    pairs = [(backend.prefill(ids), reference.forward(ref_model.weights, c, ids, cache, rope))]
    for token in (3, 17):
        pairs.append((backend.decode(token), reference.forward(ref_model.weights, c, [token], cache, rope)))
    for ours, ref in pairs:
        assert np.all(np.isfinite(ours))
        # the same float32 operations in another summation order (checks.logit_tolerance)
        assert np.abs(ours - ref).max() <= logit_tolerance(c, np.abs(ref).max())


@pytest.mark.parametrize("ops", [PAGED, FUSED, ROW_DOT, FIVE, BATCHED],
                         ids=["paged", "fused", "row_dot", "five", "batched"])
def test_decode_over_several_chunks_matches_reference(request, model, ops):
    """A decode step whose keys span several flash-decoding chunks, so the backend merges them (the merge kernel, or
    each head's last block; the batched step's longer chunks): the logits of the reference, to the
    derived tolerance. The cache's first n positions are the reference's own keys and values, written into the
    backend's pages (a prefill of that many tokens would take minutes in the simulator)."""
    if SIMULATOR:
        model = request.getfixturevalue("tiny")
    c, chunks = model.config, CHUNKS[ops["chunks"]]
    n = max(2 * chunk_unit(c.head_dim, chunks), ONE_CHUNK_KEYS) + 1  # a decode step at position n sees n + 1 keys:
    # two chunks or more
    assert chunks_for(n + 1, c.n_heads, c.n_kv_heads, c.head_dim, chunks=chunks)[1] >= 2
    ref_model, rope = as_computed(model, "bf16"), reference.rope_tables(c, n + 1)
    cache = reference.KVCache(c, n + 1)
    reference.forward(ref_model.weights, c, np.random.default_rng(9).integers(0, c.vocab_size, n), cache, rope)
    expected = reference.forward(ref_model.weights, c, [7], cache, rope)
    backend = CudaBackend(model, n + 1, weights="bf16", ops=ops)
    slots = backend.cache.slots(0, n)
    for layer in range(c.n_layers):
        for table, rows in ((backend.cache.k[layer], cache.k[layer]), (backend.cache.v[layer], cache.v[layer])):
            host = table.copy_to_host()
            host[slots] = rows[:n]
            table.copy_to_device(host)
    backend.length = n
    ours = backend.decode(7)
    assert np.abs(ours - expected).max() <= logit_tolerance(c, np.abs(expected).max())


def test_baseline_step_counts(tiny):
    """The baseline's launches and allocations per decode step follow from its structure (the step recorded, not
    run: Runtime.record)."""
    c = tiny.config
    backend = CudaBackend(tiny, 8, weights="f32")
    backend.rt.record(lambda: backend.prefill([1, 2, 3]))
    allocations = backend.rt.allocations
    launches = backend.rt.record(lambda: backend.decode(4))
    per_layer = 7 + 2 + 4 + 1 + 2 + 2 + 1  # matmuls, norms, cache copies, attention, adds, rope, silu_mul
    assert len(launches) == c.n_layers * per_layer + 1 + 1 + 1 + 1  # embedding, final norm, transpose, logits
    assert backend.rt.allocations - allocations > c.n_layers * 2  # a fresh cache per layer for K and V, and more
    names = {name for name, *_ in launches}
    assert {"matmul_tiled", "attention_two_pass", "transpose_tiled", "copy_grid_stride"} <= names


def test_op_choices_are_checked(tiny):
    assert CudaBackend(tiny, 4, ops={"matmul": "tiled"}).ops["kv_cache"] == "concat"
    with pytest.raises(ValueError, match="unknown op"):
        CudaBackend(tiny, 4, ops={"softmax": "fast"})
    with pytest.raises(ValueError, match="no choice 'magic'"):
        CudaBackend(tiny, 4, ops={"matmul": "magic"})


def test_fused_bias_needs_the_narrow_matmul(tiny):
    with pytest.raises(ValueError, match="fused bias"):
        CudaBackend(tiny, 4, ops={"bias": "fused"})


def test_fused_residual_needs_the_paged_step(tiny):
    with pytest.raises(ValueError, match="fused residual"):
        CudaBackend(tiny, 4, ops={"matmul": "narrow", "residual": "fused"})


def test_batch_chunks_need_the_paged_cache(tiny):
    with pytest.raises(ValueError, match="chunks='batch' is flash-decoding's"):
        CudaBackend(tiny, 4, ops={"matmul": "narrow", "chunks": "batch"})


@pytest.mark.parametrize("attention,kernels", [("two_kernels", ["flash_decode_chunks", "merge_chunks"]),
                                               ("one_kernel", ["flash_decode"])])
def test_fused_step_kernels_per_layer(tiny, attention, kernels):
    """The fused step (recorded, not run): per layer, norm + QKV + RoPE + cache write, attention (its chunks then
    the merge; or one kernel, merged by each head's last block), O + residual, norm + gate/up + SwiGLU, down +
    residual; then the final norm and the logits, in one kernel."""
    n = 2 * chunk_unit(tiny.config.head_dim) + 1  # the keys of two chunks or more
    backend = CudaBackend(tiny, n + 1, weights="bf16", ops=FUSED | {"attention": attention})
    backend.rt.record(lambda: backend.prefill(list(range(n))))  # (recorded, not run)
    names = [launch[0] for launch in backend.rt.record(lambda: backend.decode(5))]
    layer = ["qkv_rope_split_k_vec", *kernels, "matmul_split_k_vec_add", "gate_up_swiglu_split_k_vec",
             "matmul_split_k_vec_add"]
    assert names == ["embedding_rows", *layer * tiny.config.n_layers, "matmul_transposed_vec"]


def test_row_dot_step_kernels_per_layer(tiny):
    """The row_dot step (recorded, not run): the fused step's five kinds of kernels per layer, each projection one
    pass over weight rows, six kernels with the merge's; five with attention in one launch (the default)."""
    n = 2 * chunk_unit(tiny.config.head_dim) + 1
    merged = ["flash_decode_chunks", "merge_chunks"], ["flash_decode"]  # row_dot's attention; the default's, one launch
    for ops, attention in zip((ROW_DOT, FIVE), merged, strict=True):
        backend = CudaBackend(tiny, n + 1, weights="bf16", ops=ops)
        backend.rt.record(lambda b=backend: b.prefill(list(range(n))))
        names = [launch[0] for launch in backend.rt.record(lambda b=backend: b.decode(5))]
        layer = ["qkv_rope_rows", *attention, "project_rows_add", "gate_up_swiglu_rows", "project_rows_add"]
        assert names == ["embedding_rows", *layer * tiny.config.n_layers, "matmul_transposed_vec"]


def test_row_dot_needs_the_fused_epilogues(tiny):
    with pytest.raises(ValueError, match="epilogues"):
        CudaBackend(tiny, 4, ops=FUSED | {"projection": "row_dot", "swiglu": "separate"})


@pytest.mark.parametrize("flavour", ["tiny", "tiny_qwen"])
def test_fused_step_gives_the_paged_steps_bits(request, flavour):
    """Every fusion keeps the unfused kernels' arithmetic: the logits of a prefill (several launches of rows on a
    GPU) and of a decode are the same bits (Llama: tied logits, the transposed kernel normalizing; the Qwen2
    flavour: QKV bias, untied head, the split-K kernel normalizing)."""
    model, logits = request.getfixturevalue(flavour), {}
    for name, ops in (("paged", PAGED), ("fused", FUSED)):
        backend = CudaBackend(model, 32, weights="bf16", ops=ops)
        logits[name] = (backend.prefill([5, 6, 7, 8, 9, 10]), backend.decode(11))
    for paged, fused in zip(*logits.values(), strict=True):
        np.testing.assert_array_equal(fused.view(np.uint32), paged.view(np.uint32))
