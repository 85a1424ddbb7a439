"""The megakernel's instruction list and its NumPy twin (course_lib.megakernel): the dependencies are complete
(proved from the declared reads and writes, and every single dependency is needed), the twin computes the
reference's logits and tokens in any order the dependencies allow, and the diff tool names an injected fault."""

import numpy as np
import pytest
from checks import logit_tolerance

from course_lib import generate, reference
from course_lib.megakernel import Twin, TwinState, build_program, check_dependencies, first_difference, random_order
from course_lib.megakernel.program import ancestors
from course_lib.model.config import LLAMA_32_1B, SMOLLM2_135M

CAPACITY = 64


@pytest.fixture(params=["tiny", "tiny_qwen"])
def model(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("config", [SMOLLM2_135M, LLAMA_32_1B], ids=["SmolLM2-135M", "Llama-3.2-1B"])
def test_dependencies_complete_on_real_shapes(config):
    program = build_program(config)
    assert check_dependencies(program) == []
    per_layer = config.n_heads + 2 * config.n_kv_heads + config.n_kv_heads + 2 * -(-config.d_model // 64) \
        + -(-config.d_ff // 64)
    assert len(program) == 1 + config.n_layers * per_layer + -(-config.vocab_size // 4096) + 1


def test_every_dependency_is_needed(tiny):
    """Drop any one dependency: check_dependencies finds two instructions left unordered on a shared region."""
    program = build_program(tiny.config)
    for i, ins in enumerate(program):
        for d in ins.deps:
            weakened = list(program)
            weakened[i] = type(ins)(**{**ins.__dict__, "deps": tuple(x for x in ins.deps if x != d)})
            assert check_dependencies(weakened), f"{ins} without {program[d]}"


def test_instructions_wait_only_for_earlier_ones(tiny):
    program = build_program(tiny.config)
    program[0], program[1] = program[1], program[0]
    with pytest.raises(ValueError, match="dependency order"):
        ancestors(program)


def test_twin_computes_the_reference_logits_in_any_order(model, rng):
    c = model.config
    ids = rng.integers(0, c.vocab_size, 6)
    ref = reference.forward(model.weights, c, ids, reference.KVCache(c, CAPACITY),
                            reference.rope_tables(c, CAPACITY), all_logits=True)
    twin = Twin(model, CAPACITY)
    in_order, shuffled = TwinState.empty(model, CAPACITY), TwinState.empty(model, CAPACITY)
    for i, token in enumerate(ids):
        for state, order in ((in_order, None), (shuffled, random_order(twin.program, rng))):
            state.token[0], state.position[0] = token, i
            twin.run(state, order)
        np.testing.assert_array_equal(shuffled.logits, in_order.logits)  # each instruction's inputs are the same
        assert np.abs(in_order.logits - ref[i]).max() <= logit_tolerance(c, np.abs(ref[i]).max())
        assert in_order.position[0] == i + 1 and in_order.token[0] == np.argmax(in_order.logits)


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=20, seed=7)], ids=["greedy", "seeded"])
def test_twin_generates_the_reference_tokens(model, rng, sampling):
    prompt = [3, 17, 42]
    expected = generate(model, prompt, backend="numpy", max_new_tokens=12, stop=False, **sampling).token_ids
    twin = Twin(model, CAPACITY)
    args = (sampling.get("temperature", 0.0), sampling.get("top_k"), None, sampling.get("seed", 0))
    assert twin.generate(prompt, 12, args, order_rng=rng) == expected


def test_first_difference_names_an_injected_fault(tiny, rng):
    twin = Twin(tiny, CAPACITY)

    def step(fault=None):
        state = TwinState.empty(tiny, CAPACITY)
        state.token[0] = 11
        return twin.trace(state, random_order(twin.program, np.random.default_rng(1)), fault)

    clean = step()
    assert first_difference(twin.program, clean, step(), 0.0) is None
    target = next(i for i, ins in enumerate(twin.program) if ins.op == "gate_up" and ins.layer == 1)

    def fault(i, state):
        if i == target:
            state.act[twin.program[i].start] *= 1.01

    index, ins, diff = first_difference(twin.program, clean, step(fault), 1e-6)
    assert index == target and diff > 0 and str(ins).startswith("gate_up(layer 1")
