"""The megakernel's instruction list and its NumPy twin (course_lib.megakernel): the dependencies are complete
(proved from the declared reads and writes, and every single dependency is needed), the twin computes the
reference's logits and tokens in any order the dependencies allow, and the diff tool names an injected fault."""

import dataclasses

import numpy as np
import pytest
from checks import logit_tolerance

from course_lib import generate, reference
from course_lib.megakernel import (
    Twin,
    TwinState,
    assign,
    build_program,
    check_dependencies,
    cost,
    encode,
    first_difference,
    random_order,
    simulate,
)
from course_lib.megakernel.program import ancestors, phases
from course_lib.model.config import LLAMA_32_1B, SMOLLM2_135M

CAPACITY = 64


@pytest.fixture(params=["tiny", "tiny_qwen"])
def model(request):
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("config", [SMOLLM2_135M, LLAMA_32_1B], ids=["SmolLM2-135M", "Llama-3.2-1B"])
def test_dependencies_complete_on_real_shapes(config):
    assert check_dependencies(build_program(config, cols=16)) == []  # qkv heads in four slices (SmolLM2)
    program = build_program(config)
    assert check_dependencies(program) == []
    per_layer = config.n_heads + 2 * config.n_kv_heads + config.n_heads + 2 * -(-config.d_model // 64) \
        + -(-config.d_ff // 32)  # qkv heads (hd = 64: a head's 32 RoPE pairs in one slice of 64 weight rows),
    # attention by query head, o_proj, down, gate_up slices (64 weight rows: 32 gate and 32 up)
    assert len(program) == 1 + config.n_layers * per_layer + -(-config.vocab_size // 4096) + 1


@pytest.mark.parametrize("config", [SMOLLM2_135M, LLAMA_32_1B], ids=["SmolLM2-135M", "Llama-3.2-1B"])
def test_phases_cut_the_step_where_a_grid_barrier_goes(config):
    """The grid-barrier version's phases: five a layer, then logits and sample after embed; every instruction waits
    only for earlier phases, so that a barrier between consecutive phases orders every dependency."""
    program = build_program(config)
    phase = phases(program)
    assert phase[-1] + 1 == 1 + 5 * config.n_layers + 2 and phase == sorted(phase)
    assert all(phase[d] < phase[i] for i, ins in enumerate(program) for d in ins.deps)
    first = 1 + config.n_heads + 2 * config.n_kv_heads  # layer 0's first attention head (after embed and qkv)
    merged = list(program)  # attention heads that waited for one another could not be split by a barrier
    merged[first + 1] = dataclasses.replace(program[first + 1], deps=(first,))
    with pytest.raises(ValueError, match="its own phase"):
        phases(merged)


@pytest.mark.parametrize("cols", [64, 8], ids=["whole-heads", "split-heads"])
def test_every_dependency_is_needed(tiny, cols):
    """Drop any one dependency: check_dependencies finds two instructions left unordered on a shared region (cols =
    8: a qkv instruction takes 4 of a head's 8 RoPE pairs)."""
    program = build_program(tiny.config, cols=cols)
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


@pytest.mark.parametrize("cols", [64, 8], ids=["whole-heads", "split-heads"])
def test_twin_computes_the_reference_logits_in_any_order(model, rng, cols):
    c = model.config
    ids = rng.integers(0, c.vocab_size, 6)
    ref = reference.forward(model.weights, c, ids, reference.KVCache(c, CAPACITY),
                            reference.rope_tables(c, CAPACITY), all_logits=True)
    twin = Twin(model, CAPACITY, cols=cols)
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

    faulted = step(fault)
    index, ins, diff = first_difference(twin.program, clean, faulted, 1e-6)
    assert index == target and diff > 0 and str(ins).startswith("gate_up(layer 1")
    assert first_difference(twin.program, clean, faulted, diff / 2)[0] == target  # the tolerance is the one given

    def nan_fault(i, state):
        if i == target:
            state.act[twin.program[i].start] = np.nan

    with pytest.raises(RuntimeError, match="NaN in the logits"):  # the NaN reaches the sampler
        step(nan_fault)
    faulty = {}
    for i in range(len(twin.program)):  # a trace with the fault, as a debugger would hold it
        faulty[i] = [a.copy() for a in clean[i]]
        if i == target:
            faulty[i][0][0] = np.nan
    index, _, diff = first_difference(twin.program, clean, faulty, 1.0)
    assert index == target and diff == np.inf


# ---- the blocks' queues (course_lib.megakernel.schedule) ----

def critical_path(program, seconds) -> float:
    end = np.zeros(len(program))
    for i, ins in enumerate(program):
        end[i] = max((end[d] for d in ins.deps), default=0.0) + seconds[i]
    return float(end.max())


def replay_by_scanning(program, queues, seconds):
    """simulate's rule, scanned the slow way: at each step every block's next instruction is examined, and of those
    whose dependencies have all ended the earliest start (ties: the lowest block) runs. -> (end, idle)."""
    end, free, idle, nxt = np.full(len(program), np.nan), np.zeros(len(queues)), np.zeros(len(queues)), \
        [0] * len(queues)
    for _ in range(len(program)):
        start, b = min((max(free[b], max((end[d] for d in program[q[nxt[b]]].deps), default=0.0)), b)
                       for b, q in enumerate(queues) if nxt[b] < len(q)
                       and not np.isnan([end[d] for d in program[q[nxt[b]]].deps]).any())
        i = queues[b][nxt[b]]
        idle[b] += start - free[b]
        end[i] = free[b] = start + seconds[i]
        nxt[b] += 1
    return end, idle


@pytest.mark.parametrize("blocks", [1, 3, 16])
def test_simulate_replays_the_queues_by_the_scanning_rule(tiny, rng, blocks):
    program = build_program(tiny.config, cols=16)
    for seconds in (rng.random(len(program)), np.ones(len(program))):  # ones: many ties
        owner = rng.integers(0, blocks, len(program))  # random queues, each in program order
        for queues in ([np.flatnonzero(owner == b).tolist() for b in range(blocks)],
                       assign(program, seconds, blocks).queues):
            schedule = simulate(program, queues, seconds)
            end, idle = replay_by_scanning(program, queues, seconds)
            np.testing.assert_array_equal(schedule.end, end)
            np.testing.assert_array_equal(schedule.idle, idle)


@pytest.mark.parametrize("blocks", [1, 3, 16])
def test_assignment_runs_every_instruction_once_in_dependency_order(tiny, blocks):
    program = build_program(tiny.config, cols=16)
    seconds = cost(program, tiny.config, blocks, 1e11, context=32)
    schedule = assign(program, seconds, blocks)
    assert sorted(i for q in schedule.queues for i in q) == list(range(len(program)))
    assert all(q == sorted(q) for q in schedule.queues)
    for i, ins in enumerate(program):  # an instruction starts after everything it waits for has ended
        assert all(schedule.end[i] - seconds[i] >= schedule.end[d] - 1e-15 for d in ins.deps)
    assert schedule.makespan >= max(seconds.sum() / blocks, critical_path(program, seconds)) - 1e-12
    if blocks == 1:
        assert schedule.makespan == pytest.approx(seconds.sum()) and schedule.idle[0] == 0


def test_encoded_arrays_hold_the_program(tiny):
    program = build_program(tiny.config)
    schedule = assign(program, np.ones(len(program)), 4)
    enc = encode(program, schedule.queues)
    for i, ins in enumerate(program):
        assert tuple(enc["ops"][i, 1:]) == (ins.layer, ins.start, ins.stop)
        assert tuple(enc["deps"][enc["deps_start"][i]:enc["deps_start"][i + 1]]) == ins.deps
    for b, q in enumerate(schedule.queues):
        assert enc["queue"][enc["queue_start"][b]:enc["queue_start"][b + 1]].tolist() == q
    assert all(a.dtype == np.int32 for a in enc.values())


def test_queues_out_of_program_order_can_deadlock(tiny):
    program = build_program(tiny.config)
    n = len(program)
    queues = [[n - 1] + list(range(n - 1))]  # sample first: it waits for what comes after it in its own queue
    with pytest.raises(ValueError, match="deadlock"):
        simulate(program, queues, np.ones(n), check=False)
    for run in (lambda: simulate(program, queues, np.ones(n)), lambda: encode(program, queues),
                lambda: Twin(tiny, CAPACITY).run_queues(TwinState.empty(tiny, CAPACITY), queues,
                                                        np.random.default_rng(0))):
        with pytest.raises(ValueError, match="program order"):
            run()
    with pytest.raises(ValueError, match="exactly one queue"):
        encode(program, [list(range(n)), [0]])


def test_blocks_running_their_queues_compute_the_step(model, rng):
    """The twin run as the persistent kernel would run it (each block its queue, at arbitrary relative speeds,
    waiting on the done flags) gives the bits of the program order."""
    twin = Twin(model, CAPACITY)
    queues = assign(twin.program, rng.random(len(twin.program)), 5).queues
    by_blocks, in_order = TwinState.empty(model, CAPACITY), TwinState.empty(model, CAPACITY)
    for i, token in enumerate([7, 3, 11]):
        for state in (by_blocks, in_order):
            state.token[0], state.position[0] = token, i
        twin.run_queues(by_blocks, queues, rng)
        twin.run(in_order)
        np.testing.assert_array_equal(by_blocks.logits, in_order.logits)
        np.testing.assert_array_equal(by_blocks.k_cache, in_order.k_cache)


@pytest.mark.parametrize("config", [SMOLLM2_135M, LLAMA_32_1B], ids=["SmolLM2-135M", "Llama-3.2-1B"])
def test_counters_express_every_dependency(config):
    """Each instruction waits for whole groups (one counter each), and the groups it waits for hold exactly its
    dependencies; a dependency on part of a group is refused."""
    import dataclasses

    from course_lib.megakernel.schedule import counter_tables

    program = build_program(config, cols=16, vocab_cols=384)
    t = counter_tables(program, config)
    members = [set(np.flatnonzero(t["counter_of"] == c)) for c in range(len(t["sizes"]))]
    assert [len(m) for m in members] == list(t["sizes"])
    for i, ins in enumerate(program):
        waited = t["waits"][t["waits_start"][i]:t["waits_start"][i + 1]]
        assert set().union(*(members[c] for c in waited)) == set(ins.deps)
    program[-1] = dataclasses.replace(program[-1], deps=program[-1].deps[1:])  # sample: all logits but one
    with pytest.raises(ValueError, match="part of a group"):
        counter_tables(program, config)
