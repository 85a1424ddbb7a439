"""Every recipe gives the reference's tokens: greedy, and seeded (the same (seed, position) draws the same token on
the host and on the GPU). In the simulator on the tiny Qwen2 flavour, a few tokens (~6 s per token); on a GPU with
the real SmolLM2 weights, where the graph recipes (the default, overlap, among them) are checked too.
"""

import pytest
from checks import as_computed

from course_lib import Engine, generate
from course_lib.kernels import SIMULATOR

N_TOKENS = {"f32": 6, "bf16": 6, "seeded": 6} if SIMULATOR else {"f32": 64, "bf16": 64, "seeded": 64}


def cuda_engine(model, weights, recipe):
    return Engine(model, "cuda", recipe=recipe, weights=weights, capacity=128)


@pytest.mark.parametrize("recipe", ["baseline", "narrow", "plan"])
@pytest.mark.parametrize("weights", ["f32", "bf16"])
def test_greedy_tokens_match_reference(model, weights, recipe):
    if SIMULATOR and recipe != "baseline" and weights == "bf16":
        pytest.skip("simulator time: the narrow kernels' bf16 path is covered by test_logits_match_reference")
    n = N_TOKENS[weights] if recipe == "baseline" or not SIMULATOR else 6
    kw = dict(max_new_tokens=n, stop=False)
    prompt = "The capital of France is"
    expected = generate(as_computed(model, weights), prompt, backend="numpy", **kw)
    assert cuda_engine(model, weights, recipe).generate(prompt, **kw).token_ids == expected.token_ids


@pytest.mark.parametrize("recipe", ["baseline", "plan"])
def test_seeded_sampling_matches_reference(model, recipe):
    """The same (seed, position) gives the same token: the host's sampler (baseline) and the GPU's (plan)."""
    kw = dict(max_new_tokens=N_TOKENS["seeded"], stop=False, temperature=0.8, top_p=0.95, seed=11)
    expected = generate(model, "Once upon a time", backend="numpy", **kw)
    assert cuda_engine(model, "f32", recipe).generate("Once upon a time", **kw).token_ids == expected.token_ids


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("recipe", ["graph", "fused", "overlap", "row_dot", "five"])
def test_graph_recipes_give_the_reference_tokens_on_several_prompts(smollm, recipe):
    """The step plan replayed as a CUDA graph, the tokens chosen on the GPU, with and without the fused residual,
    with and without overlapping launches."""
    engine = cuda_engine(smollm, "bf16", recipe)
    for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"):
        expected = generate(as_computed(smollm, "bf16"), prompt, backend="numpy", max_new_tokens=32, stop=False)
        assert engine.generate(prompt, max_new_tokens=32, stop=False).token_ids == expected.token_ids, prompt


@pytest.mark.skipif(SIMULATOR, reason="CUDA graphs need a GPU (the plan's sampler is checked against the host's "
                    "in the simulator: test_seeded_sampling_matches_reference)")
def test_graph_recipe_seeded_sampling_is_reproducible(smollm):
    engine = cuda_engine(smollm, "bf16", "graph")
    kw = dict(max_new_tokens=48, stop=False, temperature=1.0, top_k=40, top_p=0.9, seed=5)
    first = engine.generate("Once upon a time", **kw).token_ids
    assert engine.generate("Once upon a time", **kw).token_ids == first
    # eight steps per replay, the fused step, overlapped, in one pass per projection: the same draws
    for other in ("graph8", "fused", "overlap", "row_dot", "five"):
        assert cuda_engine(smollm, "bf16", other).generate("Once upon a time", **kw).token_ids == first, other
    assert engine.generate("Once upon a time", **(kw | {"seed": 6})).token_ids != first


@pytest.mark.parametrize("rows,ops", [(None, "FUSED"), (None, "ROW_DOT"), (4, "FUSED")],
                         ids=["step", "row_dot step", "batch of 4"])
def test_every_kernel_of_the_fused_step_waits_for_its_inputs(tiny, rows, ops):
    """The overlap recipe launches every kernel of the fused step programmatically: each may start before the kernel
    before it has finished, so each must be one that waits for its inputs first (kernels/overlap.py; the sm_90
    compile test checks that a marked kernel's PTX has the wait). The same for the batched step."""
    from course_lib.gpu import backend as cuda_backend
    from course_lib.gpu.plan import BatchPlan, StepPlan

    backend = cuda_backend.CudaBackend(tiny, 32, ops=getattr(cuda_backend, ops), pages=4)
    plan = StepPlan(backend, overlap=True) if rows is None else BatchPlan(backend, rows, pad_slot=48, overlap=True)
    recorded = plan.rt.record(plan._step, scratch_per_site=True)
    assert len(recorded) == plan.launches
    if rows is None:  # one sequence's step ends with its sampler, which writes the next token's embedding row
        assert recorded[-1][0] == "sample_next" and "embedding_rows" not in [name for name, *_ in recorded]
    assert [name for name, kernel, *_ in recorded if not getattr(kernel, "waits_for_inputs", False)] == []
