"""What each kernel of a recipe's decode step costs inside its CUDA graph, on the GPU.

    python tools/in_graph_costs.py [--recipe five] [--context 64] [--model random:SmolLM2-135M-Instruct]
                                   [--sampler] [--save FILE.json]

Notebook 06's profile times each kernel between two events, one launch at a time. Inside the graph the kernels
overlap, and what a kernel costs is what the step loses with it. So the step's graph is timed as recorded; with
every launch of one kernel doubled, removed, or replaced by an empty kernel of the same grid that only waits for the
kernel before it; and with every kernel emptied at once. A timing: a graph of STEPS steps, queued behind a kernel
that holds the GPU (so that the host's launch is not timed), the median of REPEATS replays, per step; the position
restarts at --context before each. Each kernel's cost is printed in µs per launch.

--sampler times variants of the step's last kernel, the sampler, instead, taking turns for ROUNDS rounds: as
recorded; with the token history in device memory instead of mapped host memory; given only
the first SLICES logits, one per block (no pass over the logits); given one logit in one block (no pass and no
counter). These change what the sampler reads, not the step around it. Then stand-ins that choose token 0 without
reading a logit, in one block, and write only some of what the sampler writes: nothing (emptied: the steps are no
longer fed), the next step's x alone, its position (with token, slot and history) alone, or both. Then three that
write both and first do one part of the sampler's work: read its settings, count on its counter, or find the
greedy token of one logit as it does (the slice's best, the counter, the best of the slices) without its draw.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from numba import float32, int32

from course_lib.kernels import cuda  # a module global: the simulator gives kernels its own `cuda` through them
from course_lib.kernels.overlap import inputs_ready, waits_for_inputs

STEPS, REPEATS, ROUNDS = 4, 9, 3


def time_step(plan, launches, context: int) -> float:
    """GPU µs per step of `launches` (callables, one step's launches in order) replayed as a graph of STEPS steps."""
    from course_lib.gpu.graphs import Graph
    from course_lib.measure.bench import held_ms

    plan.stage(context, STEPS * (REPEATS + 2) * 2, 0.0, None, None, 0)
    stream = plan.rt.stream
    graph = Graph(lambda: [go() for _ in range(STEPS) for go in launches], stream)
    graph.launch(stream)  # once untimed: the first replay uploads the graph
    stream.synchronize()
    return 1e3 * held_ms(lambda: graph.launch(stream), stream, 3000, REPEATS) / STEPS


def kernel_costs(plan, context: int) -> dict:
    """{"step_us", "every_kernel_emptied_us", "step_us_again", "kernels_per_step", "per_launch_us": {name: {"count",
    "doubled", "removed", "emptied"}}}: each kernel's µs per launch (doubled: what the step gains, removed and
    emptied: what it loses)."""
    @waits_for_inputs
    @cuda.jit
    def nothing(stub):
        inputs_ready()

    rt, names = plan.rt, plan.names
    launches = [rt.prepared(kernel, grid, block, args) for _, kernel, grid, block, args in plan.recorded]
    stub = cuda.device_array(1, np.float32)
    empties = [rt.prepared(nothing, grid, block, (stub,)) for _, _, grid, block, _ in plan.recorded]
    step = time_step(plan, launches, context)
    out = {"kernels_per_step": len(names), "step_us": step,
           "every_kernel_emptied_us": time_step(plan, empties, context), "per_launch_us": {}}
    print(f"the step: {step:.1f} us; every kernel emptied: {out['every_kernel_emptied_us']:.1f} us", flush=True)
    for name in dict.fromkeys(names):
        count = names.count(name)
        doubled = [g for n, go in zip(names, launches, strict=True) for g in ((go, go) if n == name else (go,))]
        removed = [go for n, go in zip(names, launches, strict=True) if n != name]
        emptied = [e if n == name else go for n, go, e in zip(names, launches, empties, strict=True)]
        row = {"count": count, "doubled": (time_step(plan, doubled, context) - step) / count,
               "removed": (step - time_step(plan, removed, context)) / count,
               "emptied": (step - time_step(plan, emptied, context)) / count}
        out["per_launch_us"][name] = row
        print(f"{name:28s} x{count:3d}  us a launch: doubled {row['doubled']:+6.2f}, removed {-row['removed']:+6.2f}, "
              f"emptied {-row['emptied']:+6.2f}", flush=True)
    out["step_us_again"] = time_step(plan, launches, context)
    return out


def stand_in(feeds_x: bool, advances: bool, embed_into, before: str = "nothing"):
    """A kernel with sample_next's arguments that writes, as sample_next does, x = the chosen token's embedding row
    (feeds_x; embed_into: kernels.sampling's, for the table's dtype) and the token, position, slot and history
    (advances). One block. It chooses token 0 after doing `before`: "nothing"; "settings": read the sampler's four
    settings (part_v[0] = temperature + top_p, part_i[0] = the low 16 bits of top_k + seed: the reads are made);
    "counter": count on counters[0] (fence, atomic add, reset); or, "greedy", it chooses as sample_next does
    without its draw: the largest of the logits it is given and its lowest index, written to part_*[0], counted,
    then reduced again as the last block does."""
    from course_lib.kernels import last_to_arrive
    from course_lib.kernels.sampling import advance, block_best, block_best_of

    if before not in ("nothing", "settings", "counter", "greedy"):
        raise ValueError(f"stand_in: before {before!r}")
    settings, counter, greedy = before == "settings", before == "counter", before == "greedy"

    @waits_for_inputs
    @cuda.jit
    def sample_next_stand_in(logits, weights, temperature_top_p, top_k_seed, token, position, slot, page_table,
                             page_size, history, table, x, part_v, part_i, part_nan, counters):
        inputs_ready()
        f_scratch = cuda.shared.array(32, dtype=float32)
        i_scratch = cuda.shared.array(32, dtype=int32)
        n_scratch = cuda.shared.array(32, dtype=int32)
        tok = 0
        if settings and cuda.threadIdx.x == 0:
            part_v[0] = float32(temperature_top_p[0] + temperature_top_p[1])
            part_i[0] = int32((top_k_seed[0] + top_k_seed[1]) & 0xFFFF)
        if greedy:
            v, i, nan = block_best(logits, 0, logits.shape[0], f_scratch, i_scratch, n_scratch)
            if cuda.threadIdx.x == 0:
                part_v[0], part_i[0], part_nan[0] = v, i, nan
        if counter or greedy:
            last_to_arrive(counters, 0, 1)  # one block: always the last
        if greedy:
            tok = block_best_of(part_v[0], part_i[0], part_nan[0], f_scratch, i_scratch, n_scratch)[1]
        if feeds_x:
            embed_into(table, tok, x)
        if advances:
            advance(tok, position[0], token, position, slot, page_table, page_size, history)

    return sample_next_stand_in


def sampler_variants(engine, context: int) -> dict:
    """{"runs": {variant: [µs per step, a round each]}, "median": {variant: µs}} of the step with its sampler as
    recorded ("shipped"), with the history in device memory ("history_on_device"), on SLICES logits ("no_pass"),
    on one logit in one block ("no_pass_no_counter"), and replaced by stand-ins that write nothing ("emptied"),
    x alone ("feeds_x_only"), the position alone ("advances_only") or both ("feeds_and_advances"), and by stand-ins
    that write both after reading the settings ("reads_settings"), counting ("counts"), or finding the greedy token
    of one logit as sample_next does, without its draw ("greedy_without_draw")."""
    from course_lib.kernels import sampling

    plan = engine.plan
    name, kernel, grid, block, args = plan.recorded[-1]
    if name != "sample_next":
        raise SystemExit(f"error: the step of recipe {engine.recipe.name!r} does not end with sample_next")
    rt, logits, rest, (history, table) = plan.rt, args[0], tuple(args[1:]), args[9:11]
    shipped = [rt.prepared(k, g, b, a) for _, k, g, b, a in plan.recorded]

    def last(*launch):
        return shipped[:-1] + [rt.prepared(*launch)]

    in_device_memory = cuda.device_array(history.shape, history.dtype)  # the sampler alone reads and writes history
    variants = {"shipped": shipped,
                "history_on_device": last(kernel, grid, block, args[:9] + (in_device_memory,) + args[10:]),
                "no_pass": last(kernel, sampling.SLICES, block, (logits[:sampling.SLICES],) + rest),
                "no_pass_no_counter": last(kernel, 1, block, (logits[:1],) + rest)}
    embed_into = sampling.embed_into(table)
    for label, feeds_x, advances in (("emptied", False, False), ("feeds_x_only", True, False),
                                     ("advances_only", False, True), ("feeds_and_advances", True, True)):
        variants[label] = last(stand_in(feeds_x, advances, embed_into), 1, block, args)
    for label, before in (("reads_settings", "settings"), ("counts", "counter"), ("greedy_without_draw", "greedy")):
        variants[label] = last(stand_in(True, True, embed_into, before), 1, block, (logits[:1],) + rest)
    runs = {label: [] for label in variants}
    for _ in range(ROUNDS):
        for label, launches in variants.items():
            runs[label].append(time_step(plan, launches, context))
            print(f"{label:20s} {runs[label][-1]:.1f} us a step", flush=True)
    return {"runs": runs, "median": {label: float(np.median(v)) for label, v in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="five", help="a recipe with a step plan (default five, the default)")
    parser.add_argument("--context", type=int, default=64, help="prompt length the steps start after (default 64)")
    parser.add_argument("--model", default="random:SmolLM2-135M-Instruct", help="as for bench (default random "
                        "weights of SmolLM2-135M-Instruct's shapes)")
    parser.add_argument("--sampler", action="store_true", help="time the sampler's variants instead")
    parser.add_argument("--save", metavar="FILE.json", help="keep the numbers")
    args = parser.parse_args(argv)
    if args.context < 1:
        parser.error("--context is a positive prompt length")
    from course_lib.device import gpu_available
    from course_lib.recipes import get_recipe

    try:
        recipe = get_recipe(args.recipe)
    except ValueError as error:
        parser.error(str(error))
    if recipe.replay != "graph":
        parser.error(f"recipe {args.recipe!r} replays no step graph (replay {recipe.replay!r})")

    if not gpu_available():
        print("error: in-graph costs are GPU times: no CUDA GPU here", file=sys.stderr)
        return 2
    from course_lib.__main__ import _bench_model
    from course_lib.engine import Engine
    from course_lib.measure import bench

    model = _bench_model(args.model)
    engine = Engine(model, "cuda", recipe=args.recipe, capacity=args.context + 2 * STEPS * (REPEATS + 2) + 1)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, args.context).tolist()
    engine.generate(ids, max_new_tokens=8, stop=False)  # compiles, records the plan
    costs = sampler_variants(engine, args.context) if args.sampler else kernel_costs(engine.plan, args.context)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"gpu": bench.gpu_name(), "recipe": args.recipe, "model": args.model, "context": args.context,
                       "steps_a_replay": STEPS, "replays": REPEATS} | costs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
